"""``python -m benchmarks.prefix_paired``: ``benchmarks.prefix_replay``'s replay in paired
rounds. Every system is deployed side by side on one Ray, then in each of ``--rounds``
rounds each system in turn (order rotated per round) replays the same requests, each round
other conversations (the next ``--keep`` slice). Same options as ``prefix_replay``, at one
``--rate``; prints each round, a table of ratios to the default and writes JSON (``--out``).

Why: on this box the engines' speed moves by 2x between windows of a few minutes (the
default's TPOT at 0.8 requests/s was 120 ms in one run and 291 ms in another), so systems
replayed one after another, each on its own deployment, compare the box's windows as much
as the systems. Here every round holds a window of each system, ratios are taken round by
round, and the median of the rounds is reported with their spread.

Memory: every system's engines stay loaded, about 2.9 GB each for SmolLM2 with 1 GiB of
KV; three systems of 2 replicas took 19 of this box's 23 GiB, and Ray restarted Serve's
controller in the third round of the first run. Results are saved after every round.

Each system is the generate app of serve-replicas.yaml as ``prefix_replay`` deploys it,
under its own name and route prefix (``generate-<system>``), with its own replicas: only
the one replaying is busy; the others' engines wait with their caches warm from their
earlier rounds, as the replaying one's is.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.deploy import ServeCluster, free_port
from benchmarks.prefix_replay import (
    SYSTEMS,
    ReplayRequest,
    arguments,
    build_rounds,
    command,
    deploy,
    hit_rates,
    replay,
    replica_counters,
    router_cpu_s,
    router_idle_cpu_per_s,
    summarize,
    warm,
)
from benchmarks.suite_figures import median_spread, paired_ratios, round_orders
from carpool import local_ray

# Seconds over which each placement router's CPU is read with nothing in flight, after the
# rounds: what it burns idle (Serve's stats polls, long polls, metrics), taken off its rounds.
IDLE_WINDOW_S = 20.0

# Figures whose per-round ratio to the default's is reported (lower is better for each).
RATIO_FIGURES = (
    ("ttft_mean", lambda s: s["ttft_ms"]["mean"]),
    ("ttft_p50", lambda s: s["ttft_ms"]["p50"]),
    ("ttft_p90", lambda s: s["ttft_ms"]["p90"]),
    ("ttft_p99", lambda s: s["ttft_ms"]["p99"]),
    ("tpot_mean", lambda s: s["tpot_ms_mean"]),
    ("e2e_mean", lambda s: s["e2e_s"]["mean"]),
)


def app_name(system: str) -> str:
    return f"generate-{system}"


def run_paired(
    replicas: int,
    systems: dict[str, str],
    rounds: list[list[ReplayRequest]],
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """``systems``: name -> placement policy. Returns per-round summaries and per-round
    ratios to ``default`` (when it is among the systems); ``save`` gets the same after every
    round, so a run cut short keeps its finished rounds."""
    names = list(systems)
    # Each system's replicas and router ask for their share of Ray's logical CPUs.
    cluster = ServeCluster(port=free_port(), own_session=True, logical_cpus=4 * len(names))
    per_round: list[dict[str, dict[str, Any]]] = []
    order_log: list[list[str]] = []
    try:
        cluster.start()
        started = time.perf_counter()
        for name, policy in systems.items():
            deploy(replicas, policy, app_name(name))
            warm(cluster.base_url, f"/{app_name(name)}/v1/completions")
        deploy_s = time.perf_counter() - started
        for i, requests in enumerate(rounds):
            order = round_orders(names, len(rounds))[i]
            order_log.append(order)
            results: dict[str, dict[str, Any]] = {}
            for name in order:
                app = app_name(name)
                before, cpu_before = replica_counters(app), router_cpu_s(app)
                wall_before = time.perf_counter()
                outcomes, t0 = asyncio.run(
                    replay(cluster.base_url, requests, f"/{app}/v1/completions")
                )
                summary = summarize(outcomes, t0)
                summary["replica_prefix_hit_rate"] = hit_rates(before, replica_counters(app))
                if cpu_before is not None:
                    cpu = (router_cpu_s(app) or 0.0) - cpu_before
                    summary["router_cpu_ms_per_request"] = 1000 * cpu / len(requests)
                    summary["router_window_s"] = time.perf_counter() - wall_before
                results[name] = summary
                print(_line(i, name, summary), flush=True)
            per_round.append(results)
            if save is not None:
                save(_doc(deploy_s, order_log, per_round, systems))
        idle = {name: router_idle_cpu_per_s(IDLE_WINDOW_S, app_name(name)) for name in names}
        for results in per_round:
            for name, summary in results.items():
                window = summary.pop("router_window_s", None)
                if idle[name] is not None and window is not None:
                    idle_ms = 1000 * idle[name] * window / summary["requests"]
                    summary["router_idle_cpu_ms_per_s"] = 1000 * idle[name]
                    summary["router_decision_cpu_ms_per_request"] = (
                        summary["router_cpu_ms_per_request"] - idle_ms
                    )
    finally:
        cluster.shutdown()
    return _doc(deploy_s, order_log, per_round, systems)


def _doc(
    deploy_s: float,
    orders: list[list[str]],
    per_round: list[dict[str, dict[str, Any]]],
    systems: dict[str, str],
) -> dict[str, Any]:
    return {
        "deploy_s": deploy_s,
        "orders": orders,
        "rounds": per_round,
        "ratios_to_default": ratios(per_round) if "default" in systems else {},
    }


def ratios(per_round: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per system and figure: each round's ratio to the default's, their median and range."""
    out: dict[str, dict[str, Any]] = {}
    for name in per_round[0]:
        if name == "default":
            continue
        out[name] = {
            figure: median_spread(
                paired_ratios(
                    [read(results[name]) for results in per_round],
                    [read(results["default"]) for results in per_round],
                )
            )
            for figure, read in RATIO_FIGURES
        }
    return out


def _line(i: int, name: str, s: dict[str, Any]) -> str:
    t = s["ttft_ms"]
    hits = ", ".join(f"{v:.2f}" for v in s["replica_prefix_hit_rate"].values())
    return (
        f"round {i + 1} {name:11s} answered {s['answered']}/{s['requests']} TTFT mean "
        f"{t['mean'] or 0:.0f} p50 {t['p50'] or 0:.0f} p90 {t['p90'] or 0:.0f} ms  TPOT "
        f"{s['tpot_ms_mean'] or 0:.0f} ms  E2E {s['e2e_s']['mean'] or 0:.1f} s  hit rates {hits}"
    )


def ratio_table(doc: dict[str, Any]) -> str:
    lines = [
        "| system / default | " + " | ".join(f for f, _ in RATIO_FIGURES) + " |",
        "|---|" + "---:|" * len(RATIO_FIGURES),
    ]
    for name, figures in doc["ratios_to_default"].items():
        cells = []
        for figure, _ in RATIO_FIGURES:
            r = figures[figure]
            cells.append(
                "-"
                if r["median"] is None
                else f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds, each its slice")
    parser.set_defaults(out="benchmarks/results/prefix-replay-paired.json")
    args = parser.parse_args()
    # Before Ray is imported: it reads its auth mode then (token auth, loopback only).
    os.environ.update(local_ray.ray_environment())
    rounds, facts_by_round = build_rounds(args, [args.rate] * args.rounds)
    systems = {name: SYSTEMS[name] for name in args.systems.split(",")}
    results: dict[str, Any] = {
        "command": command("benchmarks.prefix_paired", args),
        "workload": facts_by_round,
        "machine": {"cpus": 2, "python": platform.python_version()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(paired: dict[str, Any]) -> None:
        out.write_text(json.dumps({**results, "paired": paired}, indent=2))

    results["paired"] = run_paired(args.replicas, systems, rounds, save)
    out.write_text(json.dumps(results, indent=2))
    print(ratio_table(results["paired"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
