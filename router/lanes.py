"""Batch lanes: requests grouped by predicted output length, so short ones stop waiting
behind long ones.

A lane maps to a target: its own generator deployment (``target``), or a priority inside a
shared one. ``ShortestFirstQueue`` is the shared-deployment form: shortest predicted first,
with aging so that a long request's priority rises the longer it waits and it never starves.
Its key is ``carpool.aging.aging_key``, the one vLLM's priority scheduler is given too.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from carpool.aging import DEFAULT_AGING_TOKENS_PER_S, DEFAULT_TIER_PENALTY_TOKENS, aging_key

T = TypeVar("T")

Tier = Literal["interactive", "batch"]


@dataclass(frozen=True)
class Lane:
    """A lane takes requests predicted at most ``max_predicted_tokens`` (None: any length)."""

    name: str
    max_predicted_tokens: float | None
    target: str | None = None  # a generator deployment of its own; None = the shared one
    priority: int = 0  # lower runs first inside a shared deployment


class LanePolicy:
    """Assigns a lane from the predicted length; the last lane takes everything longer."""

    def __init__(self, lanes: list[Lane]) -> None:
        if not lanes:
            raise ValueError("at least one lane is needed")
        bounded = [lane.max_predicted_tokens for lane in lanes[:-1]]
        if any(b is None for b in bounded):
            raise ValueError("only the last lane may have max_predicted_tokens: null")
        if bounded != sorted(bounded):  # type: ignore[type-var]
            raise ValueError(
                f"lanes must be ordered by max_predicted_tokens, got {bounded}; sort them"
            )
        if len({lane.name for lane in lanes}) != len(lanes):
            raise ValueError("lane names must be unique")
        self.lanes = lanes

    def assign(self, predicted_tokens: float) -> Lane:
        for lane in self.lanes[:-1]:
            assert lane.max_predicted_tokens is not None
            if predicted_tokens <= lane.max_predicted_tokens:
                return lane
        return self.lanes[-1]


def single_lane() -> LanePolicy:
    """One FIFO lane: what serving without lanes looks like (the benchmarks' baseline)."""
    return LanePolicy([Lane("fifo", None)])


@dataclass(order=True)
class _Entry(Generic[T]):
    key: float
    seq: int
    item: T = field(compare=False)


class ShortestFirstQueue(Generic[T]):
    """Shortest predicted first, with aging, and interactive ahead of batch.

    Keyed by ``carpool.aging.aging_key`` at push time: every waiting item ages at the same
    rate, so a heap keyed once stays correct as time passes. A request that waited
    ``predicted / aging_tokens_per_s`` seconds is ahead of any newcomer.
    """

    def __init__(
        self,
        aging_tokens_per_s: float = DEFAULT_AGING_TOKENS_PER_S,
        batch_tier_penalty: float = DEFAULT_TIER_PENALTY_TOKENS,
    ) -> None:
        if aging_tokens_per_s <= 0:
            raise ValueError(
                f"aging_tokens_per_s must be > 0 or long requests could starve; got "
                f"{aging_tokens_per_s}"
            )
        self.aging = aging_tokens_per_s
        self.batch_penalty = batch_tier_penalty
        self._heap: list[_Entry[T]] = []
        self._seq = itertools.count()

    def push(
        self, item: T, predicted_tokens: float, now: float, tier: Tier = "interactive"
    ) -> None:
        rank = 1 if tier == "batch" else 0
        key = aging_key(predicted_tokens, rank, now, self.aging, self.batch_penalty)
        heapq.heappush(self._heap, _Entry(key, next(self._seq), item))

    def pop(self) -> T:
        return heapq.heappop(self._heap).item

    def __len__(self) -> int:
        return len(self._heap)
