"""``python -m benchmarks.twin_validate``: the twin's predictions beside the harness's measurements.

Two steps, so the measurement (minutes, under the benchmark lock) and the report (seconds)
can be redone apart:

    flock /tmp/carpool-bench.lock .venv/bin/python -m benchmarks.twin_validate measure \\
        --out benchmarks/results/twin-validate.json
    .venv/bin/python -m benchmarks.twin_validate report benchmarks/results/twin-validate.json

``measure`` runs, ``--rounds`` times over with the configurations interleaved in each round,
for each embed configuration (serve.yaml's embed app as the suite deploys it: one torch
thread, ``thread_policy: reserved``; knobs overridden per configuration), on one private
Ray + Serve: an idle window and two calibration runs (1 and 8 closed-loop clients: the
serving path's latency and host CPU, and a pass's cost under load), 32 closed-loop clients
(capacity), Poisson at half of that capacity (latency) and at 3x (goodput), each with the
CPU seconds the cluster and the load generator used (/proc); then, for each generation
configuration, carpool's continuous engine in process (``benchmarks.twin_measure_gen``).
``report`` runs the twin on the very same requests and arrival times with a cost profile,
round by round, and writes ``benchmarks/TWIN.md`` and ``benchmarks/twin.json`` (every
figure as the median over the rounds of the measured and of the predicted value, its error,
the rounds' spread, the median and largest absolute error, and what was fitted on which
calibration run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool import local_ray

os.environ.update(local_ray.ray_environment())
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.arrivals import ArrivalSpec
from benchmarks.twin_common import (
    GEN_CLIENTS,
    GEN_CONFIGS,
    SEED,
    cpu_snapshot,
    cpu_used,
    replica_passes,
    save_json,
)
from benchmarks.workloads import Workload, embed_workload

if TYPE_CHECKING:
    from benchmarks.deploy import ServeCluster


# The embed configurations validated: serve.yaml's knobs, then changes the twin was not fitted on.
EMBED_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "max_batch_tokens_1024": {"max_batch_tokens": 1024},
    "max_batch_size_8": {"max_batch_size": 8},
    "greedy": {"split_policy": "greedy"},
}
# The embed configuration the twin's host and serving-path figures are calibrated on.
CALIBRATION_CONFIG = "default"
# Requests per generation closed loop: a p99 of 64 lies between the two slowest (run 2 and
# before: 16 at 4 clients and 32 at 16, where the p99 was the slowest of the first wave).
GEN_REQUESTS = 64
TRACE = "/work/shared/traces/AzureLLMInferenceTrace_conv.csv"


# --- measuring ------------------------------------------------------------------------------


def _summary(run: Any) -> dict[str, Any]:
    s = run.summary
    return {
        "items_per_s": s["items_per_s"],
        "requests_per_s": s["requests_per_s"],
        "p50_ms": s["latency_ms"]["p50"],
        "p99_ms": s["latency_ms"]["p99"],
        "mean_ms": s["mean_latency_ms"],
        "ok": s["ok"],
        "rejected": s["rejected"],
        "sent": s["sent"],
        "span_s": s["span_s"],
        "loadavg": list(run.loadavg),
    }


async def _timed(
    bench: Any, system: Any, workload: Workload, spec: ArrivalSpec, session: int | None
) -> dict:
    """One phase's summary, with the CPU the cluster, the load generator and the machine used,
    and what the replica's passes did (``replica``: their count and wall time, /v1/stats)."""
    stats = await bench.replica_snapshot(system)
    before = cpu_snapshot(session)
    out = _summary(await bench.run(system, workload, spec))
    out["cpu"] = cpu_used(before, cpu_snapshot(session))
    out["replica"] = replica_passes(stats, await bench.replica_snapshot(system))
    return out


def _retime(base: str, dest: str, url: str) -> dict[str, Any]:
    """``base``'s embedder passes re-timed in the deployed replica at ``url``, saved to ``dest``:
    ``python -m carpool_twin serving-profile``, run here on the calibration config's own
    deployment, before any measured phase."""
    from carpool_twin.cli import main as twin_main

    started = time.monotonic()
    argv = ["serving-profile", "--profile", base, "--url", url, "--models", "embedder"]
    if twin_main([*argv, "--out", dest]) != 0:
        raise RuntimeError(f"python -m carpool_twin {' '.join(argv)} failed")
    return {"from": base, "out": dest, "url": url, "seconds": round(time.monotonic() - started, 1)}


async def _embed_phases(
    cluster: ServeCluster,
    system: Any,
    workload: Workload,
    args: Any,
    serving_profile: tuple[str, str] | None = None,
) -> dict:
    from benchmarks.loadgen import LoadGenerator
    from benchmarks.runner import Bench

    out: dict[str, Any] = {}
    session = cluster.session_id  # None: Ray is this process's children
    async with LoadGenerator(cluster.base_url, 256, 120.0, False) as gen:
        bench = Bench(gen)
        await gen.wait_ready(system.target.ready_path, timeout_s=300)
        warm = ArrivalSpec(kind="closed", concurrency=4, duration_s=5)
        await bench.run(system, workload, warm)
        if serving_profile is not None:  # the passes priced as this replica runs them
            base, dest = serving_profile
            out["serving_profile"] = await asyncio.to_thread(
                _retime, base, dest, cluster.base_url + system.target.prefix
            )
        calib = ArrivalSpec(kind="closed", concurrency=1, duration_s=args.calibrate_s)
        idle = cpu_snapshot(session)
        await asyncio.sleep(3)  # the cluster idle: what it burns with no requests
        out["idle"] = cpu_used(idle, cpu_snapshot(session))
        out["closed_1"] = await _timed(bench, system, workload, calib, session)
        # A calibration under load (not a validated figure): what a pass costs while the
        # serving path keeps the other core busy, which the 1-client run cannot show.
        loaded = ArrivalSpec(kind="closed", concurrency=8, duration_s=args.calibrate_s)
        out["closed_8"] = await _timed(bench, system, workload, loaded, session)
        closed = ArrivalSpec(kind="closed", concurrency=32, duration_s=args.duration)
        out["closed_32"] = await _timed(bench, system, workload, closed, session)
        capacity = out["closed_32"]["requests_per_s"]
        # The half-capacity window reports a p99, so it lasts until about half_requests have
        # arrived (run 11: a 30 s window held ~55 requests and its p99 spread 43% over rounds).
        half_s = max(args.duration, args.half_requests / (0.5 * capacity))
        for name, factor, duration in (
            ("half", 0.5, half_s),
            ("open_3x", 3.0, 300 / (3 * capacity)),  # the suite's window: 300 requests
        ):
            spec = ArrivalSpec(
                kind="poisson", rate=factor * capacity, duration_s=duration, seed=SEED
            )
            out[name] = await _timed(bench, system, workload, spec, session)
            out[name]["rate"] = factor * capacity
            out[name]["arrivals"] = spec.schedule()
    return out


def measure_embed(args: Any) -> list[dict[str, Any]]:
    """Every configuration in turn, ``args.rounds`` times over (rounds interleave the
    configurations, so a slow spell of the VM falls on all of them alike): one dict of
    configurations per round."""
    from benchmarks.deploy import SYSTEMS, Resources, ServeCluster, logical_cpus_needed
    from benchmarks.runner import System
    from benchmarks.targets import make_target

    workload = embed_workload(args.requests, SEED)
    spec, resources = SYSTEMS["carpool"], Resources()
    # Ray in a session of its own, apart from this load generator, as a user's serve run is
    # (since run 7; runs 1-6 shared the load generator's session: --harness-session).
    own = not args.harness_session
    cluster = ServeCluster(args.port, logical_cpus_needed([spec], resources), own_session=own)
    rounds: list[dict[str, Any]] = []
    cluster.start()
    try:
        for rnd in range(args.rounds):
            results: dict[str, Any] = {"resources": resources.model_dump(), "ray_own_session": own}
            rounds.append(results)
            for name in args.configs:
                knobs = EMBED_CONFIGS[name]
                print(f"embed round {rnd} {name}: deploying {knobs}", file=sys.stderr, flush=True)
                cluster.deploy([spec], resources, {"carpool": knobs})
                system = System(
                    "carpool", make_target("embed", "carpool", spec.prefix), "bench-carpool"
                )
                # The passes re-timed once, in the first round's calibration deployment.
                retime = args.serving_profile if name == CALIBRATION_CONFIG and rnd == 0 else None
                started = time.time()
                try:
                    phases = asyncio.run(_embed_phases(cluster, system, workload, args, retime))
                    results[name] = {"knobs": knobs, **phases}
                except Exception as exc:  # one configuration's failure must not lose the others
                    results[name] = {"knobs": knobs, "error": repr(exc)}
                print(f"embed round {rnd} {name}: {time.time() - started:.0f} s", file=sys.stderr,
                      flush=True)  # fmt: skip
                save_json(args.out + ".partial", {"rounds": [{"embed": r} for r in rounds]})
    finally:
        cluster.shutdown()
    return rounds


def cmd_measure(args: Any) -> int:
    from benchmarks.twin_measure_gen import measure_generation

    results: dict[str, Any] = {
        "command": " ".join([".venv/bin/python -m benchmarks.twin_validate", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_before": list(os.getloadavg()),
        "requests": args.requests,
    }
    rounds: list[dict[str, Any]] = [{} for _ in range(args.rounds)]
    if args.configs:
        for r, embed in zip(rounds, measure_embed(args), strict=True):
            r["embed"] = embed
    if args.gen_configs and (args.gen_clients or args.trace_requests > 0):
        for r, gen in zip(rounds, measure_generation(args), strict=True):
            r["generation"] = gen
    # Each round is a whole measurement (as a file of runs 1-9 is); the report takes each
    # figure's median over the rounds.
    results["rounds"] = rounds
    results["loadavg_after"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"measured: {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.twin_validate", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="the harness's figures (run under the benchmark lock)")
    m.add_argument("--out", default="benchmarks/results/twin-validate.json")
    m.add_argument("--configs", type=lambda s: [x for x in s.split(",") if x],
                   default=list(EMBED_CONFIGS), help=f"embed configs: {list(EMBED_CONFIGS)}")  # fmt: skip
    m.add_argument("--gen-clients", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=list(GEN_CLIENTS))  # fmt: skip
    m.add_argument("--gen-configs", type=lambda s: [x for x in s.split(",") if x],
                   default=list(GEN_CONFIGS), help=f"generation configs: {list(GEN_CONFIGS)}")  # fmt: skip
    m.add_argument("--gen-requests", type=int, default=GEN_REQUESTS,
                   help="requests per closed loop (at least two waves of its clients)")  # fmt: skip
    m.add_argument("--gen-model", default="packaged:SmolLM2-135M-Instruct")
    m.add_argument("--trace", default=TRACE, help="an Azure-format CSV (conversation trace)")
    m.add_argument("--trace-requests", type=int, default=48, help="requests of it (0: none)")
    m.add_argument("--trace-start", type=float, default=600.0, help="seconds into the trace")
    m.add_argument("--trace-rate", type=float, default=0.8, help="mean requests/s replayed")
    m.add_argument("--trace-token-scale", type=float, default=0.125,
                   help="its context and generated tokens times this")  # fmt: skip
    m.add_argument("--rounds", type=int, default=3,
                   help="measure every configuration this many times, interleaved; the report "
                   "takes each figure's median")  # fmt: skip
    m.add_argument("--requests", type=int, default=2000)
    m.add_argument("--duration", type=float, default=40.0)
    m.add_argument("--half-requests", type=int, default=200,
                   help="the half-capacity window lasts until about this many requests arrive "
                   "(at least --duration); its p99 rests on them")  # fmt: skip
    m.add_argument("--calibrate-s", type=float, default=15.0)
    m.add_argument("--port", type=int, default=8163)
    m.add_argument(
        "--serving-profile",
        nargs=2,
        metavar=("PROFILE", "OUT"),
        help="re-time PROFILE's embedder passes in the calibration config's replica "
        "(before its phases) and write the result to OUT",
    )
    m.add_argument("--harness-session", action="store_true",
                   help="start Ray in this process's session (runs 1-6), not its own")  # fmt: skip
    r = sub.add_parser("report", help="the twin beside a measurement: TWIN.md and twin.json")
    r.add_argument("measured")
    r.add_argument("--profile", default="profiles/cpu-2core.json")
    r.add_argument("--md", default="benchmarks/TWIN.md")
    r.add_argument("--json", default="benchmarks/twin.json")
    r.add_argument("--no-host", action="store_true",
                   help="leave the shared host CPU out of the twin (an ablation)")  # fmt: skip
    # Off by default since run 5: one factor read on the default's 1-client run did not carry
    # to other configurations (their own 1-client runs: 1.20 / 0.90 / 1.18; TWIN.md).
    r.add_argument("--pass-scale", action="store_true",
                   help="scale embedder passes by what serving added to them in the default's "
                   "1-client run (run 5's twin)")  # fmt: skip
    r.add_argument("--no-loaded", action="store_true",
                   help="price passes as the 1-client calibration does, not as the 8-client "
                   "one shows them under load (runs 1-9's twin; an ablation)")  # fmt: skip
    r.add_argument("--scale-each", action="store_true",
                   help="each embed configuration's pass scale from its own 1-client run")  # fmt: skip
    args = p.parse_args(argv)
    if args.command == "measure":
        return cmd_measure(args)
    from benchmarks.twin_report import cmd_report  # the report's half; it imports this one

    return cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
