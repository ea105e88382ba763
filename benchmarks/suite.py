"""The standard suite (``make bench``): carpool vs naive vs serve-batch vs the offline limit.

All systems run in one Serve instance; only one is under load at a time. Every comparison
is *paired*: the systems take turns in rounds within one run (round 1: A, B, C; round 2:
B, C, A; ...), so a slow spell on the shared machine hits them alike, and every figure is
the median of the rounds with its spread (min-max). Ratios are taken round by round (A's
round r over B's round r) before the median. A measurement window holds at least
``window_requests`` requests or lasts ``window_s`` seconds, whichever comes first.

Phases and why:

1. warm-up (not measured) and the offline limit: the bare model on the same texts (the ceiling).
2. saturation: closed loop, 32 clients that honour Retry-After: each system's capacity.
3. idle: every distinct request of the probe pool alone (concurrency 1) on each system, the
   denominator of a request's *slowdown* (its latency under load over its own idle latency).
4. SLO: the highest Poisson rate whose p99 <= 500 ms, and the highest whose p99 slowdown <= 5
   (an SLO that means the same on a slower or faster machine). Each system's search starts at
   0.7 of its saturation rate and is searched once with short probes (locating only); the
   rates found are then confirmed in paired rounds of full windows, and those are reported.
5. goodput: carpool under clients that ignore Retry-After (closed loop 32 and 300) and Poisson
   at 3x and 10x its capacity: accepted items/s over capacity, the capacity measured again
   (closed loop 32, honouring Retry-After) at the start of each round, next to its windows. Client timeout 120 s, so a
   request that waits in a queue is not counted lost by the client.
6. light load: Poisson at 0.5 of naive's capacity, carpool vs naive, for /embed and /rank.
7. burst (64 requests at once) and bulk (2 clients, 16 texts of ~200 words each) on carpool's
   default knobs: refusals counted; the target is none.

Budget: about 40 minutes on 2 cores (``--quick``: a few-minute check of the harness).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.arrivals import poisson_arrivals
from benchmarks.deploy import (
    SYSTEMS,
    Resources,
    ServeCluster,
    SystemSpec,
    carpool_embed_args,
    carpool_rank_args,
    logical_cpus_needed,
)
from benchmarks.loadgen import Endpoint, LoadGenerator, LoadResult, SloGuard
from benchmarks.offline import measure_offline_limit, texts_of
from benchmarks.search import Probe, find_max_rate
from benchmarks.stats import RequestRecord, percentile, summarize
from benchmarks.targets import make_target
from benchmarks.workloads import EmbedMix, EmbedRequest, Request, embed_workload, synth_text

Phase = Literal["saturation", "slo", "goodput", "light", "burst", "bulk", "model"]
DEFAULT_PHASES: list[Phase] = ["saturation", "slo", "goodput", "light", "burst", "bulk"]


class SuiteConfig(BaseModel):
    """Knobs of the standard suite; the defaults are the published configuration."""

    model_config = ConfigDict(extra="forbid")

    systems: list[str] = Field(default_factory=lambda: ["carpool", "naive", "serve-batch"])
    port: int = Field(default=8100, ge=1, le=65535)
    resources: Resources = Field(default_factory=Resources)
    carpool_batching: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of serve.yaml's embedder batching knobs."
    )
    variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Extra carpool deployments 'carpool-<name>' with these batching overrides "
        "(an 'ingress' key: the ingress's settings), measured in the same run (for tuning); "
        "the goodput phase measures them beside carpool.",
    )
    phases: list[Phase] = Field(
        default_factory=lambda: list(DEFAULT_PHASES),
        description="Which measured phases to run (the offline limit always runs; the SLO "
        "phase needs saturation's capacity, goodput too, light load naive's).",
    )
    seed: int = 0
    rounds: int = Field(default=3, ge=1, le=9, description="Paired rounds per comparison.")
    window_requests: int = Field(
        default=300, ge=10, description="A measurement window ends after this many requests..."
    )
    window_s: float = Field(default=60.0, gt=0, description="...or after this long.")
    pool_requests: int = Field(
        default=200,
        ge=10,
        description="Distinct embed requests in the load pool; each one's idle latency is "
        "measured, so keep it to a few hundred.",
    )
    idle_passes: int = Field(
        default=2, ge=1, description="Idle latency = the fastest of this many tries."
    )
    mix: EmbedMix = Field(default_factory=EmbedMix)
    slo_ms: float = Field(default=500.0, gt=0)
    slo_slowdown: float = Field(default=5.0, gt=1, description="p99 slowdown bound.")
    warmup_s: float = Field(default=4.0, ge=0)
    concurrency: int = Field(default=32, ge=1, description="Closed-loop clients (capacity).")
    search_requests: int = Field(
        default=150, ge=10, description="Requests per search probe (locating, not reported)."
    )
    search_max_s: float = Field(default=20.0, gt=0)
    max_probes: int = Field(default=4, ge=2, description="Probes per criterion and system.")
    offline_texts: int = Field(default=384, ge=16)
    offline_batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 16, 32, 64, 128])
    model_seconds: float = Field(default=300.0, ge=0, description="'model' phase: sim. seconds.")
    goodput_systems: list[str] = Field(
        default_factory=lambda: ["carpool"],
        description="Systems put through overload (naive queues everything: slow to drain).",
    )
    goodput_clients: list[int] = Field(default_factory=lambda: [32, 300])
    goodput_closed_s: float = Field(default=20.0, gt=0)
    goodput_loads: list[float] = Field(default_factory=lambda: [3.0, 10.0])
    goodput_open_s: float = Field(default=15.0, gt=0, description="Arrivals per overload run.")
    light_load: float = Field(default=0.5, gt=0, le=1, description="Share of naive's capacity.")
    rank_systems: list[str] = Field(default_factory=lambda: ["carpool-rank", "naive-rank"])
    burst_requests: int = Field(default=64, ge=1)
    bulk_clients: int = Field(default=2, ge=1)
    bulk_texts: int = Field(default=16, ge=1)
    bulk_words: int = Field(default=200, ge=1)
    bulk_s: float = Field(default=30.0, gt=0)
    client_timeout_s: float = Field(
        default=120.0, gt=0, description="Long, so a queued request is not counted lost."
    )
    connections: int = Field(default=512, ge=1, description="Room for 300 closed-loop clients.")
    progress: bool = True

    @classmethod
    def quick(cls, **overrides: Any) -> SuiteConfig:
        """A few-minute version for checking the harness, not for publishing."""
        values: dict[str, Any] = dict(
            rounds=2,
            window_requests=40,
            window_s=8.0,
            pool_requests=40,
            idle_passes=1,
            warmup_s=2.0,
            search_requests=40,
            search_max_s=6.0,
            max_probes=2,
            offline_texts=64,
            offline_batch_sizes=[1, 16, 64],
            model_seconds=30.0,
            goodput_clients=[32, 300],
            goodput_closed_s=4.0,
            goodput_open_s=3.0,
            burst_requests=16,
            bulk_s=5.0,
        )
        values.update(overrides)
        return cls(**values)


# --- pure helpers (unit-tested) -------------------------------------------------------------


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """Round r starts at the r-th system: A B C, B C A, C A B, ... (each leads once per n)."""
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)] if n else []


def median_spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median and min-max of the rounds' values (None and NaN rounds are left out)."""
    real = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not real:
        return {"median": None, "min": None, "max": None, "rounds": list(values)}
    return {
        "median": statistics.median(real),
        "min": min(real),
        "max": max(real),
        "rounds": list(values),
    }


def paired_ratios(a: Sequence[float | None], b: Sequence[float | None]) -> list[float | None]:
    """Round-by-round ratios a[r] / b[r]; None where either is missing or b is 0."""
    return [x / y if x is not None and y else None for x, y in zip(a, b, strict=False)]


def slowdowns(
    records: Sequence[RequestRecord], keys: Sequence[int], idle_ms: dict[int, float]
) -> list[float]:
    """Each request's latency over its own idle latency; a failed request is infinitely slow.

    ``keys[record.index]`` is the request's place in the pool, ``idle_ms`` its idle latency.
    """
    out = []
    for r in records:
        idle = idle_ms.get(keys[r.index])
        out.append(r.latency * 1000 / idle if r.ok and idle else math.inf)
    return out


def window_duration(rate: float, window_requests: int, window_s: float) -> float:
    """Arrival span of an open-loop window: ``window_requests`` at ``rate``, at most ``window_s``."""
    return min(window_requests / rate, window_s) if rate > 0 else window_s


def window_summary(records: Sequence[RequestRecord], window_s: float | None = None) -> dict:
    """What a report needs of one window (not the records: results.json stays small)."""
    s = summarize(records, window_s)
    ok = [r for r in records if r.ok]
    return {
        "sent": s.sent,
        "ok": s.ok,
        "refused": s.rejected,
        "lost": s.timeouts + s.cancelled + sum(1 for r in records if r.status == 0),
        "failed": s.errors - sum(1 for r in records if r.status == 0),
        "items_per_s": s.items_per_s,
        "requests_per_s": s.requests_per_s,
        "offered_rps": s.offered_rps,
        "span_s": s.span_s,
        "p50_ms": percentile(sorted(r.latency * 1000 for r in ok), 50),
        "p99_ms": percentile(sorted(r.latency * 1000 for r in ok), 99),
        "slo_p99_ms": s.slo_p99_ms,
        "client_lag_p99_ms": s.client_lag_ms.get("p99"),
        "errors": sorted({r.error[:120] for r in records if r.error and not r.ok})[:3],
    }


# Headline: key -> (what it measures, target, ">=" or "<=" or "==").
TARGETS: dict[str, tuple[str, float, str]] = {
    "vs_naive": ("carpool / naive items/s at p99 <= SLO", 3.0, ">="),
    "vs_serve_batch": ("carpool / serve-batch items/s at p99 <= SLO", 1.5, ">="),
    "vs_offline": ("carpool at p99 <= SLO / offline limit items/s", 0.0, ">="),
    "slowdown_vs_naive": ("carpool / naive items/s at p99 slowdown <= bound", 0.0, ">="),
    "slowdown_vs_serve_batch": ("carpool / serve-batch at p99 slowdown <= bound", 0.0, ">="),
    "closed_32_vs_naive": ("carpool / naive items/s, 32 closed-loop clients", 1.5, ">="),
    "goodput_closed_32": (
        "accepted items/s / capacity, 32 clients ignoring Retry-After",
        0.9,
        ">=",
    ),
    "goodput_closed_300": (
        "accepted items/s / capacity, 300 clients ignoring Retry-After",
        0.9,
        ">=",
    ),
    "goodput_3x": ("accepted items/s / capacity, Poisson at 3x capacity", 0.9, ">="),
    "goodput_10x": ("accepted items/s / capacity, Poisson at 10x capacity", 0.9, ">="),
    "light_load_p50_vs_naive": ("carpool p50 / naive p50, /embed at 0.5 load", 1.1, "<="),
    "light_load_p50_vs_naive_rank": ("carpool p50 / naive p50, /rank at 0.5 load", 1.1, "<="),
    "burst_refused": ("refusals in a 64-request burst (max over rounds)", 0.0, "=="),
    "bulk_refused": ("refusals to 2 bulk clients", 0.0, "=="),
}
# No target in the issue for these; 0 with ">=" is always met, so they show as "-".
UNTARGETED = {"vs_offline", "slowdown_vs_naive", "slowdown_vs_serve_batch"}


def _met(value: float | None, target: float, op: str) -> bool | None:
    if value is None:
        return False
    return {">=": value >= target, "<=": value <= target, "==": value == target}[op]


def headline_entry(key: str, rounds: Sequence[float | None], judge: str = "median") -> dict:
    """A headline figure: median and spread of the paired rounds, target and met/missed.

    ``judge`` is "median" for ratios, "max" for counts whose target is zero in every round.
    """
    what, target, op = TARGETS[key]
    entry = {"what": what, **median_spread(rounds)}
    value = entry["max"] if judge == "max" else entry["median"]
    if key in UNTARGETED:
        entry.update(target=None, met=None)
    else:
        entry.update(target=f"{op} {target:g}", met=_met(value, target, op))
    return entry


def carpool_slo_windows(out: dict[str, Any]) -> tuple[list[float | None], str, str]:
    """carpool's items/s at p99 <= SLO, round by round, from confirmation windows that held it.

    Returns (items, basis, not_held). The search's short probes can pass by luck (2026-11-28
    run: 5.90 req/s found, p99 508-734 ms in all three confirmation windows), so a searched
    rate held in no window is no figure. The slowdown search's windows are confirmations too,
    at a lower rate: when each of them held p99 <= SLO, they are the rate carpool held (a
    lower bound, said in ``basis``). Held in neither: ``not_held`` says so, and it is a miss.
    """
    node = out.get("slo", {}).get("carpool", {})
    searched, lower = node.get("slo_ms", {}), node.get("slowdown", {})
    windows = [w for w in searched.get("windows", []) if w]
    items = [w.get("items_per_s") if w else None for w in searched.get("windows", [])]
    if not any(items) or any(w.get("passed_slo_ms") for w in windows):
        return items, "", ""
    p99s = [w.get("slo_p99_ms") or 0.0 for w in windows]
    miss = (
        f"carpool held p99 <= SLO at its searched rate ({searched.get('rate', 0):.2f} req/s) "
        f"in no confirmation window (p99 {min(p99s):,.0f}-{max(p99s):,.0f} ms)"
    )
    lower_windows = lower.get("windows", [])
    if lower_windows and all(w and w.get("passed_slo_ms") for w in lower_windows):
        return (
            [w.get("items_per_s") for w in lower_windows],
            f"{miss}; from its slowdown windows at {lower.get('rate', 0):.2f} req/s, which held "
            f"it in {len(lower_windows)} of {len(lower_windows)}: a lower bound",
            "",
        )
    return items, "", f"{miss}, nor at a lower rate: no confirmed rate to compare"


def headline(out: dict[str, Any]) -> dict[str, Any]:
    """The ratios the issue asks for, each with the paired rounds behind it."""

    def items(phase: str, system: str, sub: str | None = None) -> list[float | None]:
        node = out.get(phase, {}).get(system, {})
        node = node.get(sub, {}) if sub else node
        return [w.get("items_per_s") if w else None for w in node.get("windows", [])]

    def p50(phase: str, system: str) -> list[float | None]:
        node = out.get(phase, {}).get(system, {})
        return [w.get("p50_ms") if w else None for w in node.get("windows", [])]

    def passed_windows(system: str, crit: str = "slowdown") -> int:
        node = out.get("slo", {}).get(system, {}).get(crit, {})
        return sum(1 for w in node.get("windows", []) if w and w.get(f"passed_{crit}"))

    h: dict[str, Any] = {}
    slo = "slo_ms"
    ours, basis, not_held = carpool_slo_windows(out)
    for key, other in (("vs_naive", "naive"), ("vs_serve_batch", "serve-batch")):
        theirs = items("slo", other, slo)
        h[key] = headline_entry(key, paired_ratios(ours, theirs))
        held = passed_windows("carpool", slo)
        if (
            not not_held
            and any(ours)
            and theirs
            and (not any(theirs) or not passed_windows(other, slo))
        ):
            # On a slow CPU the baseline's largest requests take over the SLO on an idle
            # server: it meets it at no rate (or its search found a rate by luck in a short
            # probe that no 300-request confirmation window then held; 20:27 run: naive
            # "found" 0.43 req/s, p99 580-1,051 ms in its windows). The ratio has no finite
            # value: say so rather than report a miss or a ratio to a rate nobody held.
            h[key].update(
                median=None,
                met=None,
                undefined=f"{other} held p99 <= SLO in no confirmation window on this machine "
                "(its slowest requests take about that long on an idle server); carpool did "
                f"{median_spread(ours)['median']:.1f} items/s there and held it in {held} of "
                f"{len(ours)} windows: compare by slowdown",
            )
    offline = (out.get("offline", {}).get("best") or {}).get("items_per_s")
    h["vs_offline"] = headline_entry(
        "vs_offline", [x / offline if x and offline else None for x in ours]
    )
    for key in ("vs_naive", "vs_serve_batch", "vs_offline"):
        if not_held:
            h[key].update(median=None, not_held=not_held)
            h[key]["met"] = None if key in UNTARGETED else False
        elif basis and "undefined" not in h[key]:
            h[key]["basis"] = basis
    for key, other in (("slowdown_vs_naive", "naive"), ("slowdown_vs_serve_batch", "serve-batch")):
        h[key] = headline_entry(
            key, paired_ratios(items("slo", "carpool", "slowdown"), items("slo", other, "slowdown"))
        )
        if not passed_windows("carpool") and not passed_windows(other):
            # The search's short probes can pass by luck (16:33 run: naive passed at 1.58
            # req/s between failures at 1.13 and 1.87, then failed all three confirmations).
            # A ratio of two rates neither system holds is noise, not a comparison.
            h[key].update(
                median=None,
                undefined=f"neither carpool nor {other} held p99 slowdown <= bound in any "
                "confirmation window on this machine: no rate to compare",
            )
    h["closed_32_vs_naive"] = headline_entry(
        "closed_32_vs_naive",
        paired_ratios(items("saturation", "carpool"), items("saturation", "naive")),
    )
    # Paired in time with each overload window (see Suite.goodput); older results lack it.
    capacity = items("goodput", "carpool", "capacity") or items("saturation", "carpool")
    for key, sub in (
        ("goodput_closed_32", "closed_32"),
        ("goodput_closed_300", "closed_300"),
        ("goodput_3x", "open_3x"),
        ("goodput_10x", "open_10x"),
    ):
        h[key] = headline_entry(key, paired_ratios(items("goodput", "carpool", sub), capacity))
    h["light_load_p50_vs_naive"] = headline_entry(
        "light_load_p50_vs_naive", paired_ratios(p50("light", "carpool"), p50("light", "naive"))
    )
    h["light_load_p50_vs_naive_rank"] = headline_entry(
        "light_load_p50_vs_naive_rank",
        paired_ratios(p50("light", "carpool-rank"), p50("light", "naive-rank")),
    )
    for key in ("burst_refused", "bulk_refused"):
        windows = out.get(key.split("_")[0], {}).get("windows", [])
        h[key] = headline_entry(key, [w.get("refused") for w in windows], judge="max")
    return {
        "figures": h,
        "met": {k: v["met"] for k, v in h.items() if v["met"] is not None},
        "all_met": all(v["met"] for v in h.values() if v["met"] is not None),
        "slo_ms": out.get("config", {}).get("slo_ms"),
        "slo_slowdown": out.get("config", {}).get("slo_slowdown"),
        "offline_items_per_s": offline,
        "capacity_items_per_s": median_spread(capacity)["median"],
    }


# --- the run --------------------------------------------------------------------------------


def system_specs(config: SuiteConfig) -> list[SystemSpec]:
    names = list(config.systems)
    if "light" in config.phases:
        names += [n for n in config.rank_systems if n not in names]
    specs = []
    for name in names:
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r}; choose from {sorted(SYSTEMS)}")
        specs.append(SYSTEMS[name])
    base = SYSTEMS["carpool"]
    for variant, knobs in config.variants.items():
        specs.append(
            SystemSpec(
                f"carpool-{variant}",
                f"/embed-{variant}",
                "embed",
                f"carpool with {knobs}",
                base.build,
            )
        )
    return specs


def overrides_for(config: SuiteConfig) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"carpool": dict(config.carpool_batching)}
    for variant, knobs in config.variants.items():
        out[f"carpool-{variant}"] = {**config.carpool_batching, **knobs}
    return out


class Suite:
    """One suite run: the load generator, the endpoints, and the results as they come."""

    def __init__(self, config: SuiteConfig, gen: LoadGenerator, out: dict[str, Any]) -> None:
        self.config, self.gen, self.out = config, gen, out
        self.pool = embed_workload(config.pool_requests, config.seed, config.mix).requests
        self.eps: dict[str, Endpoint] = {}
        self.idle_ms: dict[str, dict[int, float]] = {}
        self.rng = random.Random(config.seed)

    def log(self, line: str) -> None:
        self.out.setdefault("log", []).append(line)
        print(line, flush=True)

    @property
    def embed_systems(self) -> list[str]:
        return [n for n in self.eps if self.eps[n].target.kind == "embed"]

    async def quiesce(self, name: str, timeout_s: float = 60.0) -> None:
        await self.gen.quiesce(self.eps[name].target.stats_path, timeout_s)

    async def paired(
        self, names: Sequence[str], measure: Callable[[str, int], Awaitable[dict[str, Any]]]
    ) -> dict[str, list[dict[str, Any]]]:
        """Runs ``measure(system, round)`` for every system, interleaved in rounds."""
        out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for r, order in enumerate(round_orders(list(names), self.config.rounds)):
            for name in order:
                out[name].append(await measure(name, r))
                await self.quiesce(name)
        return out

    # --- windows --------------------------------------------------------------------------

    async def closed(
        self, name: str, clients: int, backoff_s: float, duration_s: float | None = None
    ) -> dict[str, Any]:
        c = self.config
        duration = duration_s if duration_s is not None else c.window_s
        result = await self.gen.run_closed(
            self.eps[name],
            None,
            clients,
            duration,
            label=f"{name} closed {clients}",
            refusal_backoff_s=backoff_s,
            max_requests=None if duration_s is not None else c.window_requests,
        )
        return window_summary(result.records)

    async def open(
        self, name: str, rate: float, duration_s: float, guard: SloGuard | None = None
    ) -> tuple[LoadResult, list[int]]:
        """Poisson at ``rate`` for ``duration_s`` over the pool; returns the pool key of each."""
        ep = self.eps[name]
        times = poisson_arrivals(rate, duration_s, random.Random(self.rng.random()))
        keys = [self.rng.randrange(len(ep.requests)) for _ in times]
        result = await self.gen.run_open(
            ep.target, [ep.requests[k] for k in keys], times, f"{name} {rate:.2f}/s", guard
        )
        return result, keys

    async def slo_window(self, name: str, rate: float, duration_s: float, guard: bool) -> dict:
        c = self.config
        result, keys = await self.open(
            name, rate, duration_s, SloGuard(c.slo_ms, overload_s=10.0) if guard else None
        )
        summary = window_summary(result.records)
        slow = slowdowns(result.records, keys, self.idle_ms.get(name, {}))
        summary.update(
            rate=rate,
            aborted=result.aborted,
            p99_slowdown=percentile(sorted(slow), 99) if slow else math.nan,
        )
        summary["passed_slo_ms"] = not result.aborted and summary["slo_p99_ms"] <= c.slo_ms
        summary["passed_slowdown"] = (
            not result.aborted and summary["p99_slowdown"] <= c.slo_slowdown
        )
        return summary

    # --- phases ---------------------------------------------------------------------------

    async def saturation(self) -> None:
        c = self.config
        res = await self.paired(self.embed_systems, lambda n, r: self.closed(n, c.concurrency, 0.5))
        self.out["saturation"] = {n: {"windows": w, **self._med(w)} for n, w in res.items()}
        for n, w in res.items():
            self.log(f"saturation {n}: {self._med(w)['items_per_s']['median']:.1f} items/s")

    def _med(self, windows: list[dict[str, Any]]) -> dict[str, Any]:
        keys = ("items_per_s", "requests_per_s", "p50_ms", "p99_ms", "refused", "lost")
        return {k: median_spread([w.get(k) for w in windows]) for k in keys}

    def capacity_rps(self, name: str) -> float | None:
        med = self.out.get("saturation", {}).get(name, {}).get("requests_per_s", {})
        return med.get("median")

    async def idle(self) -> None:
        """Each pool request alone on each system; chunks interleave the systems."""
        c, names = self.config, self.embed_systems
        lat: dict[str, dict[int, list[float]]] = {n: {} for n in names}
        chunk = 25
        for p in range(c.idle_passes):
            for r, start in enumerate(range(0, len(self.pool), chunk)):
                for name in round_orders(names, r + 1 + p)[-1]:
                    ep = self.eps[name]
                    for k in range(start, min(start + chunk, len(self.pool))):
                        body = ep.target.encode(ep.requests[k])
                        t0 = time.perf_counter()
                        rec = await self.gen.send(ep, ep.requests[k], body, k, 0.0, t0)
                        if rec.ok:
                            lat[name].setdefault(k, []).append(rec.latency * 1000)
        self.idle_ms = {n: {k: min(v) for k, v in lat[n].items()} for n in names}
        self.out["idle"] = {
            n: {
                "requests": len(v),
                "p50_ms": percentile(sorted(v.values()), 50),
                "max_ms": max(v.values(), default=math.nan),
            }
            for n, v in self.idle_ms.items()
        }
        self.log(
            "idle p50: "
            + ", ".join(f"{n} {v['p50_ms']:.0f} ms" for n, v in self.out["idle"].items())
        )

    async def slo(self) -> None:
        """Search once per system and criterion (short probes), then confirm paired."""
        c = self.config
        found: dict[str, dict[str, float]] = {}
        for name in self.embed_systems:
            cache: dict[float, dict[str, Any]] = {}
            probes: list[dict[str, Any]] = []

            async def probe_at(
                rate: float, name: str = name, cache: dict = cache, probes: list = probes
            ) -> dict:
                key = round(rate, 3)
                if key not in cache:
                    d = min(c.search_requests / rate, c.search_max_s)
                    cache[key] = await self.slo_window(name, rate, d, guard=True)
                    probes.append(cache[key])
                    await self.quiesce(name)
                return cache[key]

            cap = self.capacity_rps(name) or 1.0
            found[name] = {}
            guess = 0.7 * cap  # open-loop capacity sits below closed-loop saturation
            for crit in ("slo_ms", "slowdown"):

                async def probe(rate: float, crit: str = crit) -> Probe:
                    w = await probe_at(rate)
                    return Probe(rate, bool(w[f"passed_{crit}"]), w)

                result = await find_max_rate(probe, guess, c.max_probes, growth=1.4, resolution=0.1)
                found[name][crit] = result.rate
                guess = result.rate or guess  # the second criterion starts at the first's answer
            self.out.setdefault("slo", {})[name] = {"found": found[name], "probes": probes}
            self.log(f"slo search {name}: {found[name]}")
        for crit in ("slo_ms", "slowdown"):

            async def confirm(name: str, r: int, crit: str = crit) -> dict[str, Any]:
                rate = found[name][crit]
                if rate <= 0:
                    return {"rate": 0.0, "items_per_s": 0.0, "passed_" + crit: False}
                d = window_duration(rate, c.window_requests, c.window_s)
                return await self.slo_window(name, rate, d, guard=False)

            same = crit == "slowdown" and all(
                abs(f["slowdown"] - f["slo_ms"]) <= 0.1 * max(f["slo_ms"], 1e-9)
                for f in found.values()
            )
            if same:  # both criteria found the same rates: the confirmed windows serve both
                res = {n: self.out["slo"][n]["slo_ms"]["windows"] for n in self.embed_systems}
            else:
                res = await self.paired(self.embed_systems, confirm)
            for name, windows in res.items():
                self.out["slo"][name][crit] = {
                    "rate": found[name][crit],
                    "windows": windows,
                    "passed_rounds": sum(1 for w in windows if w.get(f"passed_{crit}")),
                    **self._med(windows),
                }
                self.log(
                    f"slo {crit} {name} @ {found[name][crit]:.2f} req/s: "
                    f"{self._med(windows)['items_per_s']['median']:.1f} items/s"
                )

    async def goodput(self) -> None:
        c = self.config
        names = [n for n in c.goodput_systems if n in self.eps]
        names += [f"carpool-{v}" for v in c.variants if "carpool" in names]
        res: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
        for r in range(c.rounds):
            for name in round_orders(names, r + 1)[-1]:
                # The denominator is measured here, just before the overload windows it divides:
                # the saturation phase ran half an hour earlier, and this machine drifts more
                # than the effect under test between the two (full run 14:12: 10x read 0.80 of a
                # capacity taken at saturation, closed 32 read 0.92 of it, although closed 32
                # *is* capacity once Retry-After is honoured).
                w = await self.closed(name, c.concurrency, 0.5, c.goodput_closed_s)
                res[name].setdefault("capacity", []).append(w)
                await self.quiesce(name)
                cap = w["requests_per_s"] or self.capacity_rps(name) or 1.0
                for clients in c.goodput_clients:
                    w = await self.closed(name, clients, 0.0, c.goodput_closed_s)
                    res[name].setdefault(f"closed_{clients}", []).append(w)
                    await self.quiesce(name)
                for load in c.goodput_loads:
                    result, _ = await self.open(name, load * cap, c.goodput_open_s)
                    w = window_summary(result.records)
                    w["offered_load"] = load
                    res[name].setdefault(f"open_{load:g}x", []).append(w)
                    await self.quiesce(name)
        self.out["goodput"] = {
            n: {k: {"windows": w, **self._med(w)} for k, w in runs.items()}
            for n, runs in res.items()
        }
        for n, runs in res.items():
            for k, w in runs.items():
                m = self._med(w)
                self.log(
                    f"goodput {n} {k}: {m['items_per_s']['median']:.1f} items/s, "
                    f"refused {m['refused']['median']}, lost {m['lost']['median']}"
                )

    async def light(self) -> None:
        c = self.config
        pairs = [("carpool", "naive"), tuple(c.rank_systems)]
        self.out["light"] = {}
        for a, b in pairs:
            if a not in self.eps or b not in self.eps:
                continue
            cap = self.capacity_rps(b)
            if cap is None:  # rank: naive's capacity is not measured by the saturation phase
                w = await self.closed(b, 8, 0.5, min(c.window_s, 30.0))
                cap = w["requests_per_s"]
                self.out["light"][f"{b}_capacity"] = w
            rate = c.light_load * cap
            d = window_duration(rate, c.window_requests, c.window_s)

            async def measure(name: str, r: int, rate: float = rate, d: float = d) -> dict:
                result, _ = await self.open(name, rate, d)
                return {**window_summary(result.records), "rate": rate}

            res = await self.paired([a, b], measure)
            for n, windows in res.items():
                self.out["light"][n] = {"rate": rate, "windows": windows, **self._med(windows)}
            self.log(
                f"light {a} vs {b} @ {rate:.2f} req/s: p50 "
                f"{self._med(res[a])['p50_ms']['median']:.0f} vs "
                f"{self._med(res[b])['p50_ms']['median']:.0f} ms"
            )

    async def burst(self) -> None:
        """``burst_requests`` mixed requests all at once, once per round (carpool)."""
        c, ep = self.config, self.eps["carpool"]
        windows = []
        for r in range(c.rounds):
            requests = [
                ep.requests[(r * c.burst_requests + i) % len(ep.requests)]
                for i in range(c.burst_requests)
            ]
            result = await self.gen.run_open(ep.target, requests, [0.0] * len(requests), "burst")
            w = window_summary(result.records)
            w["texts"] = sum(q.items for q in requests)
            windows.append(w)
            await self.quiesce("carpool")
        self.out["burst"] = {"windows": windows, **self._med(windows)}
        self.log(f"burst: refused {[w['refused'] for w in windows]} of {c.burst_requests}")

    async def bulk(self) -> None:
        """Clients sending ``bulk_texts`` long texts per request, honouring Retry-After."""
        c, ep = self.config, self.eps["carpool"]
        rng = random.Random(c.seed)
        words = round(c.bulk_words / 1.3)  # synth_text counts tokens; ~1.3 tokens per word
        reqs: list[Request] = [
            EmbedRequest(
                tuple(synth_text(words, rng) for _ in range(c.bulk_texts)),
                c.bulk_texts * c.bulk_words,
            )
            for _ in range(8)
        ]
        bulk = Endpoint("carpool", ep.target, reqs)
        result = await self.gen.run_closed(bulk, None, c.bulk_clients, c.bulk_s, "bulk", 1.0)
        w = window_summary(result.records)
        self.out["bulk"] = {"windows": [w], **self._med([w])}
        await self.quiesce("carpool")
        self.log(f"bulk: {w['ok']} ok, refused {w['refused']}")


async def run_suite_async(config: SuiteConfig, cluster: ServeCluster, out: dict) -> None:
    specs = system_specs(config)
    overrides = overrides_for(config)
    async with LoadGenerator(
        cluster.base_url, config.connections, config.client_timeout_s, config.progress
    ) as gen:
        suite = Suite(config, gen, out)
        rank_pool = _rank_pool(config)
        for s in specs:
            target = make_target(s.kind, s.name, s.prefix)
            suite.eps[s.name] = Endpoint(
                s.name, target, rank_pool if s.kind == "rank" else suite.pool
            )
        out["workload"] = {
            "embed": {**config.mix.model_dump(), "pool_requests": len(suite.pool)},
            "mean_texts_per_request": sum(r.items for r in suite.pool) / len(suite.pool),
        }
        out["systems"] = {
            s.name: {
                "prefix": s.prefix,
                "description": s.description,
                "args": carpool_embed_args(config.resources, overrides.get(s.name))
                if s.name.startswith("carpool") and s.kind == "embed"
                else carpool_rank_args(config.resources)
                if s.kind == "rank"
                else {"resources": config.resources.model_dump()},
            }
            for s in specs
        }
        for ep in suite.eps.values():
            await gen.wait_ready(ep.target.ready_path)
        for name in suite.eps:  # warm-up: kernels, caches, the replicas' cost models
            await gen.run_closed(suite.eps[name], None, 4, config.warmup_s, f"{name} warm-up")
        started = time.monotonic()
        offline = await asyncio.to_thread(
            measure_offline_limit,
            texts_of(suite.pool, config.offline_texts),
            config.resources.model,
            config.resources.torch_threads,
            config.offline_batch_sizes,
            [],
            config.progress,
        )
        out["offline"] = offline.to_dict()
        suite.log(
            f"offline limit: {offline.best.items_per_s:.1f} items/s at batch "
            f"{offline.best.batch_size} ({time.monotonic() - started:.0f} s)"
        )
        if "model" in config.phases:
            await _model_phase(config, suite, offline)
        for phase in ("saturation", "slo", "goodput", "light", "burst", "bulk"):
            if phase in config.phases:
                t = time.monotonic()
                if phase == "slo":
                    await suite.idle()
                await getattr(suite, phase)()
                out.setdefault("phase_s", {})[phase] = round(time.monotonic() - t, 1)


def _rank_pool(config: SuiteConfig) -> list[Request]:
    from benchmarks.reliability.load import LIGHT_RANK
    from benchmarks.workloads import rank_workload

    return rank_workload(min(config.pool_requests, 100), config.seed, LIGHT_RANK).requests


async def _model_phase(config: SuiteConfig, suite: Suite, offline: Any) -> None:
    """The same policies in a discrete-event model with the fitted cost (no noise)."""
    from benchmarks.simulate import CostModel, model_systems
    from carpool.config import CONCURRENT_BATCHES

    cm = offline.cost_model()
    if not cm or config.model_seconds <= 0:
        return
    batching = carpool_embed_args(config.resources, config.carpool_batching)["embedder"]["batching"]
    suite.out["model"] = {
        "cost_model": cm,
        "seconds": config.model_seconds,
        "systems": await asyncio.to_thread(
            model_systems,
            suite.pool,
            CostModel(cm["per_pass_ms"], cm["per_padded_token_ms"]),
            batching,
            CONCURRENT_BATCHES,
            config.slo_ms,
            max(1, round(cm["pass_overhead_tokens"])),
            config.model_seconds,
        ),
    }


def run_suite(config: SuiteConfig, command: str, out: dict[str, Any] | None = None) -> dict:
    """Starts Ray + Serve, deploys every system, runs the suite, tears down.

    Results accumulate in ``out`` as the suite goes, so a caller keeps what was measured
    even if a later step fails.
    """
    from benchmarks.report import machine_info

    specs = system_specs(config)
    out = {} if out is None else out
    out.update(kind="suite", command=command, config=json.loads(config.model_dump_json()))
    started = time.time()
    out["started_at"] = started
    out["machine_before"] = machine_info()
    cluster = ServeCluster(config.port, logical_cpus_needed(specs, config.resources))
    try:
        cluster.start()
        t = time.monotonic()
        cluster.deploy(specs, config.resources, overrides_for(config))
        out.setdefault("log", []).append(
            f"deployed {len(specs)} apps in {time.monotonic() - t:.0f} s"
        )
        asyncio.run(run_suite_async(config, cluster, out))
    finally:
        cluster.shutdown()
        out["duration_s"] = time.time() - started
        out["machine_after"] = machine_info()
        out["headline"] = headline(out)
    return out
