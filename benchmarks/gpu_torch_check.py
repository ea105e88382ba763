"""The torch-only part of ``make gpu-check``: carpool's own batching on a GPU, no Ray or vLLM.

``make gpu-check`` (``benchmarks/gpu_check.py``) needs the whole GPU stack: Ray, vLLM's CUDA
build, the packaged models. Where only torch and transformers are installed (a lent GPU
machine with no package registry: PLATFORM.md), this runs the two parts of carpool that are
its own code on the device, with no server in front:

- **Encoders' batching.** Texts of mixed lengths are cut into passes by carpool's splitter
  (``carpool.batching.make_splitter`` with serve-gpu.yaml's embedder ``user_config``), each
  pass one padded forward of the embedder on the device, in the dtype and under the
  ``gpu_memory_fraction`` cap serve-gpu.yaml gives it (``carpool.models.load_pretrained``).
  Every vector is compared with the same text encoded alone: batching and padding must not
  move a vector (cosine >= ``MIN_COSINE``). Items/s over the whole set is timed.
- **carpool's generation engine.** ``ContinuousEngine`` over a ``SlotRunner`` (what a
  ``mode: continuous`` replica runs) with concurrent greedy requests; each request's tokens
  are compared with the same request run alone, and tokens/s and engine steps are kept.

Writes one JSON (``status``: ok | refused | failed). Without CUDA it refuses at once, unless
``--device cpu`` asks for the CPU (the unit test runs it so, on tiny models, with Ray
blocked). The module imports only the standard library and gpu_check's light helpers at its
top; torch, transformers and carpool's Ray-free modules are imported where used.

    python -m benchmarks.gpu_torch_check --embedder DIR --generator DIR --out gpu-torch.json
    python -m benchmarks.gpu_torch_check          # the packaged models, where installed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

# Light at import (yaml, the standard library): no Ray, vLLM or pydantic.
from benchmarks.gpu_check import versions, write

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu-torch-check.json"
# Batching may reorder and pad, never change a vector: fp16 passes of different widths agree
# to about 1e-4 in cosine; a mask or padding bug lands far below this.
MIN_COSINE = 0.999
WORDS = ["the", "a", "lighthouse", "keeper", "found", "message", "in", "bottle", "tide",
         "bay", "storm", "passed", "over", "harbour", "ships", "waited", "for", "light"]  # fmt: skip


def embedder_settings(config: Path = ROOT / "serve-gpu.yaml") -> dict[str, Any]:
    """serve-gpu.yaml's embedder: its splitter knobs (``user_config``), dtype and memory cap,
    read from the file so the check batches as a GPU replica would."""
    import yaml  # a dependency of transformers: present wherever this check can run

    for app in yaml.safe_load(config.read_text())["applications"]:
        embedder = (app.get("args") or {}).get("embedder")
        if embedder is None:
            continue
        (entry,) = [d for d in app.get("deployments") or [] if d["name"] == "embedder"]
        knobs = entry["user_config"]
        return {
            "split_policy": knobs["split_policy"],
            "max_batch_size": knobs["max_batch_size"],
            "max_batch_tokens": knobs["max_batch_tokens"],
            "pass_overhead_tokens": knobs["pass_overhead_tokens"],
            "dtype": embedder["source"].get("dtype", "auto"),
            "gpu_memory_fraction": embedder.get("gpu_memory_fraction"),
        }
    raise ValueError(f"{config} has no app with an embedder")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_torch_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument(
        "--embedder",
        default="packaged:all-MiniLM-L6-v2",
        help="an encoder folder or carpool model source",
    )
    parser.add_argument(
        "--generator",
        default="packaged:SmolLM2-135M-Instruct",
        help="a causal LM folder or carpool model source",
    )
    parser.add_argument("--texts", type=int, default=512, help="texts the encoder batches")
    parser.add_argument("--requests", type=int, default=16, help="concurrent generations")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per generation")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device {args.device!r}: choose cuda or cpu")
    if args.texts < 1 or args.requests < 1 or args.max_tokens < 1:
        parser.error(
            f"--texts ({args.texts}), --requests ({args.requests}) and --max-tokens "
            f"({args.max_tokens}) must be positive"
        )
    return args


def refusal(device: str) -> str | None:
    """Why this machine cannot run the check on ``device``, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: this check needs torch and transformers"
    if device == "cuda" and not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} sees no CUDA device (a CPU build, no GPU, or "
            "CUDA_VISIBLE_DEVICES hides it); --device cpu runs the same check on the CPU"
        )
    return None


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` texts of 1 to 120 words: lengths mixed as the splitter sees them in service."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))) for _ in range(n)]


# --- encoders --------------------------------------------------------------------------------


def embed_pass(model: Any, batch: list[list[int]], pad_id: int, device: str) -> Any:
    """One padded forward over ``batch`` (token-id lists), mean-pooled and L2-normalised:
    ``TextEmbedder.embed_ids`` in deployments/embedder.py for a mean-pooled encoder, which
    cannot be imported here (that module imports Ray); tests/unit/test_gpu_check.py fails
    when the two disagree."""
    import torch

    longest = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1).cpu()


def check_encoder(source: str, device: str, n_texts: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModel

    from carpool.batching import make_splitter, padded_tokens
    from carpool.models import load_pretrained, resolve_pooling

    knobs = embedder_settings()
    # On the CPU (the unit test): float32 and no cap, which torch has only for CUDA.
    fraction = knobs["gpu_memory_fraction"] if device == "cuda" else None
    dtype = knobs["dtype"] if device == "cuda" else "float32"
    loaded = load_pretrained(source, AutoModel, device, dtype, gpu_memory_fraction=fraction)
    model, tokenizer = loaded.model, loaded.tokenizer
    pooling = resolve_pooling(None, loaded.path, getattr(model.config, "model_type", None))
    if pooling != "mean":
        raise ValueError(f"{source} pools by {pooling!r}; this check pools by mean only")
    limit = min(getattr(model.config, "max_position_embeddings", 512) or 512, 512)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = [tokenizer(t, truncation=True, max_length=limit)["input_ids"] for t in texts(n_texts)]
    lengths = [len(x) for x in ids]
    splitter = make_splitter(
        knobs["split_policy"],
        knobs["max_batch_tokens"],
        knobs["max_batch_size"],
        knobs["pass_overhead_tokens"],
    )
    embed_pass(model, ids[:4], pad_id, loaded.device)  # warm-up: kernels, allocator
    sync = torch.cuda.synchronize if loaded.device.startswith("cuda") else (lambda: None)
    sync()
    started = time.perf_counter()
    passes = splitter.split(lengths)
    vectors: dict[int, Any] = {}
    for chosen in passes:
        out = embed_pass(model, [ids[i] for i in chosen], pad_id, loaded.device)
        vectors.update(zip(chosen, out, strict=True))
    sync()
    seconds = time.perf_counter() - started
    # The same texts one at a time (a sample: every 8th), as a pass of one would encode them.
    sample = list(range(0, n_texts, 8))
    cosines = [
        float(torch.dot(vectors[i], embed_pass(model, [ids[i]], pad_id, loaded.device)[0]))
        for i in sample
    ]
    result = {
        "model": Path(loaded.path).name if loaded.path else source,
        "device": loaded.device,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "texts": n_texts,
        "passes": len(passes),
        "real_tokens": sum(lengths),
        "padded_tokens": padded_tokens(lengths, passes),
        "seconds": round(seconds, 4),
        "items_per_s": round(n_texts / seconds, 1) if seconds > 0 else None,
        "min_cosine_to_alone": round(min(cosines), 6),
        "settings": knobs,
    }
    if loaded.device.startswith("cuda"):
        result["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return result


# --- carpool's generation engine -------------------------------------------------------------


async def _generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from carpool.generation.sampling import SamplingParams
    from carpool.generation.sequence import GenSequence

    async def one(prompt: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        async for event in engine.generate([GenSequence(prompt, params)]):
            if event.error:
                raise RuntimeError(event.error)
            tokens.extend(event.token_ids or [])
        return tokens

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def _run_engine(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    await engine.start()
    await _generate(engine, prompts[:1], 2)  # warm-up
    before = engine.stats()["steps"]
    started = time.perf_counter()
    together = await _generate(engine, prompts, max_tokens)
    seconds = time.perf_counter() - started
    steps = engine.stats()["steps"] - before
    alone = [(await _generate(engine, [p], max_tokens))[0] for p in prompts]
    tokens = sum(len(t) for t in together)
    return {
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "engine_steps": steps,
        # Greedy tokens batched with others against alone: equal in fp32; in half precision a
        # near-tie may flip, so this is reported, not required.
        "same_as_alone": sum(a == b for a, b in zip(together, alone, strict=True)),
    }


def check_engine(source: str, device: str, n_requests: int, max_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from carpool.generation.native import ContinuousEngine
    from carpool.generation.runner import SlotRunner
    from carpool.generation.scheduler import SchedulerLimits
    from carpool.generation.sequence import TokenizerInfo
    from carpool.models import load_pretrained

    loaded = load_pretrained(source, AutoModelForCausalLM, device, "auto")
    info = TokenizerInfo.from_tokenizer(
        loaded.tokenizer, getattr(loaded.model, "generation_config", None)
    )
    max_seq_len = 512
    limits = SchedulerLimits(max_num_seqs=max(n_requests, 1), max_step_tokens=512)
    # As carpool.generation.factory.make_engine builds mode 'continuous' (that module's
    # config types need pydantic, which a torch-only machine may lack).
    runner = SlotRunner(loaded.model, limits.max_num_seqs, max_seq_len, 64, info.pad_id)
    engine = ContinuousEngine(runner, info, limits, max_seq_len)
    rng = random.Random(1)
    prompts = [
        loaded.tokenizer(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))))[
            "input_ids"
        ]
        for _ in range(n_requests)
    ]
    try:
        result = asyncio.run(_run_engine(engine, prompts, max_tokens))
    finally:
        engine.close()
    name = Path(loaded.path).name if loaded.path else source
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    return {"model": name, "device": loaded.device, "dtype": dtype, **result}


# --- the run ---------------------------------------------------------------------------------


def _gpu() -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch_cuda": torch.version.cuda,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    result: dict[str, Any] = {
        "status": "failed",
        "reason": None,
        "device": args.device,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "gpu": None,
        "versions": {},
        "encoder": None,
        "engine": None,
        "wall_s": None,
        "command": " ".join(["python -m benchmarks.gpu_torch_check", *(argv or sys.argv[1:])]),
    }
    problem = refusal(args.device)
    if problem is not None:
        print(f"refused: {problem}", file=sys.stderr)
        result["status"], result["reason"] = "refused", problem
        write(result, args.out)
        return 1
    result["gpu"], result["versions"] = _gpu(), versions()
    try:
        result["encoder"] = check_encoder(args.embedder, args.device, args.texts)
        result["engine"] = check_engine(args.generator, args.device, args.requests, args.max_tokens)
        low = result["encoder"]["min_cosine_to_alone"] < MIN_COSINE
        result["status"] = "failed" if low else "ok"
        if low:
            result["reason"] = (
                f"a batched vector's cosine to the same text alone is "
                f"{result['encoder']['min_cosine_to_alone']} (< {MIN_COSINE}): batching "
                "changes embeddings on this device"
            )
    except Exception as exc:
        result["status"], result["reason"] = "failed", f"{type(exc).__name__}: {exc}"
    result["wall_s"] = round(time.monotonic() - started, 1)
    write(result, args.out)
    summary = {k: result[k] for k in ("status", "reason", "encoder", "engine")}
    print(json.dumps(summary, indent=2))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
