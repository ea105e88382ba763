"""Measuring in paired rounds: every system started, warmed, measured and stopped in turn.

Only one system is under load at a time and no idle one holds memory or threads while
another is measured (a ``top`` snapshot before every window shows it). Figures are the
median over rounds, with the spread (min-max) beside them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from benchmarks.loadgen import LoadGenerator, SloGuard
from benchmarks.peers.stream import burst_split, stream_summary
from benchmarks.peers.systems import MixedSpec, SystemSpec, running
from benchmarks.targets import Target
from benchmarks.workloads import Request, Workload


def paired_rounds(
    systems: Sequence[SystemSpec | MixedSpec],
    rounds: int,
    visit: Callable[[Any, int], Coroutine[Any, Any, dict[str, Any]]],
    result: Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]],
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every system started, visited and stopped in turn, ``rounds`` times, the order rotated
    each round so no system always runs first (or last); ``result(facts, rounds)`` is saved
    after every round, so a run cut short still leaves the rounds it finished."""
    facts: dict[str, Any] = {s.name: dict(s.facts) for s in systems}
    done: list[dict[str, Any]] = []
    for r in range(rounds):
        order = list(systems[r % len(systems) :]) + list(systems[: r % len(systems)])
        per_system: dict[str, Any] = {}
        for system in order:
            try:
                with running(system) as started:
                    facts[system.name].update(started)
                    per_system[system.name] = asyncio.run(visit(system, r))
            except Exception as exc:  # a peer that cannot run is a finding, not a crash
                per_system[system.name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"  {system.name} r{r}: {per_system[system.name]['error']}", flush=True)
        done.append(per_system)
        if save is not None:
            save(result(facts, done))
    return result(facts, done)


async def warm_up(gen: LoadGenerator, target: Target, workload: Workload, n: int = 8) -> None:
    """A few requests outside the window: first-request costs (allocations, caches) are not
    what a window should measure."""
    await gen.run_closed(target, workload.take(n), concurrency=2, duration_s=0.1, label="warm")


async def closed_window(
    gen: LoadGenerator,
    target: Target,
    workload: Workload,
    concurrency: int,
    duration_s: float,
    max_requests: int | None = None,
) -> dict[str, Any]:
    """``concurrency`` clients for ``duration_s`` or ``max_requests``, whichever ends first.

    Throughput is over the span to the last completion (the clients' tail included), so a
    window cut short by ``max_requests`` is not divided by a duration it did not last.
    """
    label = f"{target.name} c={concurrency}"
    result = await gen.run_closed(
        target, workload.requests, concurrency, duration_s, label, max_requests=max_requests
    )
    summary = stream_summary(result.records, None)
    summary["ttft_split_ms"] = burst_split(result.records, concurrency)
    summary["errors_sample"] = [r.error for r in result.records if r.error][:3]
    return summary


async def open_window(
    gen: LoadGenerator,
    target: Target,
    requests: Sequence[Request],
    arrivals: Sequence[float],
    guard: SloGuard | None = None,
) -> dict[str, Any]:
    result = await gen.run_open(target, requests, arrivals, label=target.name, guard=guard)
    summary = stream_summary(result.records, None)
    summary["aborted"] = result.aborted
    summary["errors_sample"] = [r.error for r in result.records if r.error][:3]
    return summary


def probe_span(rate: float, min_requests: int, min_s: float, max_s: float) -> float:
    """Seconds of arrivals for a search probe at ``rate``: ``min_requests`` of them (a p99
    that is not just the slowest one or two), within ``[min_s, max_s]``."""
    return min(max(min_requests / rate, min_s), max_s)
