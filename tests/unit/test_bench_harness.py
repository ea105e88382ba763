"""The benchmark harness's pure parts: percentiles, arrivals, trace scaling, JSONL, search."""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from benchmarks.arrivals import ArrivalSpec, bursty_arrivals, poisson_arrivals
from benchmarks.search import Probe, find_max_rate
from benchmarks.stats import (
    RequestRecord,
    decumulate,
    histogram_delta,
    parse_prometheus_histogram,
    percentile,
    percentiles,
    rebucket,
    stats_delta,
    summarize,
)
from benchmarks.targets import EmbeddingsTarget, RerankTarget, make_target
from benchmarks.trace import (
    DEFAULT_TRACE,
    REPO_ROOT,
    TRACE_ATTRIBUTION,
    TraceScaling,
    load_azure_trace,
    resolve_trace_path,
    scale_trace,
    trace_workload,
)
from benchmarks.workloads import (
    EmbedRequest,
    GenerateRequest,
    JsonlError,
    LengthMix,
    RankRequest,
    embed_workload,
    generate_workload,
    load_jsonl,
    rank_workload,
    synth_text,
    write_jsonl,
)

# --- percentiles and summaries -----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(1 / 50) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99.9) == 3.0
    assert percentile([1.0, math.inf], 99) == math.inf  # no NaN from inf - inf
    assert percentile([1.0, 2.0, math.inf], 50) == 2.0
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)
    assert list(percentiles([1.0, 2.0])) == ["p50", "p90", "p99", "p99.9"]


def _rec(i: int, sched: float, done: float, status: int = 200, items: int = 2) -> RequestRecord:
    return RequestRecord(i, sched, sched + 0.001, done, status, items, items * 10)


def test_summary_counts_and_throughput() -> None:
    records = [
        _rec(0, 0.0, 0.1),
        _rec(1, 0.5, 0.7),
        _rec(2, 1.0, 1.3),
        _rec(3, 1.5, 2.0, status=503, items=0),
        _rec(4, 1.6, 1.7, status=400, items=0),
        _rec(5, 1.7, 3.7, status=-1, items=0),
        _rec(6, 1.8, 2.0, status=-2, items=0),
    ]
    s = summarize(records)
    assert (s.sent, s.ok, s.rejected, s.errors, s.timeouts, s.cancelled) == (7, 3, 1, 1, 1, 1)
    assert s.span_s == pytest.approx(3.7)
    assert s.requests_per_s == pytest.approx(3 / 3.7)
    assert s.items_per_s == pytest.approx(6 / 3.7)
    assert s.tokens_per_s == pytest.approx(60 / 3.7)
    assert s.latency_ms["p50"] == pytest.approx(200)  # 100, 200, 300 ms
    assert s.max_latency_ms == pytest.approx(300)
    assert s.slo_p99_ms == math.inf
    assert s.offered_rps == pytest.approx(6 / 1.8)
    assert s.client_lag_ms["p50"] == pytest.approx(1.0)


def test_summary_with_fixed_window_and_no_records() -> None:
    s = summarize([_rec(0, 0.0, 0.1), _rec(1, 0.0, 0.2)], window_s=4.0)
    assert s.requests_per_s == pytest.approx(0.5)
    empty = summarize([])
    assert empty.sent == 0 and empty.requests_per_s == 0 and math.isnan(empty.latency_ms["p50"])


# --- replica stats -----------------------------------------------------------------------


def test_stats_delta_recomputes_ratios_from_differences() -> None:
    before = {"forward_passes": 10, "items": 40, "real_tokens": 400, "padded_tokens": 500}
    after = {
        "forward_passes": 20,
        "items": 140,
        "real_tokens": 1400,
        "padded_tokens": 3500,
        "mean_items_per_pass": 7.0,  # cumulative: must not be used
        "forward_ms": 100.0,
        "items_per_pass_histogram": {"4": 3, "10": 10},
    }
    before["forward_ms"] = 50.0
    before["items_per_pass_histogram"] = {"4": 3}
    d = stats_delta(before, after)
    assert d["items"] == 100 and d["forward_passes"] == 10
    assert d["mean_items_per_pass"] == pytest.approx(10.0)
    assert d["padding_waste_ratio"] == pytest.approx(1 - 1000 / 3000)
    assert d["mean_forward_ms"] == pytest.approx(5.0)
    assert d["items_per_pass_histogram"] == {"10": 10.0}


def test_histogram_helpers() -> None:
    assert histogram_delta({"1": 2, "2": 5}, {"1": 2, "2": 9, "4": 1}) == {"2": 4.0, "4": 1.0}
    assert rebucket({"1": 2, "3": 1, "5": 4, "300": 1}, [1, 2, 4, 8]) == {
        "1": 2.0,
        "2": 0.0,
        "4": 1.0,
        "8": 4.0,
        "+Inf": 1.0,
    }
    assert decumulate({"1": 2, "2": 2, "4": 5, "+Inf": 6}) == {"1": 2, "2": 0, "4": 3, "+Inf": 1}


def test_parse_prometheus_histogram_sums_matching_series() -> None:
    text = "\n".join(
        [
            "# HELP ray_carpool_forward_items Items per pass.",
            'ray_carpool_forward_items_bucket{application="a",replica="r1",le="1.0"} 2.0',
            'ray_carpool_forward_items_bucket{application="a",replica="r1",le="+Inf"} 5.0',
            'ray_carpool_forward_items_bucket{application="a",replica="r2",le="1.0"} 1.0',
            'ray_carpool_forward_items_bucket{application="a",replica="r2",le="+Inf"} 1.0',
            'ray_carpool_forward_items_bucket{application="b",replica="r3",le="1.0"} 9.0',
            'ray_carpool_forward_items_count{application="a"} 6.0',
        ]
    )
    got = parse_prometheus_histogram(text, "ray_carpool_forward_items", {"application": "a"})
    assert got == {"1": 3.0, "+Inf": 6.0}


# --- arrivals ----------------------------------------------------------------------------


def test_poisson_arrivals_rate_gaps_and_determinism() -> None:
    times = poisson_arrivals(200, 50, random.Random(1))
    assert times == poisson_arrivals(200, 50, random.Random(1))
    assert all(0 <= t < 50 for t in times) and times == sorted(times)
    n = len(times)
    assert abs(n - 10_000) < 4 * math.sqrt(10_000)  # within 4 sigma
    gaps = np.diff(times)
    assert np.mean(gaps) == pytest.approx(1 / 200, rel=0.05)
    # Exponential gaps: the coefficient of variation is 1.
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.08)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0, 1, random.Random(0))


def test_bursty_arrivals_are_silent_when_off_and_keep_the_mean() -> None:
    times = bursty_arrivals(50, on_s=1.0, off_s=3.0, duration_s=400, rng=random.Random(2))
    assert all((t % 4.0) < 1.0 for t in times)
    assert len(times) / 400 == pytest.approx(50, rel=0.05)


def test_arrival_spec_validates_and_labels() -> None:
    with pytest.raises(ValueError, match="needs a rate"):
        ArrivalSpec(kind="poisson")
    spec = ArrivalSpec(kind="bursty", rate=4, duration_s=10, seed=5)
    assert spec.schedule() == ArrivalSpec(kind="bursty", rate=4, duration_s=10, seed=5).schedule()
    assert "bursty" in spec.label()
    with pytest.raises(ValueError, match="no schedule"):
        ArrivalSpec(kind="closed").schedule()


# --- workloads ---------------------------------------------------------------------------


def test_embed_generator_is_seeded_and_in_range() -> None:
    wl = embed_workload(300, seed=4)
    again = embed_workload(300, seed=4)
    assert [r.texts for r in wl.requests] == [r.texts for r in again.requests]
    assert all(isinstance(r, EmbedRequest) and 1 <= r.items <= 8 for r in wl.requests)
    lengths = [len(t.split()) + 2 for r in wl.requests for t in r.texts]
    assert min(lengths) >= 4 and max(lengths) <= 512
    # Long-tailed: the mean sits well above the median.
    assert np.mean(lengths) > 1.3 * np.median(lengths)
    assert wl.take(305)[300] is wl.requests[0]


def test_rank_and_generate_generators() -> None:
    rank = rank_workload(200, seed=1)
    assert all(isinstance(r, RankRequest) and 5 <= r.items <= 50 for r in rank.requests)
    gen = generate_workload(200, seed=1)
    assert all(isinstance(r, GenerateRequest) and 8 <= r.max_tokens <= 256 for r in gen.requests)
    assert gen.kind == "generate"


def test_length_mix_rejects_inverted_bounds() -> None:
    with pytest.raises(ValueError, match="swap"):
        LengthMix(low=10, high=5)


def test_synthetic_texts_hit_their_token_count() -> None:
    tokenizer = pytest.importorskip("tests.factories").bert_tokenizer
    try:
        tok = tokenizer()
    except Exception:
        pytest.skip("packaged MiniLM tokenizer not installed")
    rng = random.Random(0)
    for n in (4, 17, 100, 300):
        assert len(tok(synth_text(n, rng))["input_ids"]) == n


def test_jsonl_round_trip_and_kinds(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"input": "one text"}),
                "",
                json.dumps({"input": ["a b", "c"]}),
                json.dumps({"query": "q", "documents": ["d1", "d2 d3"]}),
                json.dumps({"prompt": "hi", "max_tokens": 12}),
            ]
        )
    )
    wl = load_jsonl(path)
    assert [r.kind for r in wl.requests] == ["embed", "embed", "rank", "generate"]
    assert wl.requests[1].items == 2 and wl.requests[2].items == 2
    assert wl.arrivals is None and wl.name == "w"
    out = tmp_path / "copy.jsonl"
    write_jsonl(out, wl.requests)
    assert [r.kind for r in load_jsonl(out).requests] == [r.kind for r in wl.requests]


def test_jsonl_arrivals_are_sorted_and_rebased(tmp_path: Path) -> None:
    path = tmp_path / "timed.jsonl"
    lines = [{"input": "late", "arrival_s": 7.5}, {"input": "early", "arrival_s": 2.5}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    wl = load_jsonl(path)
    assert wl.arrivals == [0.0, 5.0]
    assert wl.requests[0].texts == ("early",)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", r"w\.jsonl:1: not valid JSON"),
        ('{"input": []}', r":1: 'input' must be"),
        ('{"foo": 1}', r":1: cannot tell the request kind"),
        ('{"prompt": "x", "max_tokens": 0}', r"max_tokens"),
        ('{"input": "a", "arrival_s": 1}\n{"input": "b"}', r"1 of 2 lines have arrival_s"),
        ('{"input": "a", "arrival_s": -1}', r"arrival_s must be"),
        ("\n\n", r"no requests"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(content)
    with pytest.raises(JsonlError, match=message):
        load_jsonl(path)


# --- trace -------------------------------------------------------------------------------


def _write_trace(path: Path, n: int = 50, gap: float = 0.5) -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        secs = 10 + i * gap
        lines.append(f"2023-11-16 18:15:{secs:010.7f},{100 * (i + 1)},{40 * (i + 1)}")
    path.write_text("\n".join(lines) + "\n")


def test_trace_load_and_scale(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    _write_trace(path)
    rows = load_azure_trace(path)
    assert len(rows) == 50 and rows[0].t == 0.0 and rows[1].t == pytest.approx(0.5)
    scaled = scale_trace(
        rows, TraceScaling(rate=4.0, duration_s=5.0, start_s=1.0, token_scale=0.1, max_tokens=512)
    )
    # 4/s x 5 s = 20 requests, taken from the first one at or after 1.0 trace seconds.
    assert len(scaled.arrivals) == 20
    assert scaled.window_start_s == pytest.approx(1.0)
    # The window (1.0 .. 11.0 trace s) is squeezed into 5 s: a factor of 2.
    assert scaled.time_factor == pytest.approx(2.0)
    assert scaled.arrivals[:3] == pytest.approx([0.0, 0.25, 0.5])
    assert scaled.arrivals[-1] < 5.0
    # Tokens: x0.1 then clipped (rows 3.. have 300.. context tokens).
    assert scaled.context_tokens[:2] == [30, 40]
    assert max(scaled.context_tokens) <= 512
    assert scaled.generated_tokens[0] == 30  # 120 x 0.25
    d = scaled.describe()
    assert d["time_factor"] == pytest.approx(2.0) and d["token_scale"] == 0.1
    assert d["attribution"] == TRACE_ATTRIBUTION and "CC-BY 4.0" in TRACE_ATTRIBUTION
    wl = trace_workload(scaled, "embed")
    assert wl.arrivals == scaled.arrivals and all(r.items == 1 for r in wl.requests)
    with pytest.raises(ValueError, match="trace has"):
        scale_trace(rows, TraceScaling(rate=100, duration_s=5))


def test_trace_path_is_relative_to_the_repo(tmp_path: Path) -> None:
    assert resolve_trace_path(DEFAULT_TRACE) == (REPO_ROOT / DEFAULT_TRACE).resolve()
    assert resolve_trace_path(tmp_path / "x.csv") == tmp_path / "x.csv"
    with pytest.raises(FileNotFoundError, match="--trace"):
        load_azure_trace(tmp_path / "missing.csv")


# --- targets -----------------------------------------------------------------------------


def test_targets_encode_and_decode() -> None:
    t = EmbeddingsTarget("x", "embed/")
    assert t.path == "/embed/v1/embeddings" and t.stats_path == "/embed/v1/stats"
    req = EmbedRequest(("a", "b"), 6)
    assert json.loads(t.encode(req)) == {"input": ["a", "b"], "encoding_format": "base64"}
    answer = t.decode(req, b'{"data": [{}, {}], "usage": {"prompt_tokens": 9}}')
    assert (answer.items, answer.tokens) == (2, 9)
    assert t.decode(req, b"not json").tokens == 6  # falls back to the estimate
    r = RerankTarget("r", "/rank")
    with pytest.raises(ValueError, match="serves 'rank'"):
        r.encode(req)
    with pytest.raises(NotImplementedError, match="generation"):
        make_target("generate", "g", "/gen")


# --- search ------------------------------------------------------------------------------


def _search(threshold: float, guess: float, **kw: object) -> tuple[float, list[float]]:
    async def probe(rate: float) -> Probe:
        return Probe(rate, rate <= threshold)

    result = asyncio.run(find_max_rate(probe, guess, **kw))  # type: ignore[arg-type]
    return result.rate, [p.rate for p in result.probes]


@pytest.mark.parametrize("guess", [1.0, 7.0, 30.0, 200.0])
def test_search_finds_the_threshold_within_resolution(guess: float) -> None:
    rate, probes = _search(20.0, guess, max_probes=20, resolution=0.02)
    assert rate <= 20.0
    assert rate >= 20.0 / 1.02 - 1e-9
    assert len(probes) <= 20


def test_search_respects_the_probe_budget_and_reports_nothing_passing() -> None:
    rate, probes = _search(20.0, 5.0, max_probes=3)
    assert len(probes) == 3 and 0 < rate <= 20
    rate, probes = _search(0.0, 5.0, max_probes=10, min_rate=0.5)
    assert rate == 0.0 and min(probes) >= 0.5 / 1.6


def test_search_steps_down_past_its_budget_until_something_passes() -> None:
    # 15 -> 10.7 -> 7.7 -> 5.5 all fail; a budget of 4 alone would report "no rate".
    rate, probes = _search(3.0, 15.0, max_probes=4, growth=1.4)
    assert 0 < rate <= 3.0 and len(probes) <= 8
    rate, probes = _search(0.001, 15.0, max_probes=4, growth=1.4)
    assert rate == 0.0 and len(probes) == 8


# --- report ------------------------------------------------------------------------------


def _windows(values: list[float], key: str = "items_per_s") -> dict:
    from benchmarks.suite_figures import median_spread

    windows = [
        {key: v, "refused": 0, "lost": 0, "passed_slo_ms": v > 0, "passed_slowdown": v > 0}
        for v in values
    ]
    return {"windows": windows, key: median_spread(values)}


def _paired_results() -> dict:
    """Three rounds of every phase the headline reads, with hand-picked figures."""
    return {
        "config": {"slo_ms": 500, "slo_slowdown": 5, "rounds": 3},
        "offline": {"best": {"items_per_s": 100.0, "batch_size": 64}},
        "saturation": {"carpool": _windows([40, 36, 44]), "naive": _windows([20, 20, 22])},
        "slo": {
            "carpool": {"slo_ms": _windows([30, 33, 27]), "slowdown": _windows([20, 20, 20])},
            "naive": {"slo_ms": _windows([10, 10, 10]), "slowdown": _windows([10, 10, 10])},
            "serve-batch": {"slo_ms": _windows([30, 30, 30]), "slowdown": _windows([5, 5, 5])},
        },
        "goodput": {
            "carpool": {
                "closed_32": _windows([40, 36, 44]),
                "closed_300": _windows([36, 36, 36]),
                "open_3x": _windows([20, 18, 22]),
                "open_10x": _windows([40, 36, 44]),
            }
        },
        "light": {
            "carpool": _windows([11, 10, 12], "p50_ms"),
            "naive": _windows([10, 10, 10], "p50_ms"),
        },
        "burst": {"windows": [{"refused": 0}, {"refused": 2}, {"refused": 0}]},
        "bulk": {"windows": [{"refused": 0}]},
    }


def test_round_orders_rotate_so_each_system_leads_once() -> None:
    from benchmarks.suite_figures import round_orders

    assert round_orders(["A", "B", "C"], 3) == [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"]]
    assert round_orders(["A", "B"], 3) == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert round_orders([], 3) == []


def test_median_spread_and_paired_ratios() -> None:
    from benchmarks.suite_figures import median_spread, paired_ratios

    m = median_spread([3.0, 1.0, None, math.nan, 2.0])
    assert (m["median"], m["min"], m["max"]) == (2.0, 1.0, 3.0)
    assert median_spread([None])["median"] is None
    # round by round, not median over median: (4/2, 9/3, 1/0 -> None)
    assert paired_ratios([4.0, 9.0, 1.0], [2.0, 3.0, 0.0]) == [2.0, 3.0, None]
    assert paired_ratios([1.0, None], [1.0, 1.0]) == [1.0, None]


def test_slowdown_is_latency_over_the_same_requests_idle_latency() -> None:
    from benchmarks.suite_figures import slowdowns

    records = [_rec(0, 0.0, 0.2), _rec(1, 1.0, 1.05), _rec(2, 2.0, 2.1, status=503)]
    keys = [7, 3, 7]  # records 0 and 2 are pool request 7, record 1 is pool request 3
    assert slowdowns(records, keys, {7: 50.0, 3: 25.0}) == pytest.approx([4.0, 2.0, math.inf])
    assert slowdowns([_rec(0, 0.0, 0.1)], [9], {}) == [math.inf]  # no idle figure: a miss


def test_window_duration_is_requests_or_seconds_whichever_first() -> None:
    from benchmarks.suite_figures import window_duration

    assert window_duration(10.0, 300, 60.0) == 30.0
    assert window_duration(2.0, 300, 60.0) == 60.0


def test_headline_keys_ratios_and_met_or_missed() -> None:
    from benchmarks.report import headline_markdown, suite_markdown
    from benchmarks.suite_figures import headline

    results = _paired_results()
    results["headline"] = head = headline(results)
    f = head["figures"]
    for key in (
        "vs_naive",
        "vs_serve_batch",
        "vs_offline",
        "goodput_3x",
        "goodput_10x",
        "goodput_closed_32",
        "goodput_closed_300",
        "closed_32_vs_naive",
        "slowdown_vs_naive",
        "slowdown_vs_serve_batch",
        "light_load_p50_vs_naive",
        "light_load_p50_vs_naive_rank",
        "burst_refused",
        "bulk_refused",
    ):
        assert key in f and "median" in f[key] and "min" in f[key], key
    assert f["vs_naive"]["median"] == pytest.approx(3.0) and f["vs_naive"]["met"]
    assert (f["vs_naive"]["min"], f["vs_naive"]["max"]) == pytest.approx((2.7, 3.3))
    assert f["vs_serve_batch"]["median"] == pytest.approx(1.0) and not f["vs_serve_batch"]["met"]
    assert f["vs_offline"]["median"] == pytest.approx(0.3) and f["vs_offline"]["met"] is None
    assert f["goodput_closed_32"]["median"] == pytest.approx(1.0) and f["goodput_closed_32"]["met"]
    assert f["goodput_3x"]["median"] == pytest.approx(0.5) and not f["goodput_3x"]["met"]
    assert f["closed_32_vs_naive"]["rounds"] == pytest.approx([2.0, 1.8, 2.0])
    assert f["light_load_p50_vs_naive"]["median"] == pytest.approx(1.1)
    assert f["light_load_p50_vs_naive"]["met"]  # <= 1.1
    assert f["light_load_p50_vs_naive_rank"]["median"] is None  # not measured: missed
    assert not f["light_load_p50_vs_naive_rank"]["met"]
    assert f["burst_refused"]["median"] == 0 and not f["burst_refused"]["met"]  # one round had 2
    assert f["bulk_refused"]["met"]
    assert not head["all_met"] and head["met"]["vs_naive"]
    assert "`vs_naive`" in headline_markdown(results)
    text = suite_markdown(results)
    assert "3.00 (2.70-3.30)" in text and "**missed**" in text


def test_goodput_divides_by_the_capacity_measured_in_its_own_round() -> None:
    from benchmarks.suite_figures import headline

    results = _paired_results()
    # The saturation phase (40, 36, 44) ran long before; the goodput phase's own capacity
    # windows are what the overload windows are compared with.
    results["goodput"]["carpool"]["capacity"] = _windows([20, 18, 22])
    f = headline(results)["figures"]
    assert f["goodput_10x"]["rounds"] == pytest.approx([2.0, 2.0, 2.0])
    assert f["goodput_3x"]["median"] == pytest.approx(1.0) and f["goodput_3x"]["met"]
    assert headline(_paired_results())["figures"]["goodput_3x"]["median"] == pytest.approx(0.5)


def test_the_200_client_goodput_row_exists_only_where_the_run_had_200_clients() -> None:
    from benchmarks.suite_figures import headline

    results = _paired_results()
    assert "goodput_closed_200" not in headline(results)["figures"]
    results["goodput"]["carpool"]["closed_200"] = _windows([30, 36, 44])
    f = headline(results)["figures"]["goodput_closed_200"]
    assert f["rounds"] == pytest.approx([0.75, 1.0, 1.0]) and f["met"]  # median 1.0 >= 0.9


def test_slowdown_ratio_is_undefined_when_no_system_held_the_bound() -> None:
    from benchmarks.suite_figures import headline

    results = _paired_results()
    for system in ("carpool", "naive"):
        for w in results["slo"][system]["slowdown"]["windows"]:
            w["passed_slowdown"] = False
    f = headline(results)["figures"]["slowdown_vs_naive"]
    assert "undefined" in f and f["median"] is None  # no window says it passed
    results["slo"]["naive"]["slowdown"]["windows"][1]["passed_slowdown"] = True
    f = headline(results)["figures"]["slowdown_vs_naive"]
    assert "undefined" not in f and f["median"] == pytest.approx(2.0)


def test_report_writes_headline_json_beside_the_readme(tmp_path: Path) -> None:
    from benchmarks.report import write_readme
    from benchmarks.suite_figures import headline

    results = _paired_results()
    results["headline"] = headline(results)
    readme = tmp_path / "README.md"
    readme.write_text("# b\n\n## How to run\n\nkept by hand\n\n## Results\n\nSTALE-FIGURES\n")
    write_readme(results, readme)
    text = readme.read_text()
    assert "kept by hand" in text and "STALE-FIGURES" not in text and "### Headline" in text
    saved = json.loads((tmp_path / "headline.json").read_text())
    assert saved["figures"]["vs_naive"]["median"] == pytest.approx(3.0)


def test_merged_records_keep_the_real_answer_over_a_cancelled_placeholder() -> None:
    from benchmarks.loadgen import CANCELLED, merge_records

    real = _rec(1, 0.0, 0.1)
    merged = merge_records(
        [
            _rec(2, 0.0, 0.1),
            RequestRecord(1, 0.0, 0.0, 0.5, CANCELLED),
            real,
            RequestRecord(3, 0.0, 0.0, 0.5, CANCELLED),
        ]
    )
    assert [r.index for r in merged] == [1, 2, 3]
    assert merged[0] is real and merged[2].status == CANCELLED


def test_retry_after_seconds() -> None:
    from benchmarks.loadgen import retry_after_s

    assert retry_after_s("2", 0.5) == 2.0
    assert retry_after_s(None, 0.5) == 0.5
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 0.5) == 0.5


def test_cli_parses_every_subcommand() -> None:
    from benchmarks.__main__ import build_parser

    p = build_parser()
    a = p.parse_args(["run", "--system", "carpool", "--arrival", "sweep", "--rates", "2,4"])
    assert a.rates == [2.0, 4.0] and a.system == ["carpool"]
    a = p.parse_args(["suite", "--quick", "--variant", 'small={"max_step_tokens": 1024}'])
    assert a.variant == [("small", {"max_step_tokens": 1024})] and a.port == 8100
    assert a.goodput_clients is None
    a = p.parse_args(["suite", "--goodput-clients", "32,200,300"])
    assert a.goodput_clients == "32,200,300"
    with pytest.raises(SystemExit):
        p.parse_args(["suite", "--variant", "not-json"])


def test_offline_cost_model_recovers_known_costs() -> None:
    from benchmarks.offline import OfflinePoint, OfflineResult

    result = OfflineResult(items=100, real_tokens=5000, torch_threads=1)
    for passes, padded in ((100, 5000), (25, 5400), (7, 6100), (4, 7000)):
        seconds = 0.004 * passes + 0.0002 * padded  # 4 ms per pass, 0.2 ms per token
        result.points.append(
            OfflinePoint(100 // passes, "sorted", seconds, 100 / seconds, 0, 0, passes, padded)
        )
    cm = result.cost_model()
    assert cm is not None
    assert cm["per_pass_ms"] == pytest.approx(4.0)
    assert cm["per_padded_token_ms"] == pytest.approx(0.2)
    assert cm["pass_overhead_tokens"] == pytest.approx(20.0)
    assert result.best.passes == 25  # highest items/s among sorted points


# --- model -------------------------------------------------------------------------------


def test_model_collects_batches_like_serve_batch() -> None:
    from benchmarks.simulate import collect_windows

    jobs = [(0.0, [5]), (0.005, [5]), (0.02, [5]), (0.021, [5]), (0.022, [5])]
    windows = collect_windows(jobs, 0.01, lambda have, new: len(have) + len(new) <= 2)
    # A window closes after the wait or as soon as the next request does not fit.
    assert windows == [(0.01, [0, 1]), (0.022, [2, 3]), (0.032, [4])]


def test_model_policies_on_hand_computed_cases() -> None:
    from benchmarks.simulate import (
        CarpoolKnobs,
        CostModel,
        simulate_carpool,
        simulate_naive,
        simulate_serve_batch,
    )

    cost = CostModel(per_pass_ms=1.0, per_token_ms=0.1)
    jobs = [(0.0, [10]), (0.0, [10, 20])]
    # naive: 1 + 0.1*10 = 2 ms, then 1 + 0.1*2*20 = 5 ms.
    assert simulate_naive(jobs, cost) == pytest.approx([0.002, 0.007])
    # serve-batch: one window of both (closes at 10 ms), one pass of 3 texts padded to 20.
    assert simulate_serve_batch(jobs, cost) == pytest.approx([0.017, 0.017])
    # carpool, no wait, no pass overhead: lengths sorted 10, 10, 20 -> passes [10, 10], [20].
    knobs = CarpoolKnobs(
        batch_wait_timeout_s=0.0, pass_overhead_tokens=0, split_policy="greedy", max_batch_tokens=20
    )
    assert simulate_carpool(jobs, cost, knobs) == pytest.approx([0.003, 0.006])


def test_carpool_args_take_serve_yaml_knobs_then_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import deploy

    config = tmp_path / "serve.yaml"
    config.write_text(
        """
applications:
  - name: embed
    import_path: pipelines.embed:build_embed_app
    args:
      embedder:
        replica: {num_cpus: 0.5, thread_policy: idle_cores, max_torch_threads: 2}
        batching: {max_batch_size: 16, pass_overhead_tokens: 10}
    deployments:
      - name: embedder
        user_config: {pass_overhead_tokens: 128, batch_wait_timeout_s: 0.02}
"""
    )
    monkeypatch.setattr(deploy, "SERVE_CONFIG", config)
    resources = deploy.Resources(torch_threads=1)
    assert resources.num_cpus == 0.5  # serve.yaml's embedder reservation
    args = deploy.carpool_embed_args(resources, {"batch_wait_timeout_s": 0.0})
    assert args["embedder"]["batching"] == {
        "max_batch_size": 16,
        "pass_overhead_tokens": 128,  # deployments' user_config wins over args, as in Serve
        "batch_wait_timeout_s": 0.0,  # the benchmark's override wins over both
    }
    assert args["embedder"]["replica"]["torch_threads"] == 1
    # Equal threads with the baselines: serve.yaml's idle-core policy is not taken along.
    assert args["embedder"]["replica"]["thread_policy"] == "reserved"
    assert "max_torch_threads" not in args["embedder"]["replica"]
    # A variant's "ingress" key sets the ingress, not the embedder's batching.
    args = deploy.carpool_embed_args(resources, {"ingress": {"cpu_niceness": 0}})
    assert args["ingress"]["cpu_niceness"] == 0 and "ingress" not in args["embedder"]["batching"]
    # ...and its "replica" key the embedder replica (here serve.yaml's niceness undone).
    args = deploy.carpool_embed_args(resources, {"replica": {"cpu_niceness": 0}})
    replica = args["embedder"]["replica"]
    assert replica["cpu_niceness"] == 0 and replica["thread_policy"] == "reserved"
    assert "replica" not in args["embedder"]["batching"]


def test_a_baseline_that_meets_the_slo_at_no_rate_makes_the_ratio_undefined_not_missed() -> None:
    from benchmarks.report import headline_markdown
    from benchmarks.suite_figures import headline

    results = _paired_results()
    results["slo"]["naive"]["slo_ms"] = _windows([0, 0, 0])
    results["headline"] = head = headline(results)
    f = head["figures"]["vs_naive"]
    assert f["median"] is None and f["met"] is None
    assert "naive held p99 <= SLO in no confirmation window" in f["undefined"]
    assert "30.0 items/s" in f["undefined"] and "in 3 of 3 windows" in f["undefined"]
    assert "vs_naive" not in head["met"]
    assert "undefined: naive held" in headline_markdown(results)
    # A rate the baseline's search found by luck, held in no confirmation window: no ratio.
    results["slo"]["naive"]["slo_ms"] = _windows([10, 10, 10])
    for w in results["slo"]["naive"]["slo_ms"]["windows"]:
        w["passed_slo_ms"] = False
    f = headline(results)["figures"]["vs_naive"]
    assert f["median"] is None and f["met"] is None and "undefined" in f
    # Both at no rate is no finding at all: still a miss.
    results["slo"]["carpool"]["slo_ms"] = _windows([0, 0, 0])
    assert headline(results)["figures"]["vs_naive"]["met"] is False


def test_a_searched_rate_carpool_never_held_gives_no_ratio_but_a_held_lower_rate_does() -> None:
    from benchmarks.report import headline_markdown
    from benchmarks.suite_figures import headline

    results = _paired_results()
    results["slo"]["carpool"]["slo_ms"]["rate"] = 5.9
    for w, p99 in zip(results["slo"]["carpool"]["slo_ms"]["windows"], [734, 508, 582], strict=True):
        w.update(passed_slo_ms=False, slo_p99_ms=p99)
    results["slo"]["carpool"]["slowdown"]["rate"] = 3.0
    # Its slowdown windows (20 items/s, each under the SLO) are the rate it held.
    results["headline"] = head = headline(results)
    f = head["figures"]["vs_naive"]
    assert f["median"] == pytest.approx(2.0) and f["met"] is False  # 20 / 10, target 3
    assert "in no confirmation window (p99 508-734 ms)" in f["basis"]
    assert "slowdown windows at 3.00 req/s, which held it in 3 of 3: a lower bound" in f["basis"]
    assert head["figures"]["vs_serve_batch"]["median"] == pytest.approx(20 / 30)
    assert head["figures"]["vs_offline"]["median"] == pytest.approx(0.2)
    assert "2.00 (carpool held p99 <= SLO at its searched rate (5.90" in headline_markdown(results)
    # Held at neither rate: no figure, and a miss.
    results["slo"]["carpool"]["slowdown"]["windows"][0]["passed_slo_ms"] = False
    head = headline(results)
    for key in ("vs_naive", "vs_serve_batch"):
        f = head["figures"][key]
        assert f["median"] is None and f["met"] is False and "nor at a lower rate" in f["not_held"]
        assert head["met"][key] is False
    assert head["figures"]["vs_offline"]["median"] is None
    # One confirmation window held at the searched rate: its ratio stands.
    results["slo"]["carpool"]["slo_ms"]["windows"][1]["passed_slo_ms"] = True
    f = headline(results)["figures"]["vs_naive"]
    assert f["median"] == pytest.approx(3.0) and "basis" not in f and "not_held" not in f


def test_the_harness_is_not_installed_with_the_product() -> None:
    # benchmarks/ and dashboards/ run from a checkout (`python -m benchmarks`, from the
    # repository root): a wheel of carpool must not put packages under these generic names
    # into site-packages.
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    find = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    include = find["find"]["include"]
    for package in ("benchmarks", "benchmarks.peers", "dashboards"):
        assert not any(fnmatch.fnmatch(package, pattern) for pattern in include), package
    for package in ("carpool", "carpool.generation", "router", "pipelines", "deployments"):
        assert any(fnmatch.fnmatch(package, pattern) for pattern in include), package


def test_a_fixed_slo_rate_skips_the_search_and_runs_every_system_at_that_rate() -> None:
    """``--slo-rate``: no probes; each system's windows run at the one rate, paired in rounds,
    and the slowdown reuses the same windows (both criteria share the rate)."""
    from benchmarks.loadgen import Endpoint, LoadResult
    from benchmarks.stats import RequestRecord
    from benchmarks.suite import Suite
    from benchmarks.suite_config import SuiteConfig

    class RecordingLoad:
        """Answers every request in 50 ms and keeps the label of each run."""

        def __init__(self) -> None:
            self.labels: list[str] = []

        async def run_open(self, target, requests, times, label, guard):
            self.labels.append(label)
            recs = [RequestRecord(i, t, t, t + 0.05, 200, items=1) for i, t in enumerate(times)]
            return LoadResult(records=recs)

        async def quiesce(self, stats_path, timeout_s):
            return None

    config = SuiteConfig.quick(systems=["carpool", "naive"], slo_rate=3.0, rounds=2)
    load = RecordingLoad()
    out: dict = {}
    suite = Suite(config, load, out)  # type: ignore[arg-type]
    for name in ("carpool", "naive"):
        suite.eps[name] = Endpoint(name, make_target("embed", name, "/x"), suite.pool)
    suite.idle_ms = {n: dict.fromkeys(range(len(suite.pool)), 20.0) for n in suite.eps}
    asyncio.run(suite.slo())
    assert sorted(load.labels) == ["carpool 3.00/s"] * 2 + ["naive 3.00/s"] * 2
    for name in ("carpool", "naive"):
        node = out["slo"][name]
        assert node["probes"] == [] and node["found"] == {"slo_ms": 3.0, "slowdown": 3.0}
        assert node["slo_ms"]["passed_rounds"] == 2 and node["slowdown"]["passed_rounds"] == 2
    with pytest.raises(ValueError):
        SuiteConfig(slo_rate=0)
    # Without it, each system is searched with short probes first, then confirmed at the rate.
    load.labels.clear()
    suite = Suite(SuiteConfig.quick(systems=["carpool"], rounds=1), load, out := {})  # type: ignore[arg-type]
    suite.eps["carpool"] = Endpoint("carpool", make_target("embed", "carpool", "/x"), suite.pool)
    suite.idle_ms = {"carpool": dict.fromkeys(range(len(suite.pool)), 20.0)}
    asyncio.run(suite.slo())
    node = out["slo"]["carpool"]
    assert len(node["probes"]) >= 2 and node["found"]["slo_ms"] > 0.7  # passed: searched up
    # The probes (cached across the two criteria), then one window at each criterion's rate.
    confirmed = load.labels[len(node["probes"]) :]
    assert confirmed == [f"carpool {node['found'][k]:.2f}/s" for k in ("slo_ms", "slowdown")]


def test_a_fixed_slo_rate_run_refuses_to_write_the_published_readme(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Its SLO figures are items/s at one rate: it must not become benchmarks/README.md's
    headline, so without ``--readme no`` it stops before deploying anything."""
    from benchmarks.__main__ import main

    assert main(["suite", "--slo-rate", "5"]) == 2
    assert "--readme no" in capsys.readouterr().err
