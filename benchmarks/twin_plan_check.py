"""``python -m benchmarks.twin_plan_check``: the planner's knobs against the shipped ones, paired.

The target (stated up front): the p99 latency of ``embed-mixed`` under Poisson arrivals at
``--rate`` requests/s on this machine, serve.yaml's embed app as the suite deploys it (one
torch thread). Both configurations are deployed side by side on one private Ray + Serve
(``/embed`` shipped, ``/embed-planned`` with the planner's ``user_config``); only one is
under load at a time, and they take turns (A B, B A, ...) for ``--rounds`` rounds on the
same arrival schedule, so load from elsewhere hits both alike. Every round's ratio
planned/shipped is kept; the report gives their median.

    flock /tmp/carpool-bench.lock .venv/bin/python -m benchmarks.twin_plan_check \\
        --planned '{"pass_overhead_tokens": 32}' --rate 4 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from carpool import local_ray

os.environ.update(local_ray.ray_environment())
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.arrivals import ArrivalSpec
from benchmarks.workloads import embed_workload


async def _rounds(base_url: str, systems: dict[str, Any], args: Any) -> list[dict[str, Any]]:
    from benchmarks.loadgen import LoadGenerator
    from benchmarks.runner import Bench

    workload = embed_workload(args.requests, 0)
    out: list[dict[str, Any]] = []
    async with LoadGenerator(base_url, 256, 120.0, False) as gen:
        bench = Bench(gen)
        for system in systems.values():
            await gen.wait_ready(system.target.ready_path, timeout_s=300)
            await bench.run(
                system, workload, ArrivalSpec(kind="closed", concurrency=4, duration_s=5)
            )
        names = list(systems)
        for i in range(args.rounds):
            order = names if i % 2 == 0 else names[::-1]
            spec = ArrivalSpec(kind="poisson", rate=args.rate, duration_s=args.duration, seed=i)
            row: dict[str, Any] = {"round": i + 1, "order": order}
            for name in order:
                run = await bench.run(systems[name], workload, spec)
                s = run.summary
                row[name] = {
                    "p50_ms": s["latency_ms"]["p50"],
                    "p99_ms": s["latency_ms"]["p99"],
                    "items_per_s": s["items_per_s"],
                    "ok": s["ok"],
                    "rejected": s["rejected"],
                    "loadavg": list(run.loadavg),
                }
                print(f"round {i + 1} {name}: p99 {s['latency_ms']['p99']:.0f} ms", file=sys.stderr)
            row["p99_ratio"] = row["planned"]["p99_ms"] / row["shipped"]["p99_ms"]
            out.append(row)
    return out


def sign_test_p(wins: int, rounds: int) -> float:
    """One-sided sign test: the chance of at least ``wins`` of ``rounds`` if neither
    configuration were better (each round a fair coin)."""
    return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2**rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.twin_plan_check", description=__doc__)
    p.add_argument("--planned", required=True, help="the planner's embedder user_config (JSON)")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson requests/s")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--port", type=int, default=8164)
    p.add_argument("--out", default="benchmarks/results/twin-plan-check.json")
    p.add_argument("--harness-session", action="store_true",
                   help="start Ray in this process's session (the checks of 2026-11-26), not "
                   "in its own as a user's serve run is")  # fmt: skip
    args = p.parse_args(argv)
    planned = json.loads(args.planned)

    from benchmarks.deploy import SYSTEMS, Resources, ServeCluster, logical_cpus_needed
    from benchmarks.runner import System
    from benchmarks.targets import make_target

    shipped = SYSTEMS["carpool"]
    mine = dataclasses.replace(shipped, name="carpool-planned", prefix="/embed-planned")
    resources = Resources()
    cluster = ServeCluster(
        args.port,
        logical_cpus_needed([shipped, mine], resources),
        own_session=not args.harness_session,
    )
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = list(os.getloadavg())
    cluster.start()
    try:
        cluster.deploy([shipped, mine], resources, {"carpool-planned": planned})
        systems = {
            "shipped": System(
                "carpool", make_target("embed", "carpool", shipped.prefix), "bench-carpool"
            ),
            "planned": System(
                "carpool-planned",
                make_target("embed", "carpool-planned", mine.prefix),
                "bench-carpool-planned",
            ),
        }
        rounds = asyncio.run(_rounds(cluster.base_url, systems, args))
    finally:
        cluster.shutdown()
    ratios = [r["p99_ratio"] for r in rounds]
    wins = sum(1 for r in ratios if r < 1)
    doc = {
        "command": " ".join([".venv/bin/python -m benchmarks.twin_plan_check", *sys.argv[1:]]),
        "started": started,
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
        "target": f"p99 latency of embed-mixed, Poisson {args.rate:g} req/s (lower is better)",
        "planned_knobs": planned,
        "rounds": rounds,
        "p99_ratio_median": statistics.median(ratios),
        "planned_better_rounds": wins,
        "sign_test_p": sign_test_p(wins, len(ratios)),
        "ray_own_session": not args.harness_session,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    keys = ("target", "p99_ratio_median", "planned_better_rounds", "sign_test_p")
    print(json.dumps({k: doc[k] for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
