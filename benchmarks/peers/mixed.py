"""``peers mixed``: embeddings and generation at once, on one machine.

carpool's embed and generate apps on one Ray against Infinity and vLLM's server side by side,
the way a user serving both would run them (and carpool in other layouts, to see what they
cost when both compute).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers.measure import closed_window, paired_rounds, warm_up
from benchmarks.peers.process import load_note, top_snapshot
from benchmarks.peers.stats import carpool_pairs, median_spread, paired_ratios
from benchmarks.peers.stream import PeersLoadGenerator
from benchmarks.peers.systems import MixedSpec, mixed_systems
from benchmarks.workloads import Workload, embed_workload, generate_workload

# Embedding and generation clients at once, on one machine: carpool's embed and generate apps
# on one Ray, against what a user would otherwise run for both (Infinity and vLLM's server,
# each with its defaults, side by side).
MIXED_EMBED_CLIENTS = 32
MIXED_GENERATE_CLIENTS = 16


async def _mixed_visit(
    system: MixedSpec,
    embed_wl: Workload,
    gen_wl: Workload,
    args: argparse.Namespace,
    round_: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with (
        PeersLoadGenerator(system.embed_url, 256, 300.0, progress=False) as embed_gen,
        PeersLoadGenerator(system.generate_url, 256, 300.0, progress=False) as gen_gen,
    ):
        await embed_gen.wait_ready(system.embed.ready_path, timeout_s=300)
        await gen_gen.wait_ready(system.generate.ready_path, timeout_s=300)
        await warm_up(embed_gen, system.embed, embed_wl)
        await warm_up(gen_gen, system.generate, gen_wl, 4)
        out["top"] = top_snapshot()
        out["load"] = load_note()
        # Wall-clock bounds of the measured window, to line up CPU accounting beside it
        # (python -m benchmarks.schedstat report --between).
        out["window_started_at"] = time.time()
        out["embed"], out["generate"] = await asyncio.gather(
            closed_window(embed_gen, system.embed, embed_wl, MIXED_EMBED_CLIENTS, args.duration),
            closed_window(gen_gen, system.generate, gen_wl, MIXED_GENERATE_CLIENTS, args.duration),
        )
        out["window_ended_at"] = time.time()
    e, g = out["embed"], out["generate"]
    print(
        f"  {system.name} r{round_} mixed: {e['items_per_s']:.1f} items/s (p99 "
        f"{e['latency_ms']['p99']:.0f} ms) and {g['tokens_per_s']:.1f} tok/s (TTFT p99 "
        f"{g['ttft_ms']['p99']:.0f} ms), ok {e['ok']}/{e['sent']} and {g['ok']}/{g['sent']}",
        flush=True,
    )
    return out


def run_mixed(
    args: argparse.Namespace, log_dir: Path, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    systems = mixed_systems(
        args.systems or ["carpool", "carpool-allcores", "infinity+vllm"], log_dir, args
    )
    embed_wl, gen_wl = embed_workload(2000, args.seed), generate_workload(500, args.seed)
    return paired_rounds(
        systems,
        args.rounds,
        lambda system, r: _mixed_visit(system, embed_wl, gen_wl, args, r),
        lambda facts, rounds: mixed_result(embed_wl, gen_wl, facts, rounds, args),
        save,
    )


MIXED_METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "embed_items_per_s": lambda v: v["embed"]["items_per_s"],
    "embed_p99_ms": lambda v: v["embed"]["latency_ms"]["p99"],
    "generate_tokens_per_s": lambda v: v["generate"]["tokens_per_s"],
    "generate_ttft_p99_ms": lambda v: v["generate"]["ttft_ms"]["p99"],
    "generate_tpot_p50_ms": lambda v: v["generate"]["tpot_ms"]["p50"],
}


def summarise_mixed(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({n for r in rounds for n in r})
    done = [{n: v for n, v in r.items() if "embed" in v} for r in rounds]
    out: dict[str, Any] = {"systems": {}, "ratios": {}}
    for n in names:
        out["systems"][n] = {
            m: median_spread([f(r[n]) for r in done if n in r]) for m, f in MIXED_METRICS.items()
        }
    pairs = carpool_pairs(names)
    for m in ("embed_items_per_s", "generate_tokens_per_s", "generate_ttft_p99_ms"):
        per_round = [{k: MIXED_METRICS[m](v) for k, v in r.items()} for r in done]
        for a, b in pairs:
            out["ratios"][f"{a}/{b} {m}"] = paired_ratios(per_round, a, b)
    return out


def mixed_result(
    embed_wl: Workload,
    gen_wl: Workload,
    facts: dict[str, Any],
    rounds: list[dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    return {
        "workloads": {"embed": embed_wl.description, "generate": gen_wl.description},
        "clients": {"embed": MIXED_EMBED_CLIENTS, "generate": MIXED_GENERATE_CLIENTS},
        "systems": facts,
        "rounds": rounds,
        "summary": summarise_mixed(rounds),
        "duration_s": args.duration,
    }
