"""The report's maths: medians over rounds with their spread, and paired ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def median_spread(values: Sequence[float]) -> dict[str, float]:
    """Median over rounds and the spread (min, max); NaN-free input expected."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def ratio(a: float, b: float) -> float:
    """a / b; NaN when b is zero or either is unknown (never a division error in a report)."""
    if b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def paired_ratios(rounds: Sequence[dict[str, float]], num: str, den: str) -> dict[str, float]:
    """``num/den`` per round (the pairing: both measured in the same round), then summarised."""
    per_round = [ratio(r[num], r[den]) for r in rounds if num in r and den in r]
    return median_spread(per_round)


def carpool_pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """Which systems a summary divides: each carpool system (shipped or a layout) by each
    peer, and a layout by shipped carpool when it ran."""
    return [
        (a, b)
        for a in names
        if a.startswith("carpool")
        for b in names
        if b != a and (not b.startswith("carpool") or a == "carpool")
    ]
