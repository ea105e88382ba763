"""Metric math of the router evaluation (no model): tau, log-length MAE, buckets, answer
checking and the cascade threshold sweep on synthetic outcomes."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.router_eval import (
    PROMPTS_PATH,
    QUESTIONS_PATH,
    QuestionOutcome,
    auc,
    bucket,
    bucket_accuracy,
    cascade_diagnostics,
    check_answer,
    kendall_tau,
    mae_log,
    percentile,
    recommend,
    render,
    sweep,
)


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


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2], 50) == 1.5
    assert percentile([3, 1, 2], 100) == 3
    assert math.isnan(percentile([], 50))


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
