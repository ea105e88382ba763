"""The router's admission gate: a bounded number of requests in flight to one model.

``Admission`` is the bookkeeping, synchronous and clock-free (the caller says what time it
is): the in-flight limit, who waits and in what order (``ShortestFirstQueue``: shortest
predicted first with aging, or arrival order when lanes are off), the per-lane bound past
which a request is refused with 503, and the target's decode speed that the overflow estimate
reads. A waiting request is a ``grant`` callback, called once when a slot is its own; it
answers False when its caller has already gone (the slot then goes to the next one).

Two drivers share it, so admission exists once: ``Gate`` (asyncio: a waiter's grant resolves
its future; deadlines and cancellation) in the serving router, and the twin's event loop
(``carpool_twin.sim``: a grant schedules the submission as an event).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from carpool.admission import deadline_exceeded
from carpool.errors import RequestError
from router.lanes import ShortestFirstQueue, Tier

# A target's decode speed before any completion is seen: a modest CPU prior.
PRIOR_TOKENS_PER_S = 20.0
# Weight of the newest completion in the decode-speed average.
SPEED_WEIGHT = 0.2


@dataclass(eq=False)
class Waiting:
    """One request waiting for a slot; ``gone`` once its caller gave up (skipped when met)."""

    grant: Callable[[], bool]  # hands the slot over; False: the caller is gone, skip it
    predicted: float
    lane: str
    gone: bool = False


class Admission:
    """Bounded in-flight requests to one target, admitted by lane priority."""

    def __init__(
        self,
        limit: int,
        queue: ShortestFirstQueue[Waiting],
        fifo: bool = False,
        max_queued_per_lane: int = 256,
    ) -> None:
        self.limit = limit
        self.queue = queue
        # One FIFO lane (lanes disabled): admit in arrival order, not shortest-predicted first.
        self.fifo = fifo
        self.max_queued_per_lane = max_queued_per_lane
        self.in_flight = 0
        self.queued_tokens = 0.0  # predicted tokens admitted or waiting: the backlog
        self.tokens_per_s = PRIOR_TOKENS_PER_S  # learned from completions
        self.lane_waiting: dict[str, int] = {}

    def take(
        self,
        predicted: float,
        tier: Tier,
        lane: str,
        now: float,
        grant: Callable[[], bool],
    ) -> Waiting | None:
        """A request asks for a slot at ``now`` (any monotonic clock): None when it has one
        at once; else it waits, and ``grant`` is called when it gets one. A lane already
        holding its bound of waiting requests refuses with 503 + Retry-After."""
        if self.in_flight < self.limit and not len(self.queue):
            self.queued_tokens += predicted
            self.in_flight += 1
            return None
        waiting = self.lane_waiting.get(lane, 0)
        bound = self.max_queued_per_lane if tier == "interactive" else self.max_queued_per_lane // 2
        if waiting >= max(bound, 1):
            raise RequestError(
                503,
                f"the router's {lane or 'only'} lane already holds {waiting} waiting requests "
                f"(limit {bound} for {tier} requests); retry after the Retry-After delay",
                code="overloaded",
                retry_after_s=max(1.0, self.queued_tokens / max(self.tokens_per_s, 1e-3)),
            )
        self.queued_tokens += predicted
        self.lane_waiting[lane] = waiting + 1
        entry = Waiting(grant, predicted, lane)
        self.queue.push(entry, 0.0 if self.fifo else predicted, now, tier)
        return entry

    def withdraw(self, entry: Waiting) -> None:
        """A waiting request's caller gave up before its slot came."""
        entry.gone = True
        self.queued_tokens = max(0.0, self.queued_tokens - entry.predicted)
        self.lane_waiting[entry.lane] -= 1

    def leave(self, predicted: float, tokens: int = 0, elapsed_s: float = 0.0) -> None:
        """A request's call ended: its slot goes to the next waiting one. ``tokens`` it
        produced in ``elapsed_s`` update the target's decode speed (the overflow estimate)."""
        self.queued_tokens = max(0.0, self.queued_tokens - predicted)
        self.in_flight -= 1
        if tokens and elapsed_s > 0:
            speed = tokens / elapsed_s
            self.tokens_per_s = (1 - SPEED_WEIGHT) * self.tokens_per_s + SPEED_WEIGHT * speed
        self._admit_waiting()

    def resize(self, limit: int) -> None:
        """A new cap (the model's replicas changed); a larger one admits waiting requests."""
        self.limit = max(1, limit)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self.in_flight < self.limit and len(self.queue):
            entry = self.queue.pop()
            if entry.gone or not entry.grant():
                continue  # its caller left; it gives its lane place back itself (withdraw)
            self.in_flight += 1
            self.lane_waiting[entry.lane] -= 1


class Gate(Admission):
    """``Admission`` for coroutines: ``enter`` waits for a slot, or gives up at a deadline."""

    async def enter(
        self, predicted: float, tier: Tier, deadline: float | None = None, lane: str = ""
    ) -> None:
        """Waits for a slot; past ``deadline`` (time.time()) it gives up with 504."""
        if deadline is not None and deadline <= time.time():
            raise deadline_exceeded("router")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def grant() -> bool:
            if future.done():  # cancelled with its task: the slot goes to the next one
                return False
            future.set_result(None)
            return True

        entry = self.take(predicted, tier, lane, time.monotonic(), grant)
        if entry is None:
            return
        try:
            if deadline is None:
                await future
            else:
                # shield: a timeout must not cancel the future behind the grant's back. A
                # timeout scope, not wait_for: on CPython 3.11 wait_for returns normally when
                # the slot is granted just as the caller is cancelled (gh-86296), and the
                # cancelled request would then generate anyway.
                async with asyncio.timeout(deadline - time.time()):
                    await asyncio.shield(future)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled():
                self.leave(predicted)  # admitted just as the caller left: give the slot back
            else:
                future.cancel()  # a later grant declines it
                self.withdraw(entry)
            if isinstance(exc, asyncio.TimeoutError):
                raise deadline_exceeded("router") from None
            raise
