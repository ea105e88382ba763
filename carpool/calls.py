"""Calling another deployment: deadlines, cancellation, refusal retry, replica loss.

Every deployment-to-deployment call in carpool goes through here:

- ``await_or_cancel`` / ``open_stream``: a downstream call (a Serve ``DeploymentResponse``, or
  a stream and its first event) cancelled when its caller is, so a client that leaves frees
  every stage below.
- ``call_retrying``: THE retry loop, the only one in carpool: a replica's overload refusal
  tried on another replica with room, a call whose replica died before answering (or before
  a stream's first event) tried once elsewhere. The ingresses' ``call_idempotent`` and the
  router's generator clients (``router.deployment``) both run it.
- ``call_backend`` / ``call_idempotent`` / ``call_once``: an ingress's call to a stage within
  the request's deadline (``carpool.admission.current_controls``), overload refusals
  remembered and held, anything else a 503. ``call_idempotent`` retries (``call_retrying``);
  ``call_once`` does not, for a stage that retries its own calls below (the router behind
  ``auto``), so no refusal is retried by two nested loops.
- ``RefusalMemory``: overload refusals across replicas, remembered per replica (below).

Who does what for a generation, one owner each:

- ingress -> ``small`` / ``large``: ``call_idempotent`` refuses at the ingress, retries
  (``call_retrying``), holds the last refusal and maps errors.
- ingress -> the router (``auto``): ``call_once`` refuses at the ingress, holds and maps
  errors; it does not retry (a retry would re-run the router's whole decision).
- router -> ``small`` / ``large``: the router's generator client
  (``router.deployment._HandleClient``) retries (``call_retrying``).

A model replica refuses work (503 ``overloaded``) from its own admission, before it tokenizes
or generates anything, so a refused request can go to another replica with no work done twice.
``RequestError`` carries which replica refused (``replica``, ``deployment``; stamped where it
is raised inside a Serve replica), so a caller can tell "this replica is full" from "this stage
is full":

- ``RefusalMemory`` answers locally (no hop, no model CPU) only while every live replica of the
  refusing deployment has refused moments ago; one full replica among several never blacks
  out the stage.
- ``call_retrying`` retries a refused call until every live replica refused it (or
  ``max_tries``; when the memory already says every replica refused moments ago, no more tries
  than there are replicas): a replica that refused another request a moment ago may have
  room. Serve's router sends each
  try to the less loaded of two replicas by its cached queue lengths, so a retry usually
  lands on one with room, and sometimes on the one that just refused.
- A refusal by count (a generator's waiting line at its bound) says how long its replica
  stays full (``RequestError.full_for_s``, about one slot's time), and is remembered no
  longer than that: two replicas that were each full a moment apart are not a full stage.

How many replicas are live comes from a ``LiveCount`` (``carpool.topology`` polls Serve's
controller); unknown counts as one, which is the single-replica behaviour. Ray is imported
only inside the functions that need it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from carpool.admission import PRIORITIES, Priority, current_controls, deadline_exceeded
from carpool.errors import RequestError, find_request_error
from carpool.priority import recheck_proxy_priority
from carpool.topology import live_replicas

if TYPE_CHECKING:
    from carpool.generation.schemas import GenerationCall

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def await_or_cancel(call: Awaitable[T]) -> T:
    """Awaits a downstream call (a Serve DeploymentResponse) and cancels it if we are cancelled.

    Awaiting a response in a task that gets cancelled does not stop the downstream replica's
    work; cancelling the response does, so a client that leaves frees every stage below.
    """
    try:
        return await call
    except asyncio.CancelledError:
        cancel: Any = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()
        raise


async def open_stream(handle: Any, call: GenerationCall) -> tuple[Any, Any]:
    """Starts a streamed call on a generator handle and awaits its first event.

    The first event comes after the replica validated and admitted the request, so a refusal
    or bad input surfaces here, before any token, where the caller may still retry or answer
    a plain error. The stream is cancelled if that first event fails or the caller leaves.
    """
    events = handle.options(stream=True).stream.remote(call)
    try:
        return events, await events.__anext__()
    except BaseException:
        events.cancel()
        raise


# Live replicas of a deployment ("app/name"); None while unknown.
LiveCount = Callable[[str], "int | None"]

# A refusal stamped with no replica (Serve's own backpressure at the caller's handle, a
# refusal raised outside Serve) stands for the whole stage.
WHOLE_STAGE = "*"


def no_live_counts(_: str) -> int | None:
    return None


# Refreshes the live counts before a caller gives up on a stage; True when they changed hands
# (``carpool.topology.LiveReplicas.recount``).
Recount = Callable[[], Awaitable[bool]]


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


async def call_retrying(
    make_call: Callable[[], Awaitable[T]],
    memory: RefusalMemory,
    priority: Priority,
    live: LiveCount = no_live_counts,
    max_tries: int = 8,
    recount: Recount | None = None,
    stage: str = "downstream",
) -> T:
    """Awaits ``make_call()``, trying again where no work was done twice: the retry loop.

    Two failures are retried, each by making the call again (Serve picks the replica):

    - an overload refusal, while another replica has room: it is decided by the replica's
      admission before any work starts. Every refusal is recorded in ``memory``. Before giving
      up because every replica it knows of refused, the call refreshes the live counts once
      (``recount``): the counts are polled every few seconds, and a replica started since is
      room it must not miss.
    - the replica dying mid-call (``RayActorError``, ``ActorUnavailableError``), once: its
      work never reached the caller, so the retry (on the restarted or another replica) is
      the only answer the caller sees.

    ``make_call`` ends at a whole answer or at a stream's first event (``open_stream``): a
    stream already under way is never restarted. Anything else, the last refusal and a second
    lost replica are raised as they came.
    """
    tries = 0
    refused_this_call: set[str] = set()
    recounted = recount is None
    lost = False
    while True:
        tries += 1
        try:
            return await make_call()
        except Exception as exc:
            found = find_request_error(exc)
            if found is None and not lost and _replica_lost(exc):
                lost = True
                logger.warning("%s replica lost mid-call; retrying once elsewhere", stage)
                continue
            if not is_overload(found):
                raise
            assert found is not None
            memory.record(found, priority)
            if found.replica is None or tries >= max_tries:
                raise
            # Serve may send a retry to the replica that just refused (its queue lengths are
            # cached), so the call gives up once every live replica refused it, not after
            # one try per replica.
            refused_this_call.add(found.replica)
            if _out_of_room(found, live, refused_this_call):
                if recounted:
                    raise
                recounted = True
                assert recount is not None
                if not await recount() or _out_of_room(found, live, refused_this_call):
                    raise
            # Every replica refused moments ago (the memory), yet one that refused another
            # request 100 ms ago may have room now: this call still tries each live replica
            # once, but no more than that (Serve may route a retry back to a refuser).
            if not memory.has_room(found.deployment, priority, live) and tries > _replicas(
                found, live
            ):
                raise


def _replicas(refusal: RequestError, live: LiveCount) -> int:
    """Live replicas of the refusing deployment (one while unknown)."""
    return max(live(refusal.deployment or WHOLE_STAGE) or 1, 1)


def _out_of_room(refusal: RequestError, live: LiveCount, refused_this_call: set[str]) -> bool:
    """Every live replica of the refusing deployment refused this call."""
    return len(refused_this_call) >= _replicas(refusal, live)


def _replica_lost(exc: BaseException) -> bool:
    """True when the call failed because its replica died, not because of what was asked."""
    exceptions = sys.modules.get("ray.exceptions")
    if exceptions is None:  # Ray never loaded: no Ray error can have been raised
        return False
    lost = (exceptions.RayActorError, exceptions.ActorUnavailableError)
    current: BaseException | None = exc
    while current is not None:
        if isinstance(current, lost):
            return True
        current = current.__cause__ or current.__context__
    return False


def _cancel(call: Awaitable[Any]) -> None:
    # A DeploymentResponse: cancelling it cancels the downstream replica's work (queued items
    # leave their batch, a generating sequence frees its slot) and, through Serve, its own
    # downstream calls. Awaiting it in a cancelled task would not.
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        try:
            cancel()
        except Exception:  # already finished or never assigned: nothing left to stop
            logger.debug("cancelling a downstream call failed", exc_info=True)


async def await_within_deadline(stage: str, call: Awaitable[T]) -> T:
    """Awaits a downstream call within the request's deadline; cancels it if the client leaves.

    Past the deadline the downstream work is cancelled and the client gets 504.
    ``asyncio.timeout``, not ``wait_for``: on CPython 3.11 ``wait_for`` returns the result of
    a call that completes just as the caller is cancelled, losing the cancellation
    (gh-86296); a timeout scope re-raises it.
    """
    remaining = current_controls().remaining_s()
    try:
        if remaining is None:
            return await call
        if remaining <= 0:
            raise TimeoutError
        async with asyncio.timeout(remaining):
            return await call
    except TimeoutError:
        _cancel(call)
        raise deadline_exceeded(stage) from None
    except asyncio.CancelledError:
        _cancel(call)
        raise


def _backpressure(exc: BaseException) -> bool:
    from ray.serve.exceptions import BackPressureError

    return isinstance(exc, BackPressureError)


# Per ingress process: what each downstream stage's replicas last refused for overload.
_REFUSALS: dict[str, RefusalMemory] = {}


def _live(deployment: str) -> int | None:
    return live_replicas().count(deployment)


def _refusals(stage: str) -> RefusalMemory:
    memory = _REFUSALS.get(stage)
    if memory is None:
        memory = _REFUSALS[stage] = RefusalMemory()
    return memory


# An overload refusal is held this long at most before it is answered (see _held).
MAX_REFUSAL_HOLD_S = 1.0


async def refuse_if_overloaded(stage: str) -> None:
    """503 at the ingress while every replica of ``stage`` is known to be full: no hop, no
    model CPU spent. One full replica among several refuses nothing here."""
    refusal = _refusals(stage).refusal(stage, current_controls().priority, _live)
    if refusal is not None:
        raise await _held(refusal)


def _remember(stage: str, error: RequestError) -> RequestError:
    _refusals(stage).record(error, current_controls().priority)
    return error


async def _held(error: RequestError) -> RequestError:
    """Holds an overload refusal for part of its Retry-After before it goes out.

    A client that ignores Retry-After and resends at once turns overload into a storm of
    refusals, each paid for by the proxy and the ingress on the cores the model computes on
    (measured: 300 such clients cut goodput to 0.72 of capacity). Waiting here costs no CPU
    and paces them; the Retry-After sent is what is left. Never past the request's deadline.
    """
    if error.status_code != 503 or error.code != "overloaded" or not error.retry_after_s:
        return error
    recheck_proxy_priority()  # an opted-in proxy restarted since would run at full priority
    hold = min(error.retry_after_s, MAX_REFUSAL_HOLD_S)
    remaining = current_controls().remaining_s()
    if remaining is not None:
        hold = min(hold, max(remaining, 0.0))
    await asyncio.sleep(hold)
    error.retry_after_s = max(error.retry_after_s - hold, 0.5)
    return error


async def call_idempotent(stage: str, make_call: Callable[[], Awaitable[T]]) -> T:
    """Like ``call_backend``, over several replicas, retried by ``call_retrying``: refused at
    the ingress only while every replica of the stage is known to be full; a replica's overload
    refusal (decided before it did any work) tried on another replica with room; a call whose
    replica died mid-call retried once elsewhere (the restarted or another replica).

    For embed, rank, retrieve, and generation on a named model answered whole or before a
    stream's first event: a lost replica's work never reached the client, so the retry is the
    only answer it sees; a stream already under way is never restarted. Not for the router
    (``auto``), which retries its own calls: ``call_once``.
    """
    await refuse_if_overloaded(stage)
    return await call_backend(
        stage,
        call_retrying(
            lambda: await_or_cancel(make_call()),
            _refusals(stage),
            current_controls().priority,
            _live,
            recount=live_replicas().recount,
            stage=stage,
        ),
    )


async def call_once(stage: str, make_call: Callable[[], Awaitable[T]]) -> T:
    """``call_idempotent`` without the retry loop, for a stage that retries its own calls.

    The router behind ``auto`` retries every call it makes to a generator (its clients run
    ``call_retrying``); retrying the router as well would nest two loops, each refusal tried
    by both and the router's whole decision re-run. So only what the ingress alone can do is
    done here: refused at the ingress while every replica that refused is known to be full
    (``refuse_if_overloaded``), then ``call_backend``'s deadline, cancellation, held refusals
    and error mapping. ``make_call`` is called only once the ingress has not refused: the
    call itself costs the hop a refusal here saves.
    """
    await refuse_if_overloaded(stage)
    return await call_backend(stage, make_call())


async def call_backend(stage: str, call: Awaitable[T]) -> T:
    """Awaits a downstream stage; client errors pass through, anything else becomes a 503.

    A backend failure (replica died, model error) must not read as the client's fault, and
    must not leak a stack trace into the response. An overload refusal is remembered for a
    moment (``RefusalMemory``), so calls that queue model work can be refused here first
    (``refuse_if_overloaded``) at no model cost.
    """
    try:
        return await await_within_deadline(stage, call)
    except RequestError as exc:
        raise await _held(_remember(stage, exc)) from None
    except Exception as exc:
        found = find_request_error(exc)
        if found is not None:
            raise await _held(_remember(stage, found)) from None
        if _backpressure(exc):
            full = RequestError(
                503,
                f"the {stage} stage is at capacity (its callers' queue is full); retry after "
                "the Retry-After delay",
                code="overloaded",
                retry_after_s=1.0,
                replica=None,  # the caller's own handle refused: the whole stage is full
            )
            raise await _held(_remember(stage, full)) from None
        logger.exception("%s stage failed", stage)
        raise RequestError(
            503,
            f"the {stage} stage failed to answer ({type(exc).__name__}); retry the request",
            code="backend_unavailable",
        ) from None
