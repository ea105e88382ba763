"""One measured run: a system, a workload, an arrival process; plus what the replica did.

Around each run the replica's cumulative ``/v1/stats`` are read before and after, so mean
batch size and padding waste are those of this run only. When a system's stats carry no
items-per-pass histogram (carpool's do not), the histogram comes from the
``carpool_forward_items`` metric that Ray exports on its metrics port, read the same way.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.arrivals import ArrivalSpec
from benchmarks.loadgen import LoadGenerator, LoadResult, SloGuard
from benchmarks.stats import (
    HISTOGRAM_KEY,
    decumulate,
    histogram_delta,
    parse_prometheus_histogram,
    rebucket,
    stats_delta,
    summarize,
)
from benchmarks.targets import Target
from benchmarks.workloads import Workload

# carpool's items-per-pass buckets (carpool.metrics.ITEM_BUCKETS): every system's histogram
# is drawn on these edges so they compare.
ITEM_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
CARPOOL_ITEMS_METRIC = "ray_carpool_forward_items"


@dataclass
class System:
    """A target plus how to read its replica: its Serve app name (for metric labels)."""

    name: str
    target: Target
    app: str | None = None  # Serve application name; None when unknown (--url)


@dataclass
class RunRecord:
    """Everything kept about one run (JSON-ready through ``to_dict``)."""

    system: str
    workload: str
    arrival: dict[str, Any]
    label: str
    summary: dict[str, Any]
    replica: dict[str, Any]
    aborted: str | None
    started_at: float
    loadavg: tuple[float, float]  # 1-minute load average before and after
    latencies_ms: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    tags: dict[str, Any] = field(default_factory=dict)  # e.g. probe / search / phase

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Bench:
    """Runs workloads against systems through one load generator."""

    def __init__(
        self,
        gen: LoadGenerator,
        metrics_url: str | None = None,
        metrics_interval_s: float = 2.0,
    ) -> None:
        self.gen = gen
        self.metrics_url = metrics_url
        self.metrics_interval_s = metrics_interval_s

    async def replica_snapshot(self, system: System) -> dict[str, Any]:
        """Cumulative replica stats, with the items-per-pass histogram (le buckets) if any."""
        path = system.target.stats_path
        stats = dict(await self.gen.get_json(path) or {}) if path else {}
        if HISTOGRAM_KEY not in stats and self.metrics_url and system.app:
            text = await self._get_text(self.metrics_url)
            if text:
                stats["_metric_buckets"] = parse_prometheus_histogram(
                    text, CARPOOL_ITEMS_METRIC, {"application": system.app}
                )
        return stats

    async def _get_text(self, url: str) -> str | None:
        import httpx

        try:
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                resp = await client.get(url)
            return resp.text if resp.status_code == 200 else None
        except httpx.HTTPError:
            return None

    async def quiesce(self, system: System, timeout_s: float = 30.0) -> None:
        """Waits until the replica stops working (after an aborted run its queue drains)."""
        await self.gen.quiesce(system.target.stats_path, timeout_s)

    async def run(
        self,
        system: System,
        workload: Workload,
        arrival: ArrivalSpec,
        guard: SloGuard | None = None,
        label: str = "",
        tags: dict[str, Any] | None = None,
    ) -> RunRecord:
        label = label or f"{system.name} {workload.name} {arrival.label()}"
        before = await self.replica_snapshot(system)
        load_before = os.getloadavg()[0]
        window: float | None = None
        if arrival.kind == "closed":
            result: LoadResult = await self.gen.run_closed(
                system.target, workload.requests, arrival.concurrency, arrival.duration_s, label
            )
        else:
            if arrival.kind == "replay":
                if workload.arrivals is None:
                    raise ValueError(
                        f"workload {workload.name!r} has no arrival times to replay; use a "
                        "trace or a JSONL with arrival_s on every line, or another arrival kind"
                    )
                times = list(workload.arrivals)
                requests = list(workload.requests)
            else:
                times = arrival.schedule()
                requests = workload.take(len(times))
            result = await self.gen.run_open(system.target, requests, times, label, guard)
        load_after = os.getloadavg()[0]
        await self.quiesce(system)
        if "_metric_buckets" in before:
            # Ray exports metrics on an interval; wait one so the run's last passes are in.
            await asyncio.sleep(self.metrics_interval_s + 1.0)
        after = await self.replica_snapshot(system)
        records = result.records
        summary = summarize(records, window)
        return RunRecord(
            system=system.name,
            workload=workload.name,
            arrival=arrival.model_dump(),
            label=label,
            summary=summary.to_dict(),
            replica=replica_delta(before, after),
            aborted=result.aborted,
            started_at=result.started_at,
            loadavg=(load_before, load_after),
            latencies_ms=[round(r.latency * 1000, 2) for r in records if r.ok],
            error_samples=sorted({r.error for r in records if r.error})[:5],
            tags=dict(tags or {}),
        )


def replica_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Stats delta plus an items-per-pass histogram on ``ITEM_BUCKETS`` edges."""
    if not after:
        return {}
    delta = stats_delta(before, after)
    if HISTOGRAM_KEY in delta:
        delta["items_per_pass_buckets"] = rebucket(delta[HISTOGRAM_KEY], ITEM_BUCKETS)
        delta["histogram_source"] = "exact (/v1/stats)"
    elif "_metric_buckets" in after:
        cumulative = histogram_delta(before.get("_metric_buckets", {}), after["_metric_buckets"])
        delta["items_per_pass_buckets"] = decumulate(cumulative)
        delta["histogram_source"] = f"{CARPOOL_ITEMS_METRIC} (Ray metrics)"
    return delta
