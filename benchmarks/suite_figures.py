"""The suite's figures: one window's summary, medians over paired rounds, and the headline.

Pure functions over the windows ``benchmarks.suite`` records (unit-tested without a server);
``python -m benchmarks report`` re-judges a stored run's headline with them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.stats import RequestRecord, percentile, summarize


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
    # Only where the run had 200 clients (suite --goodput-clients 32,200,300): issue 42's
    # held-out check, clients that resend at once on refusal (the closed loop ignores
    # Retry-After).
    "goodput_closed_200": (
        "accepted items/s / capacity, 200 clients resending at once when refused",
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
    if "closed_200" in out.get("goodput", {}).get("carpool", {}):
        h["goodput_closed_200"] = headline_entry(
            "goodput_closed_200",
            paired_ratios(items("goodput", "carpool", "closed_200"), capacity),
        )
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
