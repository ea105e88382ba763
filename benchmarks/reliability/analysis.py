"""Pure figures of a reliability run (no I/O, no Ray): what was lost, windows, drift, memory.

Every request record carries the target it was sent to and, for refusals, whether the
response said when to retry. Times are seconds from the run's start; latency is measured
from the *scheduled* arrival (as in ``benchmarks.stats``), so a client that falls behind
cannot hide queueing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.loadgen import CANCELLED, TIMED_OUT, TRANSPORT_ERROR
from benchmarks.stats import RequestRecord, percentile

# No HTTP answer at all: a connection error, a client timeout, or still in flight at the end.
LOST_STATUSES = frozenset({TRANSPORT_ERROR, TIMED_OUT, CANCELLED})
# What the client records for each kind of lost request, for the status histogram.
LOST_LABELS = {TRANSPORT_ERROR: "connection_error", TIMED_OUT: "timeout", CANCELLED: "no_answer"}
# Admission refusals: the server said "not now" on purpose (fast, with Retry-After).
REFUSAL_STATUSES = frozenset({429, 503})


# The load generator's record carries the target, Retry-After and error code itself.
RelRecord = RequestRecord


def is_lost(record: RequestRecord) -> bool:
    return record.status in LOST_STATUSES


def is_refused(record: RequestRecord) -> bool:
    return record.status in REFUSAL_STATUSES


def is_failed(record: RequestRecord) -> bool:
    """An HTTP answer that is neither a success nor a deliberate refusal (500, 502, 504...)."""
    return not record.ok and not is_lost(record) and not is_refused(record)


def status_histogram(records: Iterable[RequestRecord]) -> dict[str, int]:
    """``{"200": n, "503": n, "timeout": n, ...}``, most frequent first."""
    counts = Counter(LOST_LABELS.get(r.status, str(r.status)) for r in records)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def lost_count(records: Iterable[RequestRecord]) -> int:
    return sum(1 for r in records if is_lost(r))


def _ms(values: Iterable[float]) -> list[float]:
    return [v * 1000 for v in values]


def latency_ms(records: Sequence[RequestRecord]) -> dict[str, float]:
    """p50/p99/max in ms of the given records (NaN when there are none)."""
    lat = sorted(_ms(r.latency for r in records))
    return {
        "n": len(lat),
        "p50": percentile(lat, 50.0),
        "p99": percentile(lat, 99.0),
        "max": lat[-1] if lat else math.nan,
    }


def phase_summary(records: Sequence[RelRecord], duration_s: float) -> dict[str, Any]:
    """Offered / accepted / refused rates, latencies, statuses, Retry-After and losses."""
    ok = [r for r in records if r.ok]
    refused = [r for r in records if is_refused(r)]
    failed = [r for r in records if is_failed(r)]
    lost = [r for r in records if is_lost(r)]
    span = duration_s if duration_s > 0 else 1.0
    with_retry_after = sum(1 for r in refused if r.retry_after)
    return {
        "sent": len(records),
        "offered_rps": len(records) / span,
        "accepted_rps": len(ok) / span,
        "accepted_items_per_s": sum(r.items for r in ok) / span,
        "refused_rps": len(refused) / span,
        "accepted": len(ok),
        "refused": len(refused),
        "failed": len(failed),
        "lost": len(lost),
        "accepted_share": len(ok) / len(records) if records else math.nan,
        "accepted_latency_ms": latency_ms(ok),
        "refused_latency_ms": latency_ms(refused),
        "failed_latency_ms": latency_ms(failed),
        "statuses": status_histogram(records),
        "retry_after_share": with_retry_after / len(refused) if refused else math.nan,
        "retry_after_values": dict(Counter(r.retry_after or "-" for r in refused).most_common(5)),
        "error_codes": dict(Counter(r.code or "-" for r in records if not r.ok).most_common(5)),
        "client_lag_p99_ms": percentile(sorted(_ms(r.started - r.scheduled for r in records)), 99)
        if records
        else math.nan,
    }


def ratio(numerator: float, denominator: float) -> float:
    if not denominator or math.isnan(denominator) or math.isnan(numerator):
        return math.nan
    return numerator / denominator


# --- windows ------------------------------------------------------------------------------


@dataclass
class Window:
    """Requests *scheduled* in ``[start, end)``: their outcome and latency."""

    start: float
    end: float
    sent: int
    ok: int
    refused: int
    failed: int
    lost: int
    p50_ms: float
    p99_ms: float
    statuses: dict[str, int]

    @property
    def success_rate(self) -> float:
        return self.ok / self.sent if self.sent else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "start_s": round(self.start, 3),
            "end_s": round(self.end, 3),
            "sent": self.sent,
            "ok": self.ok,
            "refused": self.refused,
            "failed": self.failed,
            "lost": self.lost,
            "success_rate": self.success_rate,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "statuses": self.statuses,
        }


def windows(
    records: Sequence[RequestRecord], width_s: float, start: float = 0.0, end: float | None = None
) -> list[Window]:
    """Consecutive windows of ``width_s`` seconds by scheduled time (last one may be short)."""
    if width_s <= 0:
        raise ValueError(f"window width must be > 0 s, got {width_s!r}")
    if end is None:
        end = max((r.scheduled for r in records), default=start) + 1e-9
    buckets: dict[int, list[RequestRecord]] = {}
    for r in records:
        if start <= r.scheduled < end:
            buckets.setdefault(int((r.scheduled - start) // width_s), []).append(r)
    out = []
    count = max(1, math.ceil((end - start) / width_s))
    for i in range(count):
        chunk = buckets.get(i, [])
        ok_lat = sorted(_ms(r.latency for r in chunk if r.ok))
        out.append(
            Window(
                start=start + i * width_s,
                end=min(start + (i + 1) * width_s, end),
                sent=len(chunk),
                ok=len(ok_lat),
                refused=sum(1 for r in chunk if is_refused(r)),
                failed=sum(1 for r in chunk if is_failed(r)),
                lost=sum(1 for r in chunk if is_lost(r)),
                p50_ms=percentile(ok_lat, 50.0),
                p99_ms=percentile(ok_lat, 99.0),
                statuses=status_histogram(chunk),
            )
        )
    return out


def drift(first: Window, last: Window) -> dict[str, float]:
    """How the last window compares with the first: latency ratios and success-rate change."""
    return {
        "p50_first_ms": first.p50_ms,
        "p50_last_ms": last.p50_ms,
        "p50_ratio": ratio(last.p50_ms, first.p50_ms),
        "p99_first_ms": first.p99_ms,
        "p99_last_ms": last.p99_ms,
        "p99_ratio": ratio(last.p99_ms, first.p99_ms),
        "success_first": first.success_rate,
        "success_last": last.success_rate,
    }


def recovery_time(
    wins: Sequence[Window],
    after_s: float,
    baseline_success: float,
    baseline_p99_ms: float | None = None,
    latency_factor: float = 2.0,
    success_slack: float = 0.01,
) -> float | None:
    """Seconds from ``after_s`` until the windows are back to normal and stay there.

    A window is normal when its success rate is within ``success_slack`` of the baseline and
    (if a baseline p99 is given) its p99 is at most ``latency_factor`` times that baseline.
    The answer is the start of the first window after which every window is normal (0 when
    nothing ever left normal); None when the run ended abnormal.
    """

    def normal(w: Window) -> bool:
        if not w.sent:
            return True
        if w.success_rate < baseline_success - success_slack:
            return False
        has_baseline = baseline_p99_ms is not None and not math.isnan(baseline_p99_ms)
        return not (
            has_baseline and (math.isnan(w.p99_ms) or w.p99_ms > latency_factor * baseline_p99_ms)
        )

    after = [w for w in wins if w.end > after_s]
    if not after:
        return None
    last_bad = None
    for i, w in enumerate(after):
        if not normal(w):
            last_bad = i
    if last_bad is None:
        return 0.0
    if last_bad == len(after) - 1:
        return None
    return max(0.0, after[last_bad + 1].start - after_s)


# --- memory -------------------------------------------------------------------------------


def memory_growth(
    samples: Sequence[tuple[float, float]], warmup_s: float = 0.0, flat_mb_per_min: float = 1.0
) -> dict[str, Any]:
    """Growth of one process's RSS from ``(t_seconds, rss_mb)`` samples after ``warmup_s``.

    Reports first vs last sample (MB and MB/min) and the least-squares slope, which one noisy
    sample moves less. ``flat`` when the slope is under ``flat_mb_per_min`` (and the total
    growth under 2% of the first sample or 10 MB, whichever is more).
    """
    kept = sorted((t, m) for t, m in samples if t >= warmup_s and not math.isnan(m))
    if len(kept) < 2:
        return {"samples": len(kept), "flat": None}
    (t0, m0), (t1, m1) = kept[0], kept[-1]
    minutes = (t1 - t0) / 60.0
    growth = m1 - m0
    slope = _slope(kept) * 60.0
    allowance = max(10.0, 0.02 * m0)
    return {
        "samples": len(kept),
        "first_mb": m0,
        "last_mb": m1,
        "max_mb": max(m for _, m in kept),
        "growth_mb": growth,
        "growth_mb_per_min": growth / minutes if minutes > 0 else math.nan,
        "slope_mb_per_min": slope,
        "minutes": minutes,
        "flat": bool(abs(slope) < flat_mb_per_min and abs(growth) <= allowance),
    }


def _slope(points: Sequence[tuple[float, float]]) -> float:
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (m - mean_m) for t, m in points) / var
