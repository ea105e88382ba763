"""``python -m benchmarks.generation_compare``: the generation engines side by side, measured.

Runs the same workload through a ``GeneratorServer`` in each mode, in this process (the
code a replica runs, minus HTTP): ``--concurrency`` clients each send requests back to back
until ``--requests`` are done; ``max_tokens`` are spread evenly over
``--min-tokens..--max-tokens`` and shuffled; greedy with ``ignore_eos`` so every request
generates exactly its ``max_tokens``. Prints a table and writes JSON.

The default: 16 concurrent clients, 64 requests (four each), max_tokens 8..256, on the
small model. ``--requests 16`` is a single wave (every request at once, none after).
``--rounds N`` alternates the modes N times and reports each mode's median round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "Write a short story about a carpool that crosses the mountains.",
    "Explain how a battery stores energy.",
    "List some facts about the river that runs through Paris.",
    "Describe the weather in a city by the sea.",
    "Tell me about the history of the guitar.",
    "What makes a good market for fresh vegetables?",
    "Give advice to someone learning to cook.",
    "Summarise why people like music festivals.",
]


def workload(n: int, lo: int, hi: int, seed: int) -> list[dict[str, Any]]:
    """Requests with max_tokens spread evenly over [lo, hi], in a shuffled order."""
    rng = random.Random(seed)
    lengths = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]
    rng.shuffle(lengths)
    return [
        {
            "prompts": [PROMPTS[i % len(PROMPTS)]],
            "max_tokens": length,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        for i, length in enumerate(lengths)
    ]


def tree_cpu_s(pid: int | None = None) -> float:
    """CPU seconds of this process and every live descendant: vLLM's engine runs in child
    processes, which ``time.process_time`` would not count."""
    pid = os.getpid() if pid is None else pid
    tick = os.sysconf("SC_CLK_TCK")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        children: list[int] = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    except OSError:  # ended while read, or no /proc (not Linux): this process only
        return time.process_time() if pid == os.getpid() else 0.0
    return total + sum(tree_cpu_s(c) for c in children)


async def run_mode(server: Any, requests: list[dict[str, Any]], concurrency: int) -> dict:
    from carpool.generation.schemas import GenerationCall

    queue = [(i, GenerationCall(**r)) for i, r in enumerate(requests)]
    records: list[dict[str, float]] = []
    # The sustained window: from the start until the last request is handed out, while
    # every client has a request in flight (no ramp-down of the last requests).
    window: dict[str, float] = {}

    async def client() -> None:
        while queue:
            _, call = queue.pop(0)
            if not queue:
                window["end_s"] = time.perf_counter()
                window["end_tokens"] = server.stats()["tokens_generated"]
            start = time.perf_counter()
            first = last = None
            tokens = 0
            async for event in server.stream(call):
                if event.type == "delta":
                    last = time.perf_counter()
                    first = first or last
                if event.type == "end":
                    tokens = event.completion_tokens
            end = time.perf_counter()
            records.append(
                {
                    "latency_s": end - start,
                    "ttft_s": (first or end) - start,
                    # Time per output token after the first, as the client sees deltas arrive.
                    "tpot_s": ((last or end) - (first or end)) / max(tokens - 1, 1),
                    "tokens": tokens,
                    "max_tokens": call.max_tokens,
                }
            )

    stats_before = server.stats()
    start, cpu_start = time.perf_counter(), tree_cpu_s()
    window["start_s"], window["start_tokens"] = start, stats_before["tokens_generated"]
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - start, tree_cpu_s() - cpu_start
    stats = server.stats()
    tokens = sum(r["tokens"] for r in records)
    latencies = sorted(r["latency_s"] for r in records)
    tpots = sorted(r["tpot_s"] for r in records if r["tokens"] > 1)
    steps = stats["steps"] - stats_before["steps"]
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "sustained_tokens_per_s": (window["end_tokens"] - window["start_tokens"])
        / max(1e-9, window["end_s"] - window["start_s"]),
        "cpu_s": cpu,
        "tokens_per_cpu_s": tokens / cpu,
        "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in records),
        "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else 0.0,
        "tpot_p90_ms": 1000 * tpots[min(len(tpots) - 1, int(0.9 * len(tpots)))] if tpots else 0.0,
        "engine_steps": steps,
        "tokens_per_step": tokens / steps if steps else 0.0,
        "prefill_s": stats["prefill_s"] - stats_before["prefill_s"],
        "decode_s": stats["decode_s"] - stats_before["decode_s"],
    }


async def run_transformers_cb(
    model: Any, tokenizer: Any, requests: list[dict[str, Any]], concurrency: int, args: Any
) -> dict:
    """The same workload on transformers' own continuous batching manager (greedy only).

    Measured to choose the engine; carpool serves with its own (per-request sampling, stop
    strings, cancellation by slot), see docs/generation.md.
    """
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = ContinuousBatchingConfig(
        page_size=64,
        num_blocks=max(64, args.max_num_seqs * (args.max_tokens + 128) // 64 * 2),
        max_step_tokens=args.max_step_tokens,
        max_requests_per_batch=args.max_num_seqs,
    )
    gen = GenerationConfig(do_sample=False, max_new_tokens=args.max_tokens, eos_token_id=-1)
    queue = list(requests)
    records: list[dict[str, float]] = []
    with torch.no_grad():
        manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=config
        )
        manager.start()
        try:

            async def client() -> None:
                loop = asyncio.get_running_loop()
                while queue:
                    call = queue.pop(0)
                    ids = tokenizer(call["prompts"][0])["input_ids"]
                    done: asyncio.Future = loop.create_future()
                    start = time.perf_counter()
                    rid = manager.add_request(ids, max_new_tokens=call["max_tokens"])

                    def on_result(out: Any, done: asyncio.Future = done) -> None:
                        if out.is_finished() and not done.done():
                            done.set_result(out)

                    manager.register_result_handler(rid, on_result)
                    out = await done
                    end = time.perf_counter()
                    records.append(
                        {
                            "latency_s": end - start,
                            "tokens": len(out.generated_tokens),
                            "max_tokens": call["max_tokens"],
                        }
                    )

            start, cpu_start = time.perf_counter(), tree_cpu_s()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            wall, cpu = time.perf_counter() - start, tree_cpu_s() - cpu_start
        finally:
            manager.stop(block=True)
    tokens = sum(r["tokens"] for r in records)
    latencies = sorted(r["latency_s"] for r in records)
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "sustained_tokens_per_s": float("nan"),
        "cpu_s": cpu,
        "tokens_per_cpu_s": tokens / cpu,
        "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
        "ttft_p50_s": float("nan"),
        "engine_steps": 0,
        "tokens_per_step": float("nan"),
        "prefill_s": float("nan"),
        "decode_s": float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="packaged:SmolLM2-135M-Instruct")
    parser.add_argument(
        "--modes",
        default="continuous,static",
        help="any of continuous, static, vllm (needs vLLM installed: make vllm-venv), "
        "transformers (transformers' own continuous batching); a '-single' suffix "
        "(continuous-single) submits each request on its own instead of through the "
        "arrival batch (what @serve.batch buys, paired); '-noprefix' (continuous-noprefix) "
        "runs the continuous engine with its prefix cache off (limits.prefix_cache_mb 0)",
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per mode")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-step-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="warm-up requests per mode")
    parser.add_argument("--out", default="generation-compare.json")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from carpool.models import resolve_model_source
    from carpool.threads import size_torch_threads
    from deployments.generator import GeneratorServer

    threads = size_torch_threads(None, args.threads)
    path = resolve_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    requests = workload(args.requests, args.min_tokens, args.max_tokens, args.seed)
    modes = args.modes.split(",")
    servers: dict[str, Any] = {}
    for mode in modes:
        if mode == "transformers":
            continue
        single, noprefix = mode.endswith("-single"), mode.endswith("-noprefix")
        engine_mode = mode.removesuffix("-single").removesuffix("-noprefix")
        config = {
            "source": {"model": args.model},
            "mode": engine_mode,
            **({"limits": {"prefix_cache_mb": 0}} if noprefix else {}),
            "batching": {
                "max_num_seqs": args.max_num_seqs,
                "max_step_tokens": args.max_step_tokens,
                # Contended machines can be slow; the measurement must not time out.
                "request_timeout_s": 3600,
            },
        }
        servers[mode] = GeneratorServer(config, model=model, tokenizer=tokenizer)
        if single:  # each call is its own batch: admitted, tokenised and submitted alone
            server = servers[mode]
            server._through_batch = lambda ticket, s=server: s._run_batch([ticket])
    # Modes alternate round by round, so load from elsewhere on the machine hits them alike;
    # each mode reports its median round (by tokens/s).
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}

    async def measure() -> None:
        # One event loop for every round: a vLLM engine serves the loop that started it.
        for server in servers.values():
            await run_mode(server, workload(args.warmup, 4, 4, args.seed), 1)
        for r in range(args.rounds):
            for mode in modes:
                if mode == "transformers":
                    result = await run_transformers_cb(
                        model, tokenizer, requests, args.concurrency, args
                    )
                else:
                    result = await run_mode(servers[mode], requests, args.concurrency)
                rounds[mode].append(result)
                print(
                    f"round {r + 1} {mode}: {result['tokens_per_s']:.1f} tokens/s "
                    f"({result['sustained_tokens_per_s']:.1f} sustained), "
                    f"p50 {result['latency_p50_s']:.2f} s",
                    file=sys.stderr,
                )
        for server in servers.values():
            server.close()

    asyncio.run(measure())
    results = {
        mode: sorted(runs, key=lambda x: x["tokens_per_s"])[len(runs) // 2]
        for mode, runs in rounds.items()
    }

    cols = [
        ("mode", "{}"),
        ("requests", "{}"),
        ("output_tokens", "{}"),
        ("wall_s", "{:.1f}"),
        ("tokens_per_s", "{:.1f}"),
        ("sustained_tokens_per_s", "{:.1f}"),
        ("tokens_per_cpu_s", "{:.1f}"),
        ("latency_p50_s", "{:.2f}"),
        ("latency_p90_s", "{:.2f}"),
        ("ttft_p50_s", "{:.2f}"),
        ("tpot_p50_ms", "{:.0f}"),
        ("tokens_per_step", "{:.1f}"),
    ]
    rows = [
        [fmt.format(mode if c == "mode" else r[c]) for c, fmt in cols]
        for mode, r in results.items()
    ]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, (c, _) in enumerate(cols)]
    print("  ".join(c.ljust(w) for (c, _), w in zip(cols, widths, strict=True)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    summary: dict[str, Any] = {}
    if "continuous" in results and "static" in results:
        c, s = results["continuous"], results["static"]
        summary = {
            "throughput_ratio": c["tokens_per_s"] / s["tokens_per_s"],
            "sustained_throughput_ratio": c["sustained_tokens_per_s"] / s["sustained_tokens_per_s"],
            "tokens_per_cpu_s_ratio": c["tokens_per_cpu_s"] / s["tokens_per_cpu_s"],
            "p50_latency_ratio": c["latency_p50_s"] / s["latency_p50_s"],
        }
        # Rounds alternate modes, so round i of each is a pair run under similar load.
        paired = [
            a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(rounds["continuous"], rounds["static"], strict=True)
        ]
        summary["paired_throughput_ratios"] = paired
        summary["paired_throughput_ratio_median"] = statistics.median(paired)
        print(
            "paired rounds: "
            + ", ".join(f"{r:.2f}x" for r in paired)
            + f" (median {statistics.median(paired):.2f}x)"
        )
        print(
            f"continuous/static: {summary['throughput_ratio']:.2f}x tokens/s overall, "
            f"{summary['sustained_throughput_ratio']:.2f}x sustained (all clients busy), "
            f"{summary['tokens_per_cpu_s_ratio']:.2f}x tokens per CPU-second; "
            f"p50 latency {summary['p50_latency_ratio']:.2f}x"
        )
    # What the arrival batch buys: each mode against its one-by-one twin, round by round.
    for mode in modes:
        if mode.endswith("-single") or f"{mode}-single" not in rounds:
            continue
        pairs = list(zip(rounds[mode], rounds[f"{mode}-single"], strict=True))
        batch_ratios = {
            key: [a[key] / b[key] for a, b in pairs if b[key]]
            for key in ("tokens_per_s", "tokens_per_cpu_s", "latency_p50_s", "ttft_p50_s")
        }
        summary[f"{mode}_batched_over_single"] = {
            key: {"rounds": vals, "median": statistics.median(vals)}
            for key, vals in batch_ratios.items()
            if vals
        }
        print(
            f"{mode} batched / one-by-one, paired median: "
            + ", ".join(
                f"{key} {statistics.median(vals):.2f}x"
                for key, vals in batch_ratios.items()
                if vals
            )
        )
    report = {
        "command": "python -m benchmarks.generation_compare " + " ".join(sys.argv[1:]),
        "model": args.model,
        "workload": {
            "requests": args.requests,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "max_tokens_range": [args.min_tokens, args.max_tokens],
            "greedy": True,
            "ignore_eos": True,
        },
        "engine": {"max_num_seqs": args.max_num_seqs, "max_step_tokens": args.max_step_tokens},
        "torch_threads": threads,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
        "rounds": rounds,
        "summary": summary,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
