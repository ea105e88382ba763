"""``peers generate``: /generate against vLLM's OpenAI server, streamed, on SmolLM2 fp32.

Per round and system: closed loops at each ``--concurrency`` (exact lengths: ``ignore_eos``),
then a conversation trace replayed on chat completions (unless ``--no-trace``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers.measure import closed_window, open_window, paired_rounds, warm_up
from benchmarks.peers.process import load_note, top_snapshot
from benchmarks.peers.stats import carpool_pairs, median_spread, paired_ratios
from benchmarks.peers.stream import PeersLoadGenerator, StreamingTarget
from benchmarks.peers.systems import SystemSpec, generate_systems
from benchmarks.workloads import Workload, generate_workload


def trace_requests(args: argparse.Namespace) -> Workload:
    from benchmarks.trace import TraceScaling, load_azure_trace, scale_trace, trace_workload

    scaled = scale_trace(
        load_azure_trace(args.trace),
        TraceScaling(rate=args.trace_rate, duration_s=args.duration, start_s=600.0),
    )
    return trace_workload(scaled, "generate", args.seed)


async def _generate_visit(
    system: SystemSpec,
    workload: Workload,
    trace: Workload | None,
    args: argparse.Namespace,
    round_: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    target = system.target("completions")
    chat = system.target("chat")
    if args.no_stream:
        target = StreamingTarget(target.name, target.prefix, "completions", stream=False)
    async with PeersLoadGenerator(system.base_url, 256, 300.0, progress=False) as gen:
        await gen.wait_ready(target.ready_path, timeout_s=300)
        await warm_up(gen, target, workload, 4)
        out["top"] = top_snapshot()
        out["load"] = load_note()
        for c in args.concurrency:
            s = await closed_window(gen, target, workload, c, args.duration)
            out[f"closed-{c}"] = s
            print(
                f"  {system.name} r{round_} c={c}: {s['tokens_per_s']:.1f} tok/s, TTFT p50/p99 "
                f"{s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms, TPOT p50 "
                f"{s['tpot_ms']['p50']:.0f} ms, ok {s['ok']}/{s['sent']}; opening burst TTFT "
                f"max {s['ttft_split_ms']['burst']['max']:.0f} ms, after it p99 "
                f"{s['ttft_split_ms']['after']['p99']:.0f} ms",
                flush=True,
            )
        if not args.no_trace:
            assert trace is not None and trace.arrivals is not None
            s = await open_window(gen, chat, trace.requests, trace.arrivals)
            out["trace-chat"] = s
            print(
                f"  {system.name} r{round_} trace (chat): {s['tokens_per_s']:.1f} tok/s, TTFT "
                f"p50/p99 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms",
                flush=True,
            )
    return out


def run_generate(
    args: argparse.Namespace, log_dir: Path, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    # vllm-allcores beside vllm: carpool's default computes on both cores, vLLM's leaves one
    # to its API server; the report shows vLLM's own server both ways.
    default = ["carpool", "vllm", "vllm-allcores"]
    systems = generate_systems(args.systems or default, log_dir, args)
    workload = generate_workload(500, args.seed)
    trace = None if args.no_trace else trace_requests(args)  # --no-trace needs no file
    return paired_rounds(
        systems,
        args.rounds,
        lambda system, r: _generate_visit(system, workload, trace, args, r),
        lambda facts, rounds: generate_result(workload, trace, facts, rounds, args),
        save,
    )


def generate_result(
    workload: Workload,
    trace: Workload | None,
    facts: dict[str, Any],
    rounds: list[dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    phases = [f"closed-{c}" for c in args.concurrency] + ([] if args.no_trace else ["trace-chat"])
    return {
        "workload": workload.description,
        "trace": trace.description if trace is not None else None,
        "systems": facts,
        "rounds": rounds,
        "summary": summarise_generate(rounds, phases),
        "duration_s": args.duration,
    }


GEN_METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "tokens_per_s": lambda s: s["tokens_per_s"],
    "ttft_p50_ms": lambda s: s["ttft_ms"]["p50"],
    "ttft_p99_ms": lambda s: s["ttft_ms"]["p99"],
    "tpot_p50_ms": lambda s: s["tpot_ms"]["p50"],
    "tpot_p99_ms": lambda s: s["tpot_ms"]["p99"],
}


def summarise_generate(rounds: Sequence[dict[str, Any]], phases: Sequence[str]) -> dict:
    names = sorted({n for r in rounds for n in r})
    out: dict[str, Any] = {}
    for phase in phases:
        table: dict[str, Any] = {}
        for n in names:
            table[n] = {
                m: median_spread([f(r[n][phase]) for r in rounds if phase in r.get(n, {})])
                for m, f in GEN_METRICS.items()
            }
        for m in ("tokens_per_s", "ttft_p99_ms"):
            per_round = [
                {k: GEN_METRICS[m](v[phase]) for k, v in r.items() if phase in v} for r in rounds
            ]
            for a, b in carpool_pairs(names):
                table[f"{a}/{b} {m}"] = paired_ratios(per_round, a, b)
        out[phase] = table
    return out
