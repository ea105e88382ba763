"""The pure parts of benchmarks.reliability: lost counting, windows, drift, memory, config."""

from __future__ import annotations

import math

import pytest

from benchmarks.loadgen import CANCELLED, TIMED_OUT, TRANSPORT_ERROR
from benchmarks.reliability.analysis import (
    RelRecord,
    drift,
    is_failed,
    lost_count,
    memory_growth,
    phase_summary,
    recovery_time,
    status_histogram,
    windows,
)
from benchmarks.reliability.cluster import (
    app_closure,
    apply_overrides,
    parse_replica_name,
    parse_set,
    process_key,
    user_config,
)
from benchmarks.reliability.common import parse_rates, shares_rates


def rec(i: int, at: float, latency: float, status: int = 200, **kw: object) -> RelRecord:
    return RelRecord(i, at, at, at + latency, status, **kw)  # type: ignore[arg-type]


def test_lost_counts_no_answer_only() -> None:
    records = [
        rec(0, 0.0, 0.1),
        rec(1, 0.1, 0.01, 503, retry_after="1"),
        rec(2, 0.2, 0.5, 500),
        rec(3, 0.3, 30.0, TIMED_OUT),
        rec(4, 0.4, 0.0, TRANSPORT_ERROR),
        rec(5, 0.5, 1.0, CANCELLED),
    ]
    assert lost_count(records) == 3
    assert [is_failed(r) for r in records] == [False, False, True, False, False, False]
    hist = status_histogram(records)
    assert hist["timeout"] == 1 and hist["connection_error"] == 1 and hist["no_answer"] == 1
    s = phase_summary(records, duration_s=2.0)
    assert (s["accepted"], s["refused"], s["failed"], s["lost"]) == (1, 1, 1, 3)
    assert s["offered_rps"] == 3.0 and s["refused_rps"] == 0.5
    assert s["retry_after_share"] == 1.0
    assert s["refused_latency_ms"]["p50"] == pytest.approx(10.0)


def test_windows_split_by_scheduled_time() -> None:
    records = [rec(i, i * 0.5, 0.1 + 0.1 * (i >= 4), 200 if i != 5 else 503) for i in range(8)]
    wins = windows(records, 2.0, 0.0, 4.0)
    assert [w.sent for w in wins] == [4, 4]
    assert wins[0].ok == 4 and wins[1].ok == 3 and wins[1].refused == 1
    assert wins[0].p50_ms == pytest.approx(100.0) and wins[1].p50_ms == pytest.approx(200.0)
    d = drift(wins[0], wins[1])
    assert d["p50_ratio"] == pytest.approx(2.0)
    assert d["success_first"] == 1.0 and d["success_last"] == 0.75
    with pytest.raises(ValueError):
        windows(records, 0)


def test_recovery_time_needs_windows_to_stay_normal() -> None:
    # 1 s windows, 10 requests each; a kill at t=3 fails windows 3-4, latency high in 5.
    records = []
    for w in range(10):
        for j in range(10):
            at = w + j / 10
            status = 503 if w in (3, 4) and j < 5 else 200
            records.append(rec(len(records), at, 0.8 if w == 5 else 0.1, status))
    wins = windows(records, 1.0)
    assert recovery_time(wins, 3.0, 1.0) == pytest.approx(2.0)
    assert recovery_time(wins, 3.0, 1.0, baseline_p99_ms=100.0) == pytest.approx(3.0)
    assert recovery_time(wins[:5], 3.0, 1.0) is None  # ended abnormal
    assert recovery_time(wins, 8.0, 1.0) == 0.0  # nothing wrong after t=8


def test_memory_growth_flat_and_leaking() -> None:
    flat = [(t, 500.0 + (t % 20) * 0.05) for t in range(0, 600, 10)]
    g = memory_growth(flat, warmup_s=60)
    assert g["flat"] is True and g["first_mb"] == pytest.approx(500.0)
    leak = [(float(t), 500.0 + t / 60 * 5) for t in range(0, 600, 10)]  # 5 MB/min
    g = memory_growth(leak, warmup_s=60)
    assert g["flat"] is False
    assert g["slope_mb_per_min"] == pytest.approx(5.0)
    assert g["growth_mb_per_min"] == pytest.approx(5.0)
    assert g["growth_mb"] == pytest.approx(5.0 * (590 - 60) / 60)
    assert memory_growth([(0.0, 1.0)])["flat"] is None
    assert math.isnan(memory_growth([(0.0, 1.0), (0.0, 2.0)])["growth_mb_per_min"])


def test_config_overrides_closure_and_names() -> None:
    config = {
        "applications": [
            {"name": "embed", "args": {}, "deployments": [{"name": "embedder"}]},
            {"name": "rank", "args": {}},
            {"name": "search", "args": {"retriever": {"embed_app": "embed"}, "rank_app": "rank"}},
            {"name": "rag", "args": {"search_app": "search"}},
        ]
    }
    assert app_closure(config, ["search"]) == ["embed", "rank", "search"]
    with pytest.raises(ValueError):
        app_closure(config, ["nope"])
    sets = parse_set(["embed.embedder.max_queued_items=64", "rank.ranker.split_policy=greedy"])
    new = apply_overrides(config, sets)
    assert user_config(new, "embed", "embedder") == {"max_queued_items": 64}
    assert user_config(new, "rank", "ranker") == {"split_policy": "greedy"}
    assert user_config(config, "embed", "embedder") == {}  # the original is untouched
    with pytest.raises(ValueError):
        parse_set(["embed.max_queued_items=64"])
    r = parse_replica_name("SERVE_REPLICA::embed#embedder#abc123")
    assert r is not None and r.key == "embed/embedder"
    assert parse_replica_name("SERVE_CONTROLLER_ACTOR") is None
    assert process_key("ray::ServeReplica:search:retriever") == "search/retriever"
    busy = "ray::ServeReplica:embed:embedder.handle_request_with_rejection"
    assert process_key(busy) == "embed/embedder"
    assert process_key("ray::ProxyActor") == "proxy"
    assert process_key("python -m pytest") is None


def test_rates() -> None:
    assert parse_rates(["embed=10,search=1.5", "rank=2"]) == {
        "embed": 10.0,
        "search": 1.5,
        "rank": 2.0,
    }
    rates = shares_rates({"embed": 0.5, "search": 0.5}, {"embed": 20.0, "search": 2.0}, 0.8)
    assert rates == pytest.approx({"embed": 8.0, "search": 0.8})
