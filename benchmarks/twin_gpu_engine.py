"""``python -m benchmarks.twin_gpu_engine``: carpool's continuous engine alone, measured as
``benchmarks.twin_validate`` measures generation, on whatever device it runs on.

Made for a lent GPU, where neither Ray nor vLLM is installed: the engine
(``carpool.generation.native.ContinuousEngine`` over ``SlotRunner``, as a ``mode: continuous``
replica runs it) is driven through its async protocol with no server in front (no
``@serve.batch`` collector, no admission, no HTTP), so what is measured is the engine's steps
and the delivery of their tokens. Per configuration: the 1- and 8-client calibration runs and
closed loops of ``generation_compare``'s workload at 4, 16 and 64 clients, in the shape of one
generation round of a ``twin_validate`` measurement; ``twin_validate report`` then runs the
twin on it with the profile measured on the same device (``--profile profiles/gpu-h200.json``).

    python -m benchmarks.twin_gpu_engine --model-dir DIR --device cuda --dtype bfloat16 \\
        --random-weights --out gpu-engine.json

``--random-weights`` builds the model from ``DIR/config.json`` (a step costs the same whatever
the weights; ``ignore_eos`` fixes every output's length). First token: the first event with a
token (the engine's, before any text is held back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile

# The calibration runs and sequence length of a twin_validate generation round (the report
# reads this file as one), and its workload seed.
from benchmarks.twin_common import (
    GEN_CALIB_LOADED_CLIENTS,
    GEN_CALIB_REQUESTS,
    GEN_MAX_SEQ_LEN,
    SEED,
)

CONFIGS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    # No collector in front of the engine: its arrivals reach the scheduler at once.
    "default": ({"max_num_seqs": 64, "max_step_tokens": 512, "batch_wait_timeout_s": 0.0},
                (4, 16, 64)),
    "max_num_seqs_16": ({"max_num_seqs": 16, "max_step_tokens": 512,
                         "batch_wait_timeout_s": 0.0}, (64,)),
}  # fmt: skip


def make(model: Any, tokenizer: Any, knobs: dict[str, Any]) -> Any:
    from carpool.generation.factory import make_engine
    from carpool.generation.scheduler import SchedulerLimits
    from carpool.generation.sequence import TokenizerInfo

    info = TokenizerInfo.from_tokenizer(tokenizer, getattr(model, "generation_config", None))
    limits = SchedulerLimits(knobs["max_num_seqs"], knobs["max_step_tokens"])
    return make_engine("continuous", model, info, limits, GEN_MAX_SEQ_LEN)


def summarise(records: list[dict[str, float]], wall: float, steps: int) -> dict[str, Any]:
    """A closed loop's figures from its requests' records (latency, first token, tokens), as
    ``twin_validate`` stores them (this module's and ``twin_measure_gen``'s)."""
    tokens = sum(r["tokens"] for r in records)
    ttft = [1000 * r["ttft_s"] for r in records]
    lat = [1000 * r["latency_s"] for r in records]
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "engine_steps": steps,
    }


async def closed_loop(
    engine: Any, prompt_ids: list[list[int]], calls: list[dict[str, Any]], clients: int
) -> dict[str, Any]:
    """``clients`` closed-loop clients over ``calls``; call ``i`` sends ``prompt_ids[i % 8]``."""
    from carpool.generation.sampling import SamplingParams
    from carpool.generation.sequence import GenSequence

    records: list[dict[str, float]] = []
    queue = list(enumerate(calls))

    async def one(i: int, call: dict[str, Any]) -> None:
        params = SamplingParams(max_tokens=call["max_tokens"], temperature=0.0, ignore_eos=True)
        seq = GenSequence(prompt_ids[i % len(prompt_ids)], params)
        start = time.perf_counter()
        first, tokens = None, 0
        async for event in engine.generate([seq]):
            if event.token_ids and first is None:
                first = time.perf_counter()
            tokens = max(tokens, event.completion_tokens)
            if event.error:
                raise RuntimeError(event.error)
        end = time.perf_counter()
        records.append({"latency_s": end - start, "ttft_s": (first or end) - start,
                        "tokens": tokens})  # fmt: skip

    async def client() -> None:
        while queue:
            await one(*queue.pop(0))

    before = engine.stats()["steps"]
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    return summarise(records, wall, engine.stats()["steps"] - before)


async def measure_config(
    engine: Any, prompt_ids: list[list[int]], clients_list: tuple[int, ...], requests: int
) -> dict[str, Any]:
    from benchmarks.generation_compare import workload

    await engine.start()
    await closed_loop(engine, prompt_ids, workload(4, 4, 4, SEED), 4)  # warm-up
    out: dict[str, Any] = {
        "calibrate": await closed_loop(
            engine, prompt_ids, workload(GEN_CALIB_REQUESTS, 32, 32, SEED), 1
        ),
        "calibrate_8": await closed_loop(
            engine,
            prompt_ids,
            workload(2 * GEN_CALIB_LOADED_CLIENTS, 32, 32, SEED),
            GEN_CALIB_LOADED_CLIENTS,
        ),
    }
    for clients in clients_list:
        calls = workload(max(requests, clients), 8, 256, SEED)
        r = await closed_loop(engine, prompt_ids, calls, clients)
        out[str(clients)] = {**r, "requests": len(calls)}
        print(f"  {clients} clients: {r['tokens_per_s']:.1f} tokens/s, TTFT p50 "
              f"{r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.generation_compare import PROMPTS

    p = argparse.ArgumentParser(prog="python -m benchmarks.twin_gpu_engine", description=__doc__)
    p.add_argument("--model-dir", required=True, help="a model folder (config and tokenizer)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--requests", type=int, default=64, help="requests per closed loop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default="4,16,64", help="client counts measured (of each config's)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    started = time.time()
    import torch
    from transformers import AutoTokenizer

    from carpool_twin.measure import build_model

    # As the profile command builds it (random weights initialised on the device).
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = build_model(
        args.model_dir, "generator", args.device, getattr(torch, args.dtype), args.random_weights
    )
    prompt_ids = [tokenizer(t)["input_ids"] for t in PROMPTS]
    shared = {"model": Path(args.model_dir).name, "prompt_tokens": [len(x) for x in prompt_ids],
              "max_seq_len": GEN_MAX_SEQ_LEN, "first_delta_tokens": [1] * len(PROMPTS),
              "dtype": args.dtype, "threads": None}  # fmt: skip
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        gen: dict[str, Any] = dict(shared)
        rounds.append({"generation": gen})
        for name in args.configs.split(","):
            knobs, clients_list = CONFIGS[name]
            wanted = {int(c) for c in args.clients.split(",") if c}
            clients_list = tuple(c for c in clients_list if c in wanted)
            print(f"round {rnd} {name}", flush=True)
            engine = make(model, tokenizer, knobs)
            try:
                res = asyncio.run(measure_config(engine, prompt_ids, clients_list, args.requests))
                gen[name] = {"knobs": knobs, **res}
            finally:
                engine.close()
        save(args, argv, started, rounds)
    return 0


def save(args: Any, argv: list[str] | None, started: float, rounds: list[dict[str, Any]]) -> None:
    """The measurement so far (after every round: a run cut short keeps its rounds), with the
    machine and software as a profile records them."""
    from carpool_twin.cli import hardware, software

    doc = {
        "command": " ".join(["python -m benchmarks.twin_gpu_engine", *(argv or sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "hardware": hardware(args.device),
        "software": software(),
        "requests": args.requests,
        "rounds": rounds,
        "seconds": round(time.time() - started, 1),
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({len(rounds)} rounds, {doc['seconds']} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
