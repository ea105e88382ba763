"""Length-aware batching: how collected requests become forward passes.

Two pure pieces and one small piece of machinery, none of which import Ray:

- ``BatchLimits`` + ``batch_weight``: the weighted size that ``@serve.batch`` uses
  (``batch_size_fn``), so that one collected batch respects both an item cap and a token cap.
- Splitters: given the token lengths of the items of a step, say which items share a forward
  pass. Every pass pads to its longest item, so sorting by length and cutting at the right
  places keeps padding small while keeping passes large.
- ``LengthAwareExecutor``: owns the model. Batches handed over by ``@serve.batch`` (or by
  direct calls) queue here; whenever the model is free, everything waiting is merged, sorted
  and split, and the most urgent of those passes runs. After every pass the plan is made
  again with whatever arrived meanwhile, so a short request never waits behind the rest of a
  long one's passes, and new arrivals still merge into full passes under load.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from carpool.admission import deadline_exceeded

logger = logging.getLogger(__name__)

P = TypeVar("P")  # an item's payload (token ids, a pair, ...)
R = TypeVar("R")  # an item's result


# --- limits and the weighted size for @serve.batch -----------------------------------


@dataclass
class BatchLimits:
    """Current caps, shared by reference so ``reconfigure()`` takes effect on queued jobs."""

    max_batch_size: int  # items (texts, query-document pairs) per collected batch
    max_batch_tokens: int  # real tokens per collected batch, and padded tokens per forward pass

    @property
    def serve_capacity(self) -> int:
        """The ``max_batch_size`` to give ``@serve.batch`` when sizes come from ``batch_weight``."""
        return self.max_batch_size * self.max_batch_tokens


def batch_weight(jobs: Sequence[Job[Any, Any]]) -> int:
    """Weighted size of a collected batch for ``@serve.batch(batch_size_fn=...)``.

    ``max(tokens * N, items * T)`` is at most ``N * T`` exactly when tokens <= T and
    items <= N, so one Serve cap enforces both limits. A single job over the caps is
    clamped to the capacity: it runs alone and the splitter cuts it into passes, instead of
    Serve failing it with "Size of item is greater than max_batch_size".
    """
    if not jobs:
        return 0
    limits = jobs[0].limits
    tokens = sum(job.total_tokens for job in jobs)
    items = sum(len(job.lengths) for job in jobs)
    weight = max(tokens * limits.max_batch_size, items * limits.max_batch_tokens)
    if len(jobs) == 1:
        return min(weight, limits.serve_capacity)
    return weight


# --- splitters ------------------------------------------------------------------------


class BatchSplitter(Protocol):
    """Groups items into forward passes; returns lists of indices into ``lengths``."""

    name: str

    def split(self, lengths: Sequence[int]) -> list[list[int]]: ...


@dataclass
class PadToLongestSplitter:
    """What a plain ``@serve.batch`` app does: arrival order, chunks of ``max_items``.

    Kept as the baseline the benchmarks compare against.
    """

    max_items: int
    name: str = "pad_to_longest"

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        order = list(range(len(lengths)))
        return [order[i : i + self.max_items] for i in range(0, len(order), self.max_items)]


@dataclass
class GreedyTokenBudgetSplitter:
    """Sort by length, then fill each pass until its padded size would pass the budget."""

    max_tokens: int
    max_items: int
    name: str = "greedy"

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        passes: list[list[int]] = []
        current: list[int] = []
        for idx in order:
            longest = lengths[idx]  # sorted ascending: the newcomer is the longest
            if current and (
                (len(current) + 1) * longest > self.max_tokens or len(current) >= self.max_items
            ):
                passes.append(current)
                current = []
            current.append(idx)
        if current:
            passes.append(current)
        return passes


@dataclass
class OptimalSplitter:
    """Sort by length, then cut where the estimated total cost is lowest.

    Cost of a pass = ``pass_overhead_tokens + items * longest`` (padded tokens plus a fixed
    per-pass overhead expressed in tokens). Under a sorted order the best contiguous cut is
    found exactly by dynamic programming in O(n * max_items). Without the overhead term the
    optimum would be one item per pass (zero padding); the overhead is what makes batching pay.
    """

    max_tokens: int
    max_items: int
    pass_overhead_tokens: int = 64
    name: str = "optimal"

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        n = len(order)
        if n == 0:
            return []
        sorted_lengths = [lengths[i] for i in order]
        best = [0.0] + [math.inf] * n  # best[j]: cost of the first j sorted items
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            longest = sorted_lengths[j - 1]
            # Pass = sorted items i..j-1; its padded size is (j - i) * longest.
            max_len_items = max(1, self.max_tokens // max(longest, 1))
            lowest_i = max(0, j - min(self.max_items, max_len_items))
            for i in range(j - 1, lowest_i - 1, -1):
                cost = best[i] + self.pass_overhead_tokens + (j - i) * longest
                if cost < best[j]:
                    best[j] = cost
                    cut[j] = i
        passes: list[list[int]] = []
        j = n
        while j > 0:
            i = cut[j]
            passes.append(order[i:j])
            j = i
        passes.reverse()
        return passes


SPLITTERS = ("optimal", "greedy", "pad_to_longest")


def make_splitter(
    name: str, max_tokens: int, max_items: int, pass_overhead_tokens: int = 64
) -> BatchSplitter:
    if name == "optimal":
        return OptimalSplitter(max_tokens, max_items, pass_overhead_tokens)
    if name == "greedy":
        return GreedyTokenBudgetSplitter(max_tokens, max_items)
    if name == "pad_to_longest":
        return PadToLongestSplitter(max_items)
    raise ValueError(f"unknown split_policy {name!r}; choose one of {SPLITTERS}")


def padded_tokens(lengths: Sequence[int], passes: Sequence[Sequence[int]]) -> int:
    return sum(len(p) * max(lengths[i] for i in p) for p in passes if p)


# --- jobs and the executor -------------------------------------------------------------


@dataclass(eq=False)
class Job(Generic[P, R]):
    """One request's items on their way through the executor."""

    payloads: list[P]
    lengths: list[int]
    limits: BatchLimits
    created: float = field(default_factory=time.monotonic)
    results: list[R | None] = field(default_factory=list)
    error: BaseException | None = None
    remaining: int = 0
    future: asyncio.Future[list[R]] | None = None
    deadline: float | None = None  # time.monotonic(); past it, items are dropped uncomputed
    rank: int = 0  # priority tier: lower is taken first (0 interactive, 1 batch)
    counted_drop: bool = False
    controls: Any = None  # the request's RequestControls, for admission
    unplanned: list[int] = field(default_factory=list)  # items not yet given to a pass

    def __post_init__(self) -> None:
        if len(self.payloads) != len(self.lengths):
            raise ValueError("a job needs one length per payload")
        self.results = [None] * len(self.payloads)
        self.remaining = len(self.payloads)
        self.unplanned = list(range(len(self.payloads)))

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class PassRecord:
    """What one forward pass did; handed to listeners (metrics, stats)."""

    items: int
    real_tokens: int
    padded_tokens: int
    forward_ms: float
    queue_wait_ms: list[float]
    step_items: int  # items in the plan this pass was chosen from


class PassListener(Protocol):
    def on_pass(self, record: PassRecord) -> None: ...

    def on_drop(self, reason: str, items: int) -> None:
        """Items that left without a forward pass: 'cancelled' or 'deadline'."""


@dataclass
class BatchStats:
    """Cumulative per-replica figures, cheap enough to keep always on."""

    passes: int = 0
    steps: int = 0
    items: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    forward_ms: float = 0.0
    queue_wait_ms: float = 0.0
    max_pass_items: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def on_drop(self, reason: str, items: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + items

    def on_pass(self, record: PassRecord) -> None:
        self.passes += 1
        self.items += record.items
        self.real_tokens += record.real_tokens
        self.padded_tokens += record.padded_tokens
        self.forward_ms += record.forward_ms
        self.queue_wait_ms += sum(record.queue_wait_ms)
        self.max_pass_items = max(self.max_pass_items, record.items)

    def snapshot(self) -> dict[str, float]:
        return {
            "forward_passes": self.passes,
            "steps": self.steps,
            "items": self.items,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "mean_items_per_pass": self.items / self.passes if self.passes else 0.0,
            "mean_items_per_step": self.items / self.steps if self.steps else 0.0,
            "max_items_per_pass": self.max_pass_items,
            "padding_waste_ratio": (
                1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
            ),
            "mean_forward_ms": self.forward_ms / self.passes if self.passes else 0.0,
            "mean_queue_wait_ms": self.queue_wait_ms / self.items if self.items else 0.0,
            "cancelled_items": self.dropped.get("cancelled", 0),
            "deadline_dropped_items": self.dropped.get("deadline", 0),
        }


class LengthAwareExecutor(Generic[P, R]):
    """Runs jobs' items through ``forward`` in length-sorted, budgeted passes.

    ``forward(payloads) -> results`` is blocking (a model call) and runs in a worker thread so
    the replica's event loop keeps collecting requests meanwhile. If a pass fails, its items
    are retried one by one so only the item that really fails takes its job down.

    Which pass runs next: every waiting item is planned into passes by the splitter, and the
    pass holding the most urgent item runs. Urgency is the priority tier, then the earlier of
    "arrival + the job's own cost on an idle model" (``estimate_ms``) and "the client's
    deadline - that cost". So a job is served about as soon as it would be alone, a short job
    does not wait behind a long one's later passes, and a long one overtakes newer short ones
    once it has waited its own cost (no starvation). Before ``estimate_ms`` knows the model,
    every cost reads 0 and the order is first come, first served.
    """

    def __init__(
        self,
        forward: Callable[[list[P]], list[R]],
        splitter: BatchSplitter,
        max_step_items: int = 1024,
        listeners: Sequence[PassListener] = (),
        estimate_ms: Callable[[int, int], float] | None = None,
    ) -> None:
        self._forward = forward
        self.splitter = splitter
        self.max_step_items = max_step_items
        # (items, tokens) -> ms one job takes on an idle model; the server wires its cost model.
        self.estimate_ms: Callable[[int, int], float] = estimate_ms or (lambda items, tokens: 0.0)
        self.stats = BatchStats()
        self.listeners: list[PassListener] = [self.stats, *listeners]
        self._waiting: list[Job[P, R]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None

    async def run(self, jobs: Sequence[Job[P, R]]) -> list[list[R] | BaseException]:
        """Queues ``jobs`` and returns, per job, its results or the exception it failed with."""
        loop = asyncio.get_running_loop()
        for job in jobs:
            job.future = loop.create_future()
            if job.remaining == 0:
                job.future.set_result([])
        self._waiting.extend(j for j in jobs if j.remaining)
        self._ensure_worker()
        assert self._wakeup is not None
        self._wakeup.set()
        outcomes: list[list[R] | BaseException] = []
        try:
            for job in jobs:
                assert job.future is not None
                # asyncio.wait does not raise when the job's own future was cancelled (its
                # client left): only that job is dropped, the rest of the batch still runs.
                await asyncio.wait([job.future])
                if job.future.cancelled():
                    outcomes.append(asyncio.CancelledError())
                elif job.future.exception() is not None:
                    outcomes.append(job.future.exception())  # type: ignore[arg-type]
                else:
                    outcomes.append(job.future.result())
        except asyncio.CancelledError:
            # This caller was cancelled: its jobs' items are skipped before they are computed.
            for job in jobs:
                if job.future is not None:
                    job.future.cancel()
            raise
        return outcomes

    async def run_one(self, job: Job[P, R]) -> list[R]:
        outcome = (await self.run([job]))[0]
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def worker_failure(self) -> str | None:
        """Why the worker task ended, or None while it runs (or before the first job)."""
        worker = self._worker
        if worker is None or not worker.done():
            return None
        return "cancelled" if worker.cancelled() else repr(worker.exception())

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._loop())

    def report_drop(self, reason: str, items: int) -> None:
        """Tells listeners (stats, metrics) about items that will never be computed."""
        for listener in self.listeners:
            on_drop = getattr(listener, "on_drop", None)
            if on_drop is not None:
                on_drop(reason, items)

    def _gone(self, job: Job[P, R], now: float) -> bool:
        """True (and the job is failed or forgotten) when its items must not be computed."""
        assert job.future is not None
        if job.future.done():  # cancelled by its caller, or already failed
            if job.future.cancelled() and not job.counted_drop:
                job.counted_drop = True
                self.report_drop("cancelled", job.remaining)
            return True
        if job.deadline is not None and now >= job.deadline:
            self.report_drop("deadline", job.remaining)
            job.future.set_exception(deadline_exceeded("model"))
            return True
        return False

    def urgency(self, job: Job[P, R]) -> tuple[int, float]:
        """Sort key of a job: tier first, then when it should start (monotonic seconds)."""
        own_s = self.estimate_ms(len(job.lengths), job.total_tokens) / 1000
        due = job.created + own_s
        if job.deadline is not None:
            due = min(due, job.deadline - own_s)
        return job.rank, due

    def _plan(self) -> tuple[list[tuple[Job[P, R], int]], int]:
        """The next pass, as (job, item) pairs, and how many items it was chosen from.

        Jobs whose client left or whose deadline passed leave here, before any compute is
        spent on them. The most urgent jobs, up to ``max_step_items`` items (always at least
        one job), are split into passes; the pass with the most urgent item is returned.
        """
        now = time.monotonic()
        live: list[tuple[tuple[int, float], Job[P, R]]] = []
        for job in self._waiting:
            if not self._gone(job, now):
                live.append((self.urgency(job), job))
        live.sort(key=lambda pair: pair[0])  # stable: arrival order among equals
        refs: list[tuple[Job[P, R], int]] = []
        keys: list[tuple[int, float]] = []
        for key, job in live:
            if refs and len(refs) + len(job.unplanned) > self.max_step_items:
                break
            refs.extend((job, i) for i in job.unplanned)
            keys.extend(key for _ in job.unplanned)
        if not refs:
            self._waiting = []
            return [], 0
        groups = self.splitter.split([job.lengths[i] for job, i in refs])
        chosen = min((g for g in groups if g), key=lambda g: min(keys[k] for k in g))
        taken = [refs[k] for k in chosen]
        for job, i in taken:
            job.unplanned.remove(i)
        self._waiting = [job for _, job in live if job.unplanned]
        return taken, len(refs)

    async def _loop(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            taken, planned = self._plan()
            if taken:
                self.stats.steps += 1
                await self._run_pass(taken, planned)

    async def _run_pass(self, refs: list[tuple[Job[P, R], int]], planned: int) -> None:
        lengths = [job.lengths[i] for job, i in refs]
        started = time.monotonic()
        waits = [(started - job.created) * 1000 for job, _ in refs]
        payloads = [job.payloads[i] for job, i in refs]
        try:
            results = await asyncio.to_thread(self._forward, payloads)
            if len(results) != len(payloads):
                raise RuntimeError(
                    f"forward returned {len(results)} results for {len(payloads)} inputs"
                )
            outcome: list[R | BaseException] = list(results)
        except Exception:
            outcome = await self._one_by_one(payloads)
        forward_ms = (time.monotonic() - started) * 1000
        record = PassRecord(
            items=len(refs),
            real_tokens=sum(lengths),
            padded_tokens=len(refs) * max(lengths),
            forward_ms=forward_ms,
            queue_wait_ms=waits,
            step_items=planned,
        )
        for listener in self.listeners:
            try:
                listener.on_pass(record)
            except Exception:
                # A broken metrics hook must not end the worker: every request it had taken
                # would then wait out its deadline unanswered.
                logger.exception("a pass listener failed; the pass's results go out anyway")
        for (job, i), result in zip(refs, outcome, strict=True):
            self._deliver(job, i, result)

    async def _one_by_one(self, payloads: list[P]) -> list[R | BaseException]:
        out: list[R | BaseException] = []
        for payload in payloads:
            try:
                out.append((await asyncio.to_thread(self._forward, [payload]))[0])
            except Exception as exc:
                out.append(exc)
        return out

    @staticmethod
    def _deliver(job: Job[P, R], index: int, result: R | BaseException) -> None:
        assert job.future is not None
        if job.future.done():
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
            return
        job.results[index] = result
        job.remaining -= 1
        if job.remaining == 0:
            job.future.set_result(list(job.results))  # type: ignore[arg-type]
