"""Metric math of the router evaluation (no model): tau, log-length MAE, buckets, answer
checking, the cascade threshold sweep on synthetic outcomes, and the lanes part's engine
choice (the generator config each engine gets), its run through the router on a fake
generator, result merging and report."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from benchmarks import router_eval
from benchmarks.router_eval import (
    PROMPTS_PATH,
    QUESTIONS_PATH,
    QuestionOutcome,
    _lane_trace,
    auc,
    bucket,
    bucket_accuracy,
    cascade_diagnostics,
    check_answer,
    kendall_tau,
    lane_summary,
    lanes_command,
    mae_log,
    merge_lanes,
    previous_sections,
    recommend,
    render,
    server_config,
    sweep,
)
from carpool.generation.hops import Choice, GenerationResult
from carpool.generation.schemas import GenerationCall
from deployments.generator import GeneratorConfig


def test_kendall_tau_perfect_reversed_and_known_value():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # One swapped pair out of 6: (5 - 1) / 6.
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # Tau-b with a tie in x: C=2, D=0, ties_x=1 -> 2 / sqrt(2 * 3).
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))
    assert kendall_tau([5, 5, 5], [1, 2, 3]) == 0.0


def test_mae_log_and_buckets():
    assert mae_log([0, 9], [0, 9]) == 0.0
    assert mae_log([math.e - 1], [0]) == pytest.approx(1.0)
    assert [bucket(t) for t in (1, 16, 17, 64, 65, 500)] == [0, 0, 1, 1, 2, 2]
    assert bucket_accuracy([10, 30, 100, 100], [12, 70, 150, 5]) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("text", "answer", "rule", "question", "ok"),
    [
        ("19", "19", "number", "What is 12 + 7?", True),
        ("12 + 7 = 19.", "19", "number", "What is 12 + 7?", True),
        ("The answer is 20.", "19", "number", "What is 12 + 7?", False),
        ("There are 1,440 minutes in a day.", "1440", "number", "", True),
        ("no number here", "3", "number", "", False),
        ("The capital of Brazil is Brasília.", "Brasilia|Brasília", "contains", "", True),
        ("Mexico City.", "Mexico City", "contains", "", True),
        ("Parisian", "Paris", "contains", "", False),
        ("Yes, it is.", "yes", "yesno", "", True),
        ("No. Penguins cannot fly, yes really.", "no", "yesno", "", True),
        ("Nope", "no", "yesno", "", False),
    ],
)
def test_check_answer(text, answer, rule, question, ok):
    assert check_answer(text, answer, rule, question) is ok


def test_check_answer_rejects_unknown_rules():
    with pytest.raises(ValueError):
        check_answer("x", "x", "regex")


def outcome(mean_lp: float, small_ok: bool, large_ok: bool, finish: str = "stop", n: int = 4):
    return QuestionOutcome(
        small_token_ids=tuple(range(n)),
        small_logprobs=(mean_lp,) * n,
        small_finish=finish,
        small_correct=small_ok,
        large_correct=large_ok,
        large_tokens=10,
    )


def test_sweep_on_synthetic_outcomes():
    outcomes = [
        outcome(-0.1, True, True),  # confident and right
        outcome(-0.2, True, True),
        outcome(-1.5, False, True),  # unsure and wrong: escalating fixes it
        outcome(-2.5, False, False),  # nobody gets it
        outcome(-0.1, False, True, finish="length"),  # cut off: always escalated
    ]
    rows = {r["threshold"]: r for r in sweep(outcomes, [0.0, -1.0, -2.0, -3.0])}
    # 0: everything escalates -> all-large.
    assert rows[0.0]["small_share"] == 0.0
    assert rows[0.0]["accuracy"] == pytest.approx(4 / 5)
    assert rows[0.0]["large_token_cut"] == pytest.approx(0.0)
    # -1: the two confident ones stay on small, the rest escalate.
    assert rows[-1.0]["small_share"] == pytest.approx(2 / 5)
    assert rows[-1.0]["accuracy"] == pytest.approx(4 / 5)
    assert rows[-1.0]["large_tokens"] == 30
    assert rows[-1.0]["large_token_cut"] == pytest.approx(0.4)
    # -3: only the cut-off answer escalates; the unsure wrong one is kept.
    assert rows[-3.0]["small_share"] == pytest.approx(4 / 5)
    assert rows[-3.0]["accuracy"] == pytest.approx(3 / 5)
    best = recommend(list(rows.values()), large_accuracy=4 / 5)
    # -2 would keep 3/5 on small but lose the unsure answer (3/5 < 0.95 x 4/5).
    assert best["threshold"] == -1.0
    assert best["meets_accuracy"] and not best["meets_small_share"]


def test_recommend_falls_back_to_most_accurate():
    rows = [
        {"threshold": 0.0, "accuracy": 0.5, "small_share": 0.0, "large_token_cut": 0.0},
        {"threshold": -1.0, "accuracy": 0.6, "small_share": 0.4, "large_token_cut": 0.4},
    ]
    best = recommend(rows, large_accuracy=0.9)
    assert best["threshold"] == -1.0 and not best["meets_accuracy"]


def test_data_files_are_well_formed():
    prompts = [json.loads(line) for line in PROMPTS_PATH.read_text().splitlines()]
    assert len(prompts) >= 250 and len({p["id"] for p in prompts}) == len(prompts)
    questions = [json.loads(line) for line in QUESTIONS_PATH.read_text().splitlines()]
    assert 60 <= len(questions) <= 80
    for q in questions:
        # Every reference answer passes its own checker.
        assert check_answer(q["answer"], q["answer"], q["rule"], ""), q


def test_report_renders_from_partial_results():
    text = render({})
    assert text.startswith("# Router evaluation")


def test_auc_and_cascade_diagnostics():
    assert auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert auc([0.1], [0.9]) == 0.0
    assert auc([0.5], [0.5]) == 0.5
    answers = [
        {
            "small_correct": True,
            "large_correct": True,
            "small_mean_logprob": -0.1,
            "small_finish": "stop",
        },
        {
            "small_correct": False,
            "large_correct": True,
            "small_mean_logprob": -0.9,
            "small_finish": "stop",
        },
        {
            "small_correct": False,
            "large_correct": False,
            "small_mean_logprob": -0.5,
            "small_finish": "length",
        },
        {
            "small_correct": True,
            "large_correct": False,
            "small_mean_logprob": -0.2,
            "small_finish": "stop",
        },
    ]
    diag = cascade_diagnostics(answers)
    assert diag["logprob_auc"] == 1.0  # both right answers above the wrong stopped one
    assert diag["small_cut_off_share"] == 0.25
    assert diag["oracle_small_share"] == 0.75  # all but the one only large gets right
    assert diag["oracle_accuracy"] == 0.75


# --- lanes part: engine choice, results, report --------------------------------------------


@pytest.fixture
def threads(monkeypatch):
    def set_threads(n: int) -> None:
        monkeypatch.setitem(router_eval.THREADS, "torch", n)

    set_threads(1)
    return set_threads


def test_continuous_engine_config_has_no_vllm_section(threads):
    config = server_config("packaged:SmolLM2-135M-Instruct", 8)
    assert config["mode"] == "continuous" and "vllm" not in config
    cfg = GeneratorConfig.model_validate(config)  # what GeneratorServer will accept
    assert cfg.mode == "continuous" and cfg.batching.max_num_seqs == 8
    assert cfg.replica.num_cpus == 1


@pytest.mark.parametrize(("priority", "n_threads", "bind"), [(False, 1, "0"), (True, 2, "0-1")])
def test_vllm_engine_config(threads, priority, n_threads, bind):
    threads(n_threads)
    config = server_config(
        "packaged:SmolLM2-135M-Instruct", 8, engine="vllm", priority=priority, aging=5.0
    )
    cfg = GeneratorConfig.model_validate(config)
    assert cfg.mode == "vllm"
    assert cfg.vllm.priority_scheduling is priority
    assert cfg.vllm.aging_tokens_per_s == 5.0  # the router lanes' aging, not vLLM's default
    # As many compute threads as the continuous engine gets, not every core.
    assert cfg.vllm.cpu_omp_threads_bind == bind
    assert cfg.batching.max_num_seqs == 8 and cfg.limits.max_seq_len == 512


def test_engine_config_refuses_unknown_engine_and_priority_without_vllm(threads):
    with pytest.raises(ValueError, match="'static'"):
        server_config("m", 8, engine="static")
    with pytest.raises(ValueError, match="vLLM"):
        server_config("m", 8, engine="continuous", priority=True)


def test_main_takes_engine_option():
    with pytest.raises(SystemExit):
        router_eval.main(["--part", "lanes", "--engine", "tgi"])


def test_lane_trace_is_the_same_requests_at_any_rate():
    slow, fast = _lane_trace(0.5, 20, seed=1), _lane_trace(2.0, 20, seed=1)
    assert [(r.kind, r.prompt, r.max_tokens) for r in slow] == [
        (r.kind, r.prompt, r.max_tokens) for r in fast
    ]
    for s, f in zip(slow, fast, strict=True):
        assert s.at == pytest.approx(4 * f.at)


def test_lane_summary():
    out = [
        {"kind": "short", "latency_s": 1.0, "tokens": 10, "lane": "short"},
        {"kind": "short", "latency_s": 3.0, "tokens": 10, "lane": "long"},
        {"kind": "long", "latency_s": 8.0, "tokens": 180, "lane": "long"},
    ]
    s = lane_summary(out, makespan=10.0)
    assert s["throughput_tok_s"] == pytest.approx(20.0)
    assert s["throughput_req_s"] == pytest.approx(0.3)
    assert s["short"] == {"n": 2, "p50_s": 2.0, "p99_s": pytest.approx(2.98)}
    assert s["long"]["n"] == 1 and s["long"]["p50_s"] == 8.0
    assert s["lane_of_short"] == {"long": 1, "short": 1}


class _FakeGenerator:
    """A generator that answers at once with exactly ``max_tokens`` tokens, and keeps the
    calls it was sent (as ``GeneratorServer.generate`` takes them)."""

    def __init__(self) -> None:
        self.calls: list[GenerationCall] = []
        self.closed = False

    async def generate(self, call: GenerationCall) -> GenerationResult:
        assert isinstance(call, GenerationCall), call
        self.calls.append(call)
        await asyncio.sleep(0.001)
        tokens = call.max_tokens or 1
        return GenerationResult("small", [Choice(0, "x " * tokens, "length")], 5, tokens)

    def close(self) -> None:
        self.closed = True


def test_part_lanes_runs_its_trace_through_the_router_on_a_fake_generator(monkeypatch):
    """The lanes part end to end with the model faked: warm-up, capacity probe, then the
    same trace through a FIFO and a lanes router, each answer's decision read back."""
    from benchmarks.router_eval import lanes

    servers: list[_FakeGenerator] = []

    def make_server(*args: Any, **kwargs: Any) -> _FakeGenerator:
        servers.append(_FakeGenerator())
        return servers[-1]

    monkeypatch.setattr(lanes, "make_server", make_server)
    result = lanes.part_lanes(count=8, load=0.5, seed=1)
    (server,) = servers
    assert server.closed
    trace = _lane_trace(1.0, 8, seed=1)
    # Warm-up, the 30-request probe, then the trace once per router.
    assert len(server.calls) == 1 + 30 + 2 * len(trace)
    assert server.calls[0].messages == [{"role": "user", "content": "Hi"}]
    routed = server.calls[1:]
    assert all(c.predicted_tokens is not None and c.temperature == 0.0 for c in routed)
    shorts = sum(r.kind == "short" for r in trace)
    for name, lanes_seen in (("fifo", {"fifo"}), ("lanes", {"short", "long"})):
        run = result[name]
        assert run["short"]["n"] == shorts and run["long"]["n"] == len(trace) - shorts
        assert sum(run["lane_of_short"].values()) == shorts
        assert set(run["lane_of_short"]) <= lanes_seen
        # The fake answers every request with its max_tokens.
        expected = sum(r.max_tokens for r in trace)
        assert run["throughput_tok_s"] == pytest.approx(expected / run["makespan_s"])
    assert result["capacity_req_s"] > 0 and result["rate_req_s"] == pytest.approx(
        0.5 * result["capacity_req_s"]
    )


def test_the_predictor_part_reads_features_through_the_router():
    router = router_eval._bare_router()
    features = router_eval._features(router, "Write a story about dragons", 192)
    assert router.predictor.predict(features) > 0


def test_lanes_command_shows_the_interpreter_used(tmp_path):
    exe = tmp_path / ".venv" / "bin" / "python"
    assert (
        lanes_command(str(exe), ["--part", "lanes"], cwd=tmp_path)
        == ".venv/bin/python -m benchmarks.router_eval --part lanes"
    )
    assert lanes_command("/opt/py/bin/python", ["--engine", "vllm"], cwd=tmp_path) == (
        "/opt/py/bin/python -m benchmarks.router_eval --engine vllm"
    )


def lanes_result(engine: str, short_p50: float, speedup: float) -> dict:
    run = {
        "short": {"n": 56, "p50_s": short_p50, "p99_s": 9.0},
        "long": {"n": 24, "p50_s": 20.0, "p99_s": 40.0},
        "throughput_tok_s": 30.0,
    }
    return {
        "engine": engine,
        "requests": 80,
        "load": 0.95,
        "capacity_req_s": 0.5,
        "capacity_tok_s": 31.0,
        "rate_req_s": 0.475,
        "max_num_seqs": 8,
        "max_in_flight": 6,
        "aging_tokens_per_s": 5.0,
        "threads": 1,
        "engine_priority_scheduling": {"fifo": False, "lanes": engine == "vllm"},
        "fifo": {**run, "short": {**run["short"], "p50_s": short_p50 * speedup}},
        "lanes": run,
        "short_p50_speedup": speedup,
        "throughput_ratio": 1.0,
        "command": f"python -m benchmarks.router_eval --part lanes --engine {engine}",
        "measured_at": "2026-11-23 20:00 UTC",
        "wall_s": 600.0,
    }


def test_merge_lanes_keeps_the_other_engine_and_drops_the_old_format():
    results = {"lanes": {"fifo": {}, "lanes": {}, "short_p50_speedup": 7.4}}  # before engines
    merge_lanes(results, "continuous", lanes_result("continuous", 1.0, 5.0))
    assert list(results["lanes"]) == ["engines"]
    merge_lanes(results, "vllm", lanes_result("vllm", 0.5, 3.0))
    merge_lanes(results, "continuous", lanes_result("continuous", 1.0, 6.0))
    engines = results["lanes"]["engines"]
    assert sorted(engines) == ["continuous", "vllm"]
    assert engines["continuous"]["short_p50_speedup"] == 6.0
    assert engines["vllm"]["short_p50_speedup"] == 3.0


def test_report_has_a_row_per_engine_and_says_where_vllm_priority_was_on():
    results: dict = {}
    merge_lanes(results, "continuous", lanes_result("continuous", 1.0, 5.0))
    merge_lanes(results, "vllm", lanes_result("vllm", 0.5, 3.0))
    text = render(results)
    rows = [line for line in text.splitlines() if line.startswith("| vllm |")]
    assert len(rows) == 2
    assert rows[1].startswith("| vllm | lanes (shortest first, aging) | 0.50 | 9.00 | 20.00")
    assert rows[1].endswith("| 3.00x | 1.00 |")
    assert "priority scheduling off (FCFS) in the FIFO run and on in the lanes run" in text
    assert "`python -m benchmarks.router_eval --part lanes --engine vllm`" in text
    assert "lanes 600 s (continuous), 600 s (vllm)" in text


PREVIOUS = """# Router evaluation

Intro. Wall time of the last run of each part: predictor 0 s, lanes 611 s, cascade 124 s (lanes...).

## Length predictor

tau table

## Lanes vs one FIFO lane

old lanes table

## Cascade threshold

sweep table

## Notes

old notes
"""


def test_a_part_run_alone_keeps_the_other_sections_of_the_committed_report():
    kept = previous_sections(PREVIOUS)
    assert kept["predictor"] == "## Length predictor\n\ntau table\n"
    assert kept["wall"] == "predictor 0 s, lanes 611 s, cascade 124 s"
    results: dict = {}
    merge_lanes(results, "vllm", lanes_result("vllm", 0.5, 3.0))
    text = render(results, PREVIOUS)
    assert "tau table" in text and "sweep table" in text
    assert "old lanes table" not in text and "| vllm | one FIFO lane |" in text
    assert "predictor 0 s, lanes 600 s (vllm), cascade 124 s" in text
    # Sections keep their order, and the notes are the code's, not the old report's.
    assert text.index("tau table") < text.index("| vllm |") < text.index("sweep table")
    assert "old notes" not in text
