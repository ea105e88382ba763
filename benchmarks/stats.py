"""Percentiles, run summaries and replica-stat deltas (pure; no I/O).

Latency is measured from a request's *scheduled* arrival, not from when the client managed to
send it, so a client that falls behind cannot hide queueing (no coordinated omission). The
client's own lag is summarised separately, to show whether the load generator kept up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Reported everywhere; p99.9 needs >= 1000 samples to mean much, so summaries carry the count.
PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)

# HTTP statuses that mean "the server refused the load" rather than "the request was bad".
REJECTION_STATUSES = frozenset({429, 503})


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks.

    Same definition as ``numpy.percentile``'s default, so figures can be checked against it.
    Returns NaN for no values.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q!r} is outside [0, 100]")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    frac = rank - low
    if frac == 0 or ordered[high] == ordered[low]:
        return ordered[low]
    if math.isinf(ordered[high]):  # failures count as infinitely slow; inf - x is no number
        return ordered[high]
    return ordered[low] + (ordered[high] - ordered[low]) * frac


def percentiles(values: Sequence[float], qs: Iterable[float] = PERCENTILES) -> dict[str, float]:
    """``{"p50": ..., "p99.9": ...}`` for the given quantiles."""
    ordered = sorted(values)
    return {f"p{q:g}": percentile(ordered, q) for q in qs}


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds from the run's start."""

    index: int
    scheduled: float  # when the arrival process wanted it sent
    started: float  # when the client actually sent it
    finished: float
    status: int  # HTTP status; 0 = transport error, -1 = client timeout, -2 = cancelled
    items: int = 0  # texts / documents / sequences the server answered for
    tokens: int = 0  # tokens the server reported (usage), else the client's estimate
    error: str | None = None
    target: str = ""  # the endpoint's name when a run drives several (reliability, suite)
    retry_after: str | None = None  # a refusal's Retry-After header, as sent
    code: str | None = None  # the error body's "code" (overloaded, backend_unavailable, ...)

    @property
    def latency(self) -> float:
        return self.finished - self.scheduled

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def rejected(self) -> bool:
        return self.status in REJECTION_STATUSES


@dataclass
class RunSummary:
    """Throughput, latency and failure counts of one run (latencies in milliseconds)."""

    sent: int
    ok: int
    errors: int  # 4xx/5xx other than rejections, and transport errors
    rejected: int  # 429/503
    timeouts: int  # client timeout
    cancelled: int  # still in flight when the run was aborted
    span_s: float  # first scheduled arrival to last completion
    offered_rps: float  # requests the arrival process offered per second
    requests_per_s: float
    items_per_s: float
    tokens_per_s: float
    latency_ms: dict[str, float]  # over successful requests
    mean_latency_ms: float
    max_latency_ms: float
    slo_p99_ms: float  # p99 over all sent requests, failures counted as infinitely slow
    client_lag_ms: dict[str, float]  # scheduled -> actually sent: the client's own delay
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    records: Sequence[RequestRecord], window_s: float | None = None, extra: Mapping | None = None
) -> RunSummary:
    """Summarises a run.

    Throughput divides completed work by the span from the first scheduled arrival to the last
    completion (or by ``window_s`` when given, e.g. a closed loop's fixed duration), so a
    server that falls behind shows its real rate, not the offered one.
    """
    sent = len(records)
    done = [r for r in records if r.ok]
    if records:
        first = min(r.scheduled for r in records)
        last_sched = max(r.scheduled for r in records)
        last_done = max(r.finished for r in records)
        span = window_s if window_s is not None else max(last_done - first, 1e-9)
        offered_span = last_sched - first
        offered = (sent - 1) / offered_span if sent > 1 and offered_span > 0 else 0.0
    else:
        span, offered = 0.0, 0.0
    lat = [r.latency * 1000 for r in done]
    everything = [r.latency * 1000 if r.ok else math.inf for r in records]
    per_s = 1 / span if span > 0 else 0.0
    return RunSummary(
        sent=sent,
        ok=len(done),
        errors=sum(1 for r in records if not r.ok and not r.rejected and r.status not in (-1, -2)),
        rejected=sum(1 for r in records if r.rejected),
        timeouts=sum(1 for r in records if r.status == -1),
        cancelled=sum(1 for r in records if r.status == -2),
        span_s=span,
        offered_rps=offered,
        requests_per_s=len(done) * per_s,
        items_per_s=sum(r.items for r in done) * per_s,
        tokens_per_s=sum(r.tokens for r in done) * per_s,
        latency_ms=percentiles(lat),
        mean_latency_ms=sum(lat) / len(lat) if lat else math.nan,
        max_latency_ms=max(lat) if lat else math.nan,
        slo_p99_ms=percentile(everything, 99.0) if everything else math.nan,
        client_lag_ms=percentiles([(r.started - r.scheduled) * 1000 for r in records], (50, 99)),
        extra=dict(extra or {}),
    )


# --- replica stats -----------------------------------------------------------------------

# Cumulative counters in a ``/v1/stats`` answer (carpool's ``BatchStats.snapshot()`` keys);
# everything else there is a ratio or a maximum and is recomputed from the deltas.
COUNTER_KEYS = ("forward_passes", "steps", "items", "real_tokens", "padded_tokens")
HISTOGRAM_KEY = "items_per_pass_histogram"


def stats_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """What the replica did between two ``/v1/stats`` snapshots.

    The stats are cumulative per replica, so a run's share is the difference. Mean batch size
    and padding waste are recomputed from the differences, never averaged.
    """
    out: dict[str, Any] = {}
    for key in COUNTER_KEYS:
        if key in after:
            out[key] = float(after[key]) - float(before.get(key, 0))
    passes = out.get("forward_passes", 0.0)
    padded = out.get("padded_tokens", 0.0)
    if "items" in out:
        out["mean_items_per_pass"] = out["items"] / passes if passes else 0.0
    if "real_tokens" in out:
        out["padding_waste_ratio"] = 1 - out["real_tokens"] / padded if padded else 0.0
    if "forward_ms" in after:  # only the baselines keep a cumulative total
        out["mean_forward_ms"] = (
            (float(after["forward_ms"]) - float(before.get("forward_ms", 0))) / passes
            if passes
            else 0.0
        )
    if HISTOGRAM_KEY in after:
        out[HISTOGRAM_KEY] = histogram_delta(before.get(HISTOGRAM_KEY) or {}, after[HISTOGRAM_KEY])
    return out


def histogram_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Per-bucket differences of two cumulative histograms keyed by bucket label."""
    keys = sorted(set(before) | set(after), key=_bucket_sort_key)
    delta = {k: float(after.get(k, 0)) - float(before.get(k, 0)) for k in keys}
    return {k: v for k, v in delta.items() if v}


def _bucket_sort_key(label: str) -> float:
    try:
        return float(label)
    except ValueError:
        return math.inf


def rebucket(histogram: Mapping[str, float], edges: Sequence[float]) -> dict[str, float]:
    """Exact sizes ``{"3": n, ...}`` counted into ``le`` buckets (Prometheus style edges).

    Lets exact histograms (the baselines') be drawn beside bucketed ones (carpool's metrics).
    """
    out = {_edge_label(e): 0.0 for e in edges}
    out["+Inf"] = 0.0
    for label, count in histogram.items():
        size = float(label) if label != "+Inf" else math.inf
        for e in edges:
            if size <= e:
                out[_edge_label(e)] += count
                break
        else:
            out["+Inf"] += count
    return out


def _edge_label(edge: float) -> str:
    return f"{edge:g}"


def parse_prometheus_histogram(
    text: str, metric: str, labels: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Cumulative ``{le: count}`` of ``<metric>_bucket`` series matching ``labels``, summed.

    Summing over the other labels adds up replicas (and Ray's per-worker series).
    """
    want = dict(labels or {})
    prefix = metric + "_bucket{"
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        body, _, value = line[len(prefix) :].rpartition("} ")
        found = dict(_split_labels(body))
        if any(found.get(k) != v for k, v in want.items()):
            continue
        le = found.get("le")
        if le is None:
            continue
        key = "+Inf" if le == "+Inf" else f"{float(le):g}"
        out[key] = out.get(key, 0.0) + float(value)
    return dict(sorted(out.items(), key=lambda kv: _bucket_sort_key(kv[0])))


def _split_labels(body: str) -> Iterable[tuple[str, str]]:
    # Label values here never contain '",' (Ray's are ids, names and numbers).
    for part in body.split('",'):
        name, _, value = part.partition('="')
        yield name.strip(), value.rstrip('"')


def decumulate(cumulative: Mapping[str, float]) -> dict[str, float]:
    """Prometheus ``le`` buckets (cumulative) to counts per bucket."""
    out: dict[str, float] = {}
    previous = 0.0
    for key, value in sorted(cumulative.items(), key=lambda kv: _bucket_sort_key(kv[0])):
        out[key] = value - previous
        previous = value
    return out
