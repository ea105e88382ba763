"""Part ``cascade``: small and large answer the checkable questions once each; the
``min_mean_logprob`` threshold is then swept offline over the recorded outcomes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.router_eval.metrics import (
    QuestionOutcome,
    cascade_diagnostics,
    check_answer,
    recommend,
    sweep,
)
from benchmarks.router_eval.models import _run_all, chat_call, load_jsonl, make_server
from benchmarks.router_eval.settings import (
    CASCADE_MAX_TOKENS,
    CASCADE_SYSTEM,
    LARGE_MODEL,
    QUESTIONS_PATH,
    SMALL_MODEL,
)
from carpool.generation.hops import GenerationResult


def _answer_all(model: str, questions: list[dict[str, Any]]) -> list[GenerationResult]:
    server = make_server(model, max_num_seqs=16)
    try:
        # judged: the sweep replays the cascade on these answers' logprobs.
        calls = [
            chat_call(q["question"], CASCADE_MAX_TOKENS, CASCADE_SYSTEM, judged=True)
            for q in questions
        ]
        start = time.perf_counter()
        results = asyncio.run(_run_all(server, calls))
        print(f"{model}: {len(questions)} answers in {time.perf_counter() - start:.0f} s")
        return results
    finally:
        server.close()


def part_cascade() -> dict[str, Any]:
    questions = load_jsonl(QUESTIONS_PATH)
    small = _answer_all(SMALL_MODEL, questions)
    large = _answer_all(LARGE_MODEL, questions)
    outcomes, records = [], []
    for q, s, g in zip(questions, small, large, strict=True):
        s_text, g_text = s.choices[0].text, g.choices[0].text
        o = QuestionOutcome(
            small_token_ids=tuple(s.token_ids),
            small_logprobs=tuple(s.token_logprobs),
            small_finish=s.choices[0].finish_reason,
            small_correct=check_answer(s_text, q["answer"], q["rule"], q["question"]),
            large_correct=check_answer(g_text, q["answer"], q["rule"], q["question"]),
            large_tokens=g.completion_tokens,
        )
        outcomes.append(o)
        lps = o.small_logprobs
        records.append(
            {
                "id": q["id"],
                "kind": q["kind"],
                "small": s_text.strip()[:120],
                "large": g_text.strip()[:120],
                "small_correct": o.small_correct,
                "large_correct": o.large_correct,
                "small_mean_logprob": sum(lps) / len(lps) if lps else None,
                "small_finish": o.small_finish,
            }
        )
    n = len(outcomes)
    small_acc = sum(o.small_correct for o in outcomes) / n
    large_acc = sum(o.large_correct for o in outcomes) / n
    # 0 .. -2: below about -1 this model's finished answers are all kept anyway.
    thresholds = [round(-0.05 * i, 2) for i in range(0, 41)]
    rows = sweep(outcomes, thresholds)
    best = recommend(rows, large_acc)
    result = {
        "questions": n,
        "max_tokens": CASCADE_MAX_TOKENS,
        "all_small_accuracy": small_acc,
        "all_large_accuracy": large_acc,
        "all_large_tokens": sum(o.large_tokens for o in outcomes),
        "sweep": rows,
        "recommended": best,
        "diagnostics": cascade_diagnostics(records),
        "answers": records,
        # Enough to re-sweep without running the models again.
        "outcomes": [
            {
                "small_token_ids": list(o.small_token_ids),
                "small_logprobs": [round(x, 5) for x in o.small_logprobs],
                "small_finish": o.small_finish,
                "small_correct": o.small_correct,
                "large_correct": o.large_correct,
                "large_tokens": o.large_tokens,
            }
            for o in outcomes
        ],
    }
    print("\n== cascade (offline sweep of min_mean_logprob) ==")
    print(f"all-small accuracy {small_acc:.3f}, all-large accuracy {large_acc:.3f}")
    print(f"{'threshold':>10}{'accuracy':>10}{'on small':>10}{'large tok cut':>15}")
    for r in rows[::2]:
        print(
            f"{r['threshold']:>10.2f}{r['accuracy']:>10.3f}{r['small_share']:>10.2f}"
            f"{r['large_token_cut']:>15.2f}"
        )
    print(
        f"recommended min_mean_logprob {best['threshold']}: accuracy {best['accuracy']:.3f} "
        f"({best['accuracy_vs_large']:.0%} of all-large), {best['small_share']:.0%} on small, "
        f"large tokens cut {best['large_token_cut']:.0%}"
    )
    return result
