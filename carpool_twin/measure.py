"""Measures a cost profile: timed forward passes of each model a serve config serves.

Encoders are timed the way their replicas run a pass (``deployments/embedder.py``,
``deployments/ranker.py``): a right-padded ``rows x length`` batch built on the CPU, moved to
the device, one forward, results back on the CPU. Generators are timed through carpool's own
``SlotRunner`` (``carpool/generation/runner.py``), the pass the native continuous engine runs
for a prefill chunk and a decode step, on its slot KV cache. Token ids are random: a pass
costs the same whatever the tokens, and so whatever the weights, which is why
``--random-weights`` (the model built from its config) gives the same timings as the real
checkpoint on a machine that has only configs.

Only torch, transformers, numpy, PyYAML and Ray-free carpool modules are imported, so this
runs on a bare GPU machine. Each grid runs from the cheapest point up and stops a series once
one point takes longer than ``max_point_s``: the budget goes where passes are short.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carpool_twin.profile import ProfileError, choose_fit, fit_line, fit_terms

ENCODER_ROWS = (1, 4, 16, 64, 256)
ENCODER_LENGTHS = (16, 64, 128, 256, 512)
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# More prefill series: this many prompts in one padded chunk. A continuous engine under many
# clients prefills dozens of short prompts at once (64 arrivals of ~10 tokens: 39 rows in a
# 512-token step); a fit from 1 and 4 rows only extrapolated that far and priced it low.
PREFILL_ROWS = (4, 16, 64)
DECODE_BATCHES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
DECODE_CONTEXTS = (128, 512, 2048)
# Serving defaults when the serve config names none (carpool.config / deployments/generator).
DEFAULT_MAX_BATCH_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_STEP_TOKENS = 512
DEFAULT_MAX_SEQ_LEN = 2048
KV_BLOCK = 64  # the engine's default kv_block_size


@dataclass(frozen=True)
class ModelSpec:
    """One model of a serve config, with the batching limits that bound its grid."""

    role: str
    kind: str  # encoder | ranker_llm | cross_encoder | generator
    source: str
    max_batch_items: int = 64
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS  # encoders: per pass
    max_step_tokens: int = DEFAULT_STEP_TOKENS  # generators: per engine step
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    max_length: int | None = None


@dataclass
class MeasureOptions:
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None
    random_weights: bool = False
    models_dir: str | None = None
    min_time_s: float = 0.3  # per point: repeat passes until this much time is spent
    max_reps: int = 7
    max_point_s: float = 2.0  # a series stops after its first point slower than this
    quick: bool = False  # a coarse grid (tests, smoke runs)
    # Re-time a point (up to ``retries`` times, ``retry_wait_s`` apart) when other processes
    # used more than this many cores while it ran; None: never. Each point records the load.
    max_others_cores: float | None = None
    retries: int = 5
    retry_wait_s: float = 2.0
    log: Callable[[str], None] = field(default=print)


# --- the serve config --------------------------------------------------------------------------


def _kind(role: str, body: dict[str, Any]) -> str | None:
    if role == "embedder":
        return "encoder"
    if role == "ranker":
        return "cross_encoder" if body.get("backend") == "cross_encoder" else "ranker_llm"
    if "mode" in body or "limits" in body or role in ("small", "large"):
        return "generator"
    return None


def models_from_serve_config(path: str | Path) -> list[ModelSpec]:
    """The models a serve config's applications serve, by role, with their batch limits."""
    import yaml  # PyYAML: a transformers dependency, so present wherever transformers is

    doc = yaml.safe_load(Path(path).read_text())
    specs: dict[str, ModelSpec] = {}
    for app in doc.get("applications") or []:
        user = {d.get("name"): d.get("user_config") or {} for d in app.get("deployments") or []}
        for role, body in (app.get("args") or {}).items():
            if not isinstance(body, dict) or not isinstance(body.get("source"), dict):
                continue
            kind = _kind(role, body)
            if kind is None or role in specs:
                continue
            source, knobs = body["source"], user.get(role, {})
            limits = body.get("limits") or {}
            if kind == "generator":
                spec = ModelSpec(
                    role,
                    kind,
                    source["model"],
                    max_step_tokens=int(knobs.get("max_step_tokens", DEFAULT_STEP_TOKENS)),
                    max_num_seqs=int(knobs.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)),
                    max_seq_len=int(
                        limits.get("max_seq_len") or source.get("max_length") or DEFAULT_MAX_SEQ_LEN
                    ),
                )
            else:
                spec = ModelSpec(
                    role,
                    kind,
                    source["model"],
                    max_batch_items=int(knobs.get("max_batch_size", 64)),
                    max_batch_tokens=int(knobs.get("max_batch_tokens", DEFAULT_MAX_BATCH_TOKENS)),
                    max_length=source.get("max_length"),
                )
            specs[role] = spec
    if not specs:
        raise ProfileError(f"{path} serves no model (no args with source.model); check the path")
    return list(specs.values())


def locate(source: str, models_dir: str | None) -> str:
    """The folder holding ``source``'s config: ``models_dir/<name>`` first, else carpool's."""
    name = source.split(":", 1)[-1].rstrip("/").split("/")[-1]
    if models_dir:
        candidate = Path(models_dir) / name
        if (candidate / "config.json").is_file():
            return str(candidate)
    from carpool.models import resolve_model_source

    return resolve_model_source(source)


# --- models --------------------------------------------------------------------------------


def _auto_class(kind: str) -> Any:
    import transformers

    return {
        "encoder": transformers.AutoModel,
        "cross_encoder": transformers.AutoModelForSequenceClassification,
        "ranker_llm": transformers.AutoModelForCausalLM,
        "generator": transformers.AutoModelForCausalLM,
    }[kind]


def _has_weights(folder: str) -> bool:
    return any(f.endswith((".safetensors", ".bin")) for f in os.listdir(folder))


def build_model(folder: str, kind: str, device: str, dtype: Any, random_weights: bool) -> Any:
    """The model on ``device`` in eval mode; random weights are initialised there directly."""
    import torch
    from transformers import AutoConfig

    auto = _auto_class(kind)
    if random_weights:
        config = AutoConfig.from_pretrained(folder)
        with torch.device(device):  # no CPU copy first: a 0.5B model inits in place on a GPU
            model = auto.from_config(config, dtype=dtype)
    else:
        if not _has_weights(folder):
            raise ProfileError(
                f"{folder} has a config but no weights; pass --random-weights to time a "
                "randomly initialised copy (timings do not depend on weight values)"
            )
        model = auto.from_pretrained(folder, dtype=dtype).to(device)
    return model.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _others_cores(sampler: Any, before: Any) -> float | None:
    """Cores other processes kept busy since ``before`` (the replicas' idle-core arithmetic)."""
    now = sampler.sample() if sampler is not None else None
    if now is None or before is None or now.at_s - before.at_s <= 0:
        return None
    others = (now.busy_s - before.busy_s) - (now.own_s - before.own_s)
    return max(0.0, others / (now.at_s - before.at_s))


def _time_once(run: Callable[[], Any], opts: MeasureOptions) -> list[float]:
    samples: list[float] = []
    while True:
        _sync(opts.device)
        start = time.perf_counter()
        run()
        _sync(opts.device)
        samples.append((time.perf_counter() - start) * 1000)
        spent = sum(samples) / 1000
        # Never stop at the first run, however slow: it warms the shape (allocations, kernel
        # selection) and is not timed; alone it was (64 prefill rows: 3.8 s warm-up, ~1 s).
        if len(samples) >= opts.max_reps or (len(samples) >= 2 and spent >= 2 * opts.max_point_s):
            return samples
        if len(samples) >= 3 and spent >= opts.min_time_s:
            return samples


def time_pass(run: Callable[[], Any], opts: MeasureOptions) -> dict[str, Any]:
    """The fastest of repeated runs (``ms``) and their median; the first run warms the shape.

    The fastest, not the median: on a shared machine other work only ever adds time, so the
    minimum is the pass's own cost; the median says how much the neighbours added. The cores
    others used meanwhile come from this container's cgroup counters (``carpool.threads``).
    """
    from carpool.threads import CgroupSampler

    sampler = CgroupSampler() if opts.device == "cpu" else None
    attempts = 0
    while True:
        attempts += 1
        before = sampler.sample() if sampler is not None else None
        samples = _time_once(run, opts)
        others = _others_cores(sampler, before)
        busy = others is not None and opts.max_others_cores is not None
        if not busy or others <= opts.max_others_cores or attempts > opts.retries:
            break
        time.sleep(opts.retry_wait_s)
    timed = samples[1:] or samples
    return {
        "ms": round(min(timed), 4),
        "ms_median": round(statistics.median(timed), 4),
        "samples_ms": [round(s, 3) for s in samples],
        "others_cores": None if others is None else round(others, 2),
        "attempts": attempts,
    }


def _ids(rows: int, length: int, vocab: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(rows * 100_003 + length)
    return torch.randint(5, max(6, vocab - 1), (rows, length), generator=gen)


def encoder_pass(model: Any, kind: str, device: str, rows: int, length: int) -> Callable[[], Any]:
    """One replica pass of ``rows`` items padded to ``length`` (tensors built each call)."""
    import torch

    vocab = int(model.config.get_text_config().vocab_size)
    template = _ids(rows, length, vocab)

    def run() -> Any:
        ids = template.clone()  # the replica fills fresh tensors per pass, on the CPU
        mask = torch.ones((rows, length), dtype=torch.long)
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            if kind == "encoder":
                hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                out = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1))
            elif kind == "ranker_llm":
                # LlmPointwiseScorer: the body over all tokens, the LM head on one row each.
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                picked = hidden[torch.arange(rows, device=hidden.device), length - 1]
                out = model.lm_head(picked).float()
            else:
                out = model(input_ids=ids, attention_mask=mask).logits.float()
        return out.cpu()

    return run


# --- grids ---------------------------------------------------------------------------------


def _series(
    points: Sequence[dict[str, Any]],
    make: Callable[[dict[str, Any]], Callable[[], Any]],
    opts: MeasureOptions,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Times ``points`` in order; once one is slower than ``max_point_s`` the rest are skipped."""
    done: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for point in points:
        if done and done[-1]["ms"] / 1000 > opts.max_point_s:
            skipped.append(point)
            continue
        timing = time_pass(make(point), opts)
        done.append({**point, **timing})
    return done, skipped


def _section(
    points: list[dict[str, Any]], line_on: str, extended: dict[str, Sequence[str]]
) -> dict[str, Any]:
    fits = {"line": fit_line(points, line_on)}
    for name, features in extended.items():
        if len(points) > len(features) + 1:
            fits[name] = fit_terms(points, features)
    return {"points": points, "fits": fits, "use": choose_fit(fits)}


def fit_encoder_section(points: list[dict[str, Any]]) -> dict[str, Any]:
    """An encoder's ``pass`` section: a line in padded tokens, and fits adding rows and
    attention (rows x length squared) that replace it only where they earn their place."""
    return _section(
        points,
        "padded_tokens",
        {
            "rows": ("padded_tokens", "rows"),
            "attention": ("padded_tokens", "rows", "attention"),
        },
    )


def measure_encoder(model: Any, spec: ModelSpec, opts: MeasureOptions) -> dict[str, Any]:
    limit = spec.max_length or getattr(model.config, "max_position_embeddings", 512) or 512
    rows_grid = (1, 8, 32) if opts.quick else ENCODER_ROWS
    length_grid = (8, 32) if opts.quick else ENCODER_LENGTHS
    lengths = [n for n in length_grid if n <= limit] or [int(limit)]
    points = [
        {"rows": r, "length": n, "padded_tokens": r * n, "attention": r * n * n}
        for r in rows_grid
        for n in lengths
        if r <= spec.max_batch_items and r * n <= spec.max_batch_tokens
    ]
    points.sort(key=lambda p: p["padded_tokens"])
    encoder_pass(model, spec.kind, opts.device, 2, lengths[0])()  # first call: allocations
    done, skipped = _series(
        points, lambda p: encoder_pass(model, spec.kind, opts.device, p["rows"], p["length"]), opts
    )
    section = fit_encoder_section(done)
    section["skipped"] = skipped
    return {"pass": section}


def measure_generator(model: Any, spec: ModelSpec, opts: MeasureOptions) -> dict[str, Any]:
    from carpool.generation.runner import SlotRunner, kv_geometry

    pad = getattr(model.config, "pad_token_id", None) or 0
    vocab = int(model.config.get_text_config().vocab_size)
    max_len = spec.max_seq_len
    runner = SlotRunner(model, spec.max_num_seqs, max_len, KV_BLOCK, pad)
    cache = runner.cache

    def prefill(p: dict[str, Any]) -> Callable[[], Any]:
        chunks = _ids(p["rows"], p["width"], vocab).tolist()
        return lambda: runner.forward(0, chunks, [0] * p["rows"])

    def decode(p: dict[str, Any]) -> Callable[[], Any]:
        chunks = _ids(p["batch"], 1, vocab).tolist()
        return lambda: runner.forward(0, chunks, [p["context"]] * p["batch"])

    token_grid = (8, 32, 64) if opts.quick else PREFILL_TOKENS
    step = min(spec.max_step_tokens, max_len)
    prefill_points: list[dict[str, Any]] = []
    for rows in (1, *PREFILL_ROWS):
        for t in token_grid:
            if t <= step and t % rows == 0 and t // rows >= 8 and rows <= spec.max_num_seqs:
                width = t // rows
                prefill_points.append(
                    {"rows": rows, "width": width, "tokens": t, "attention": rows * width * width}
                )
    runner.forward(0, [[7, 8, 9]], [0])  # first call: allocations, oneDNN packing
    one, skipped = _series([p for p in prefill_points if p["rows"] == 1], prefill, opts)
    many: list[dict[str, Any]] = []
    skipped_many: list[dict[str, Any]] = []
    for rows in PREFILL_ROWS:  # a series each: one slow point stops its own series only
        done, skip = _series([p for p in prefill_points if p["rows"] == rows], prefill, opts)
        many += done
        skipped_many += skip
    cache.release()

    batch_grid = (1, 8, 32) if opts.quick else DECODE_BATCHES
    context_grid = (16, 64) if opts.quick else DECODE_CONTEXTS
    batches = [b for b in batch_grid if b <= spec.max_num_seqs]
    contexts = [c for c in context_grid if c < max_len] or [max_len // 2]
    decode_done: list[dict[str, Any]] = []
    decode_skipped: list[dict[str, Any]] = []
    for i, context in enumerate(contexts):
        # The whole batch grid at the first context; its ends at the longer ones.
        grid = batches if i == 0 else sorted({batches[0], batches[len(batches) // 2], batches[-1]})
        points = [{"batch": b, "context": context, "kv_tokens": b * (context + 1)} for b in grid]
        done, skipped_d = _series(points, decode, opts)
        decode_done += done
        decode_skipped += skipped_d
        cache.release()
    layers, kv_heads, head_dim = kv_geometry(model.config)
    prefill_section = _section(one + many, "tokens", {"attention": ("tokens", "rows", "attention")})
    prefill_section["skipped"] = skipped + skipped_many
    decode_section = _section(decode_done, "batch", {"context": ("batch", "kv_tokens")})
    decode_section["skipped"] = decode_skipped
    return {
        "kv_bytes_per_token": int(cache.bytes_per_token),
        "kv_geometry": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
        "engine": {
            "runner": "carpool.generation.runner.SlotRunner",
            "packed_weights": runner.packed,
            "max_num_seqs": spec.max_num_seqs,
            "max_step_tokens": spec.max_step_tokens,
            "max_seq_len": max_len,
        },
        "prefill": prefill_section,
        "decode": decode_section,
    }


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def measure_model(spec: ModelSpec, opts: MeasureOptions) -> dict[str, Any]:
    """One profile entry (without provenance) for ``spec`` on ``opts.device``."""
    import gc

    import torch

    from carpool.devices import pick_dtype
    from carpool.models import sentence_transformers_max_length

    folder = locate(spec.source, opts.models_dir)
    if spec.kind == "encoder" and spec.max_length is None:
        # The embedder replica takes a sentence-transformers model's own max_seq_length (256
        # for all-MiniLM-L6-v2, against 512 positions): a longer point is a shape it never runs.
        st_max = sentence_transformers_max_length(folder)
        if st_max:
            spec = dataclasses.replace(spec, max_length=st_max)
    dtype = pick_dtype(opts.dtype, opts.device)
    started = time.perf_counter()
    model = build_model(folder, spec.kind, opts.device, dtype, opts.random_weights)
    built_s = time.perf_counter() - started
    config = model.config
    entry: dict[str, Any] = {
        "role": spec.role,
        "name": spec.source.split(":", 1)[-1].rstrip("/").split("/")[-1],
        "model_source": spec.source,
        "kind": spec.kind,
        "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
        "params": int(sum(p.numel() for p in model.parameters())),
        "dtype": dtype_name(dtype),
        "device": opts.device,
        "threads": torch.get_num_threads() if opts.device == "cpu" else None,
        "weights": "random" if opts.random_weights else "pretrained",
        "limits": {
            k: getattr(spec, k)
            for k in (
                ("max_num_seqs", "max_step_tokens", "max_seq_len")
                if spec.kind == "generator"
                else ("max_batch_items", "max_batch_tokens", "max_length")
            )
        },
    }
    opts.log(
        f"{spec.role}: {entry['name']} {entry['params'] / 1e6:.0f}M params "
        f"{entry['dtype']} on {opts.device} (built in {built_s:.1f} s)"
    )
    started = time.perf_counter()
    try:
        if spec.kind == "generator":
            entry.update(measure_generator(model, spec, opts))
        else:
            entry.update(measure_encoder(model, spec, opts))
    finally:
        del model
        gc.collect()
        if opts.device.startswith("cuda"):
            torch.cuda.empty_cache()
    entry["measure_s"] = round(time.perf_counter() - started, 1)
    return entry
