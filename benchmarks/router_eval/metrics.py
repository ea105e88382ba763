"""The router evaluation's metric functions (pure, unit-tested): ranking and length error
of the predictor, answer checking, and the cascade threshold sweep."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.router_eval.settings import BUCKETS


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b (ties in either ranking do not count as agreement); O(n^2), n ~ 100."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} vs {len(y)} values")
    concordant = discordant = ties_x = ties_y = 0
    n = len(x)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom else 0.0


def mae_log(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Mean |log(1+predicted) - log(1+actual)|: the predictor's own loss scale."""
    pairs = list(zip(predicted, actual, strict=True))
    return sum(abs(math.log1p(p) - math.log1p(a)) for p, a in pairs) / max(len(pairs), 1)


def bucket(tokens: float, edges: Sequence[float] = BUCKETS) -> int:
    for i, edge in enumerate(edges):
        if tokens <= edge:
            return i
    return len(edges)


def bucket_accuracy(
    predicted: Sequence[float], actual: Sequence[float], edges: Sequence[float] = BUCKETS
) -> float:
    pairs = list(zip(predicted, actual, strict=True))
    hits = sum(bucket(p, edges) == bucket(a, edges) for p, a in pairs)
    return hits / max(len(pairs), 1)


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_WORD = re.compile(r"[a-z]+")


def _numbers(text: str) -> list[float]:
    return [float(m.replace(",", "")) for m in _NUMBER.findall(text)]


def normalize(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def check_answer(text: str, answer: str, rule: str, question: str = "") -> bool:
    """Whether a free-text answer is right.

    - ``number``: the first number in the text that is not just repeated from the question
      equals the answer (so "12 + 7 = 19" counts, and so does "19").
    - ``contains``: the normalized answer (any of ``|``-separated alternatives) occurs as
      whole words in the normalized text.
    - ``yesno``: the first "yes" or "no" word in the text is the answer.
    """
    if rule == "number":
        target = float(answer)
        asked = _numbers(question)
        for value in _numbers(text):
            if value in asked and value != target:
                continue
            return abs(value - target) <= 1e-6 * max(1.0, abs(target))
        return False
    if rule == "contains":
        padded = f" {normalize(text)} "
        return any(f" {normalize(alt)} " in padded for alt in answer.split("|"))
    if rule == "yesno":
        for word in _WORD.findall(text.lower()):
            if word in ("yes", "no"):
                return word == answer.lower()
        return False
    raise ValueError(f"unknown checker rule {rule!r}")


@dataclass(frozen=True)
class QuestionOutcome:
    """One question answered by both models (what the offline sweep needs)."""

    small_token_ids: tuple[int, ...]
    small_logprobs: tuple[float, ...]
    small_finish: str
    small_correct: bool
    large_correct: bool
    large_tokens: int


def sweep(
    outcomes: Sequence[QuestionOutcome],
    thresholds: Sequence[float],
    max_repetition: float = 0.3,
    escalate_on_length: bool = True,
) -> list[dict[str, float]]:
    """Per threshold: accuracy, share answered by small alone, large tokens and their cut.

    The cascade's own ``should_escalate`` decides, so the figures are the router's.
    """
    from router.choice import CascadePolicy, SmallOutcome

    all_large_tokens = sum(o.large_tokens for o in outcomes) or 1
    rows = []
    for threshold in thresholds:
        policy = CascadePolicy(threshold, max_repetition, escalate_on_length)
        correct = kept = large_tokens = 0
        for o in outcomes:
            escalate, _ = policy.should_escalate(
                SmallOutcome(o.small_token_ids, o.small_logprobs, o.small_finish)
            )
            if escalate:
                correct += o.large_correct
                large_tokens += o.large_tokens
            else:
                correct += o.small_correct
                kept += 1
        n = max(len(outcomes), 1)
        rows.append(
            {
                "threshold": round(threshold, 3) + 0.0,  # + 0.0: no "-0.00" in tables
                "accuracy": correct / n,
                "small_share": kept / n,
                "large_tokens": large_tokens,
                "large_token_cut": 1 - large_tokens / all_large_tokens,
            }
        )
    return rows


def recommend(
    rows: Sequence[dict[str, float]],
    large_accuracy: float,
    accuracy_ratio: float = 0.95,
    min_small_share: float = 0.5,
) -> dict[str, Any]:
    """The threshold that keeps most on small while accuracy stays >= ratio x all-large.

    When none reaches the accuracy ratio, the most accurate threshold (ties: most on small),
    flagged ``meets_accuracy: false``.
    """
    floor = accuracy_ratio * large_accuracy
    ok = [r for r in rows if r["accuracy"] >= floor - 1e-12]
    if ok:
        best = max(ok, key=lambda r: (r["small_share"], r["accuracy"]))
    else:
        best = max(rows, key=lambda r: (r["accuracy"], r["small_share"]))
    return {
        **best,
        "meets_accuracy": bool(ok),
        "meets_small_share": best["small_share"] >= min_small_share,
        "accuracy_vs_large": best["accuracy"] / large_accuracy if large_accuracy else float("nan"),
    }


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """P(a random positive scores above a random negative), ties half: 0.5 = no signal."""
    if not positives or not negatives:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def cascade_diagnostics(answers: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Why a threshold does or does not work: signal quality and the best any judge could do.

    - ``logprob_auc``: how well the small answer's mean logprob separates its right answers
      from its wrong ones, among answers that ended on their own (cut-off answers always
      escalate).
    - ``oracle_small_share``: share a perfect judge keeps on small at no accuracy loss
      (small right, or both wrong); no threshold can beat it.
    """
    stopped = [a for a in answers if a["small_finish"] != "length" and a["small_mean_logprob"]]
    right = [a["small_mean_logprob"] for a in stopped if a["small_correct"]]
    wrong = [a["small_mean_logprob"] for a in stopped if not a["small_correct"]]
    n = max(len(answers), 1)
    keep = [a for a in answers if a["small_correct"] or not a["large_correct"]]
    return {
        "logprob_auc": auc(right, wrong),
        "small_cut_off_share": sum(a["small_finish"] == "length" for a in answers) / n,
        "oracle_small_share": len(keep) / n,
        "oracle_accuracy": sum(a["small_correct"] or a["large_correct"] for a in answers) / n,
    }
