"""``peers embed``: /embed against Infinity (torch and ONNX Runtime engines).

Per round and system: 32 closed-loop clients, then (searched once per system) the highest
Poisson rate whose p99 stays within ``SLO_MS``, confirmed over ``--min-requests`` requests.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.arrivals import poisson_arrivals
from benchmarks.loadgen import SloGuard
from benchmarks.peers.measure import (
    closed_window,
    open_window,
    paired_rounds,
    probe_span,
    warm_up,
)
from benchmarks.peers.process import load_note, top_snapshot
from benchmarks.peers.settings import SLO_MS
from benchmarks.peers.stats import median_spread, paired_ratios
from benchmarks.peers.stream import PeersLoadGenerator
from benchmarks.peers.systems import SystemSpec, embed_systems
from benchmarks.workloads import Workload, embed_workload


async def _embed_visit(
    system: SystemSpec, workload: Workload, args: argparse.Namespace, round_: int, search: dict
) -> dict[str, Any]:
    target = system.target("embeddings")
    out: dict[str, Any] = {}
    async with PeersLoadGenerator(system.base_url, 256, 30.0, progress=False) as gen:
        await gen.wait_ready(target.ready_path, timeout_s=300)
        await warm_up(gen, target, workload)
        out["top"] = top_snapshot()
        out["load"] = load_note()
        out["closed"] = await closed_window(
            gen, target, workload, 32, args.duration, args.min_requests
        )
        print(
            f"  {system.name} r{round_} closed-32: {out['closed']['items_per_s']:.1f} items/s, "
            f"p99 {out['closed']['latency_ms']['p99']:.0f} ms",
            flush=True,
        )
        if args.no_search:
            return out
        mean_items = workload.mean_items()
        if system.name not in search:
            # A search from 60% of the closed-loop request rate. Each probe aims at
            # min_requests, as the confirmation does: 20 s probes (~90 requests) passed at
            # rates whose 300-request confirmations then read p99 780-1000 ms. The guard
            # ends a probe early once its p99 is lost anyway.
            from benchmarks.search import Probe, find_max_rate

            probes = []

            async def probe(rate: float) -> Probe:
                span = probe_span(rate, args.min_requests, args.probe_s, args.probe_max_s)
                times = poisson_arrivals(rate, span, random.Random(args.seed))
                s = await open_window(
                    gen, target, workload.take(len(times)), times, SloGuard(SLO_MS)
                )
                passed = s["aborted"] is None and s["slo_p99_ms"] <= SLO_MS
                probes.append({"rate": rate, "passed": passed, "p99": s["slo_p99_ms"]})
                print(
                    f"    probe {rate:.2f} req/s: p99 {s['slo_p99_ms']:.0f} ms "
                    f"{'pass' if passed else 'fail'}",
                    flush=True,
                )
                return Probe(rate, passed)

            guess = max(0.2, 0.6 * out["closed"]["items_per_s"] / mean_items)
            found = await find_max_rate(probe, guess, max_probes=args.max_probes)
            search[system.name] = found.rate
            out["search"] = {"found_rate": found.rate, "probes": probes}
        rate = search[system.name]
        if rate > 0:
            # min_requests (a p99 of 300 samples), 20 s to --confirm-max-s: a system that
            # holds the SLO only at 0.16 req/s would otherwise take half an hour per round.
            span = probe_span(rate, args.min_requests, 20.0, args.confirm_max_s)
            times = poisson_arrivals(rate, span, random.Random(args.seed + round_))
            s = await open_window(gen, target, workload.take(len(times)), times)
            s["rate"] = rate
            s["passed"] = s["slo_p99_ms"] <= SLO_MS
            out["confirm"] = s
            print(
                f"  {system.name} r{round_} confirm {rate:.2f} req/s: "
                f"{s['items_per_s']:.1f} items/s p99 {s['slo_p99_ms']:.0f} ms",
                flush=True,
            )
    return out


def run_embed(
    args: argparse.Namespace, log_dir: Path, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    systems = embed_systems(
        args.systems or ["carpool", "infinity-torch", "infinity-optimum"], log_dir
    )
    workload = embed_workload(2000, args.seed)
    search: dict[str, float] = {}
    return paired_rounds(
        systems,
        args.rounds,
        lambda system, r: _embed_visit(system, workload, args, r, search),
        lambda facts, rounds: embed_result(workload, facts, rounds, search, args),
        save,
    )


def embed_result(
    workload: Workload,
    facts: dict[str, Any],
    rounds: list[dict[str, Any]],
    search: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    return {
        "workload": workload.description,
        "systems": facts,
        "rounds": rounds,
        "search_rates": search,
        "summary": summarise_embed(rounds),
        "duration_s": args.duration,
    }


def summarise_embed(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({n for r in rounds for n in r})
    per_round: list[dict[str, float]] = []
    conf_round: list[dict[str, float]] = []
    for r in rounds:
        per_round.append({n: v["closed"]["items_per_s"] for n, v in r.items() if "closed" in v})
        conf_round.append(
            {
                n: v["confirm"]["items_per_s"]
                for n, v in r.items()
                if "confirm" in v and v["confirm"]["passed"]
            }
        )
    out: dict[str, Any] = {"closed_items_per_s": {}, "slo_items_per_s": {}, "ratios": {}}
    for n in names:
        out["closed_items_per_s"][n] = median_spread([r[n] for r in per_round if n in r])
        out["slo_items_per_s"][n] = median_spread([r[n] for r in conf_round if n in r])
        out.setdefault("closed_p99_ms", {})[n] = median_spread(
            [r[n]["closed"]["latency_ms"]["p99"] for r in rounds if "closed" in r.get(n, {})]
        )
    for n in names:
        if n != "carpool":
            out["ratios"][f"carpool/{n} closed-32"] = paired_ratios(per_round, "carpool", n)
            out["ratios"][f"carpool/{n} p99<=500ms"] = paired_ratios(conf_round, "carpool", n)
    return out
