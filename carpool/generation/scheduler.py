"""The step scheduler: which sequences decode, which prompt chunks prefill, who is admitted.

Pure policy over plain objects (no torch, no Ray), unit-tested with hand-made sequences.
Each engine step runs one decode pass over every sequence that has its prompt in the KV
cache, and one prefill pass over prompt chunks. The scheduler keeps two bounds:

- ``max_num_seqs``: sequences holding a KV slot (decoding or prefilling) at once;
- ``max_step_tokens``: tokens computed per step, decode tokens (one per decoding
  sequence) plus the prefill pass's padded tokens (chunks x longest chunk).

Long prompts are prefilled in chunks over several steps, so a long arrival never stalls the
running streams for more than one bounded pass. Prefill chunks go to a prefix of the
prefilling sequences in slot order (the runner needs a contiguous run of rows), then to
waiting requests in queue order, which a ``RequestQueue`` policy defines.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Schedulable(Protocol):
    """What the scheduler reads from a sequence."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed(self) -> int: ...


S = TypeVar("S", bound=Schedulable)


class RequestQueue(ABC, Generic[S]):
    """Order in which waiting requests are admitted."""

    @abstractmethod
    def add(self, seq: S) -> None:
        """Enqueue an arrival."""

    @abstractmethod
    def peek(self) -> S:
        """The next request to admit (the queue is not empty)."""

    @abstractmethod
    def pop(self) -> S:
        """Remove and return the next request to admit."""

    @abstractmethod
    def remove(self, seq: S) -> bool:
        """Drop a request that left before admission; False if it was not queued."""

    @abstractmethod
    def __len__(self) -> int:
        """Requests waiting."""

    @abstractmethod
    def __iter__(self) -> Iterator[S]:
        """Waiting requests in admission order."""


class FCFSQueue(RequestQueue[S]):
    """First come, first served."""

    def __init__(self) -> None:
        self._q: deque[S] = deque()

    def add(self, seq: S) -> None:
        self._q.append(seq)

    def peek(self) -> S:
        return self._q[0]

    def pop(self) -> S:
        return self._q.popleft()

    def remove(self, seq: S) -> bool:
        try:
            self._q.remove(seq)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._q))


class PriorityQueue(RequestQueue[S]):
    """Lower ``rank`` first (interactive 0 before batch 1), first come first served within one.

    A sequence without a ``rank`` attribute counts as interactive, so with one tier this is
    exactly FCFS.
    """

    def __init__(self) -> None:
        self._tiers: dict[int, deque[S]] = {}

    def _first(self) -> deque[S]:
        for rank in sorted(self._tiers):
            if self._tiers[rank]:
                return self._tiers[rank]
        raise IndexError("the queue is empty")

    def add(self, seq: S) -> None:
        self._tiers.setdefault(getattr(seq, "rank", 0), deque()).append(seq)

    def peek(self) -> S:
        return self._first()[0]

    def pop(self) -> S:
        return self._first().popleft()

    def remove(self, seq: S) -> bool:
        tier = self._tiers.get(getattr(seq, "rank", 0))
        if tier is None:
            return False
        try:
            tier.remove(seq)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return sum(len(t) for t in self._tiers.values())

    def __iter__(self) -> Iterator[S]:
        return iter([seq for rank in sorted(self._tiers) for seq in self._tiers[rank]])


QUEUE_POLICIES = ("fcfs", "priority")


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown queue policy {policy!r}; choose one of {QUEUE_POLICIES}")


@dataclass
class SchedulerLimits:
    """The bounds a step keeps; changed in place by ``reconfigure``."""

    max_num_seqs: int
    max_step_tokens: int

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_step_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_step_tokens ({self.max_step_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running sequence decodes one token per step"
            )


@dataclass
class StepPlan(Generic[S]):
    """One step: decode these, prefill these chunks (slot order), admit these first."""

    decode: list[S] = field(default_factory=list)
    prefill: list[tuple[S, int]] = field(default_factory=list)
    admitted: list[S] = field(default_factory=list)

    @property
    def prefill_padded_tokens(self) -> int:
        return len(self.prefill) * max((n for _, n in self.prefill), default=0)

    @property
    def tokens(self) -> int:
        return len(self.decode) + self.prefill_padded_tokens

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler(Generic[S]):
    """Plans each engine step within ``SchedulerLimits``."""

    def __init__(self, limits: SchedulerLimits, policy: str = "fcfs") -> None:
        self.limits = limits
        self.waiting: RequestQueue[S] = create_request_queue(policy)

    def add(self, seq: S) -> None:
        self.waiting.add(seq)

    def remove(self, seq: S) -> bool:
        return self.waiting.remove(seq)

    def schedule(self, decoding: Sequence[S], prefilling: Sequence[S]) -> StepPlan[S]:
        """Plans one step given the decoding and prefilling sequences (the latter in slot order)."""
        plan: StepPlan[S] = StepPlan(decode=list(decoding))
        budget = self.limits.max_step_tokens - len(decoding)
        longest = 0

        def fit(remaining: int) -> int:
            # The largest chunk that keeps (chunks + 1) x longest chunk within the budget.
            rows = len(plan.prefill) + 1
            if rows * max(longest, 1) > budget:
                return 0
            return min(remaining, budget // rows)

        for seq in prefilling:
            chunk = fit(seq.num_prompt_tokens - seq.num_computed)
            if chunk <= 0:
                return plan  # later rows wait: prefill rows must stay a contiguous prefix
            plan.prefill.append((seq, chunk))
            longest = max(longest, chunk)
        running = len(decoding) + len(prefilling)
        while len(self.waiting) and running < self.limits.max_num_seqs:
            seq = self.waiting.peek()
            chunk = fit(seq.num_prompt_tokens - seq.num_computed)
            if chunk <= 0:
                break
            self.waiting.pop()
            plan.prefill.append((seq, chunk))
            plan.admitted.append(seq)
            longest = max(longest, chunk)
            running += 1
        return plan
