"""Overload refusals across replicas: remembered per replica, retried where there is room.

A model replica refuses work (503 ``overloaded``) from its own admission, before it tokenizes
or generates anything, so a refused request can go to another replica with no work done twice.
``RequestError`` carries which replica refused (``replica``, ``deployment``; stamped where it
is raised inside a Serve replica), so a caller can tell "this replica is full" from "this stage
is full":

- ``RefusalMemory`` answers locally (no hop, no model CPU) only while every live replica of the
  refusing deployment has refused moments ago; one full replica among several never blacks
  out the stage.
- ``call_refusable`` retries a refused call while the memory says some live replica has not
  refused, until every live replica refused it (or ``max_tries``). Serve's router sends each
  try to the less loaded of two replicas by its cached queue lengths, so a retry usually
  lands on one with room, and sometimes on the one that just refused.
- A refusal by count (a generator's waiting line at its bound) says how long its replica
  stays full (``RequestError.full_for_s``, about one slot's time), and is remembered no
  longer than that: two replicas that were each full a moment apart are not a full stage.

How many replicas are live comes from a ``LiveCount`` (``carpool.topology`` polls Serve's
controller); unknown counts as one, which is the single-replica behaviour. No Ray imports here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from carpool.admission import PRIORITIES, Priority
from carpool.errors import RequestError, find_request_error

T = TypeVar("T")

# Live replicas of a deployment ("app/name"); None while unknown.
LiveCount = Callable[[str], "int | None"]

# A refusal stamped with no replica (Serve's own backpressure at the caller's handle, a
# refusal raised outside Serve) stands for the whole stage.
WHOLE_STAGE = "*"


def no_live_counts(_: str) -> int | None:
    return None


def is_overload(error: RequestError | None) -> bool:
    return error is not None and error.status_code == 503 and error.code == "overloaded"


class RefusalMemory:
    """An ingress's memory of a stage's recent overload refusals, per refusing replica.

    Under overload most requests are refused, and one that travels to the model replica to be
    refused costs the hop (Serve's machinery in both processes) on the cores the model
    computes on. A replica that refuses for queued work (``max_queue_delay_ms``) is certainly
    still full for a moment; one that refuses by count says for how long (``full_for_s``),
    and is remembered no longer. The ingress answers requests of that tier itself only while
    every live replica of the deployment has refused within its window. The window is short
    next to any queue bound, so the model never runs dry; an interactive refusal covers the
    batch tier too (its bounds are lower).
    """

    # Longer than the ingress holds a refusal (1 s), so the requests that arrive meanwhile
    # are answered here too; short next to any queue bound worth refusing at (seconds).
    def __init__(self, window_s: float = 1.25, clock: Any = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        # tier -> deployment -> replica -> (refuse locally until, backend's retry time)
        self._refused: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}

    def record(self, error: RequestError, priority: Priority) -> None:
        if not is_overload(error):
            return
        now = self._clock()
        held = self.window_s
        if error.full_for_s is not None:  # a refusal by count clears in a slot's time
            held = min(held, error.full_for_s)
        until, retry_at = now + held, now + (error.retry_after_s or self.window_s)
        deployment = error.deployment or WHOLE_STAGE
        replica = error.replica or WHOLE_STAGE
        for tier in PRIORITIES if priority == "interactive" else (priority,):
            replicas = self._refused.setdefault(tier, {}).setdefault(deployment, {})
            old_until, old_retry = replicas.get(replica, (0.0, 0.0))
            replicas[replica] = (max(old_until, until), max(old_retry, retry_at))

    def _active(self, priority: Priority, deployment: str) -> dict[str, tuple[float, float]]:
        now = self._clock()
        replicas = self._refused.get(priority, {}).get(deployment, {})
        for replica in [r for r, (until, _) in replicas.items() if until <= now]:
            del replicas[replica]
        return replicas

    def has_room(
        self, deployment: str | None, priority: Priority, live: LiveCount = no_live_counts
    ) -> bool:
        """Whether some live replica of ``deployment`` has not refused within the window."""
        deployment = deployment or WHOLE_STAGE
        return not self._full(self._active(priority, deployment), deployment, live)

    @staticmethod
    def _full(active: dict[str, tuple[float, float]], deployment: str, live: LiveCount) -> bool:
        if deployment == WHOLE_STAGE:
            return bool(active)
        return len(active) >= max(live(deployment) or 1, 1)

    def refusal(
        self, stage: str, priority: Priority, live: LiveCount = no_live_counts
    ) -> RequestError | None:
        """A local 503 while every live replica of a deployment behind ``stage`` is full."""
        now = self._clock()
        for deployment in list(self._refused.get(priority, {})):
            # One reading of what is active: a refusal expiring between two readings would
            # leave "full" decided over entries that are gone (a count refusal lasts ms).
            active = self._active(priority, deployment)
            if not self._full(active, deployment, live):
                continue
            retry_at = min(r for _, r in active.values())
            return RequestError(
                503,
                f"the {stage} stage is overloaded (every replica refused {priority} requests "
                "moments ago: their queues are full); retry after the Retry-After delay",
                code="overloaded",
                retry_after_s=max(retry_at - now, 0.5),
            )
        return None


async def call_refusable(
    make_call: Callable[[], Awaitable[T]],
    memory: RefusalMemory,
    priority: Priority,
    live: LiveCount = no_live_counts,
    max_tries: int = 8,
) -> T:
    """Awaits ``make_call()``, trying again while a replica refused and another has room.

    Only overload refusals are retried: they are decided by the replica's admission before any
    work starts, so a generation never runs twice. Anything else, and the last refusal, is
    raised as it came. Every refusal is recorded in ``memory``.
    """
    tries = 0
    refused_this_call: set[str] = set()
    while True:
        tries += 1
        try:
            return await make_call()
        except Exception as exc:
            found = find_request_error(exc)
            if not is_overload(found):
                raise
            assert found is not None
            memory.record(found, priority)
            if found.replica is None or tries >= max_tries:
                raise
            if not memory.has_room(found.deployment, priority, live):
                raise
            # Serve may send a retry to the replica that just refused (its queue lengths are
            # cached), so the call gives up once every live replica refused it, not after
            # one try per replica.
            refused_this_call.add(found.replica)
            if len(refused_this_call) >= max(live(found.deployment or WHOLE_STAGE) or 1, 1):
                raise
