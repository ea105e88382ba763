"""Admission control: deadlines, priority tiers and queue bounds (pure, no Ray).

A request carries ``RequestControls`` from its HTTP ingress to every stage: an absolute
deadline (wall-clock seconds, so it survives a hop to another process or node) and a
priority tier. Each model replica asks an ``AdmissionPolicy`` whether to take a job, given
what it already holds and a ``PassCostModel`` fitted to its own recent forward passes
(BentoML's adaptive batcher does the same: a linear latency model refuses work that cannot
finish in time). Refusals are fast and carry a status that tells the client what happened:
503 + Retry-After when the replica is full, 504 when the deadline has passed or cannot be
met.
"""

from __future__ import annotations

import contextvars
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

from carpool.errors import RequestError

Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch")
# Lower runs first; the executor and the generators' waiting queues order by it.
PRIORITY_RANK: dict[str, int] = {"interactive": 0, "batch": 1}

DEADLINE_HEADER = "x-carpool-deadline-ms"
PRIORITY_HEADER = "x-carpool-priority"
# A budget longer than a day is a client bug (seconds sent as ms?), not a deadline.
MAX_DEADLINE_MS = 86_400_000


@dataclass(frozen=True)
class RequestControls:
    """What a client asked for beyond its payload: when it stops caring, and how urgent it is."""

    deadline: float | None = None  # time.time() seconds; None = no deadline
    priority: Priority = "interactive"

    @property
    def rank(self) -> int:
        return PRIORITY_RANK[self.priority]

    def remaining_s(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)

    def expired(self, now: float | None = None) -> bool:
        remaining = self.remaining_s(now)
        return remaining is not None and remaining <= 0

    def monotonic_deadline(self) -> float | None:
        """The deadline on this process's monotonic clock (what timers and queues use)."""
        remaining = self.remaining_s()
        return None if remaining is None else time.monotonic() + remaining

    def check(self, stage: str) -> None:
        """Raises 504 if the deadline has passed, so no compute is spent on the request."""
        if self.expired():
            raise deadline_exceeded(stage)


# RequestControls is a frozen dataclass, so one shared default is safe.
_CONTROLS: contextvars.ContextVar[RequestControls] = contextvars.ContextVar(
    "carpool_request_controls",
    default=RequestControls(),  # noqa: B039
)


def current_controls() -> RequestControls:
    """The deadline and priority of the request this ingress is serving now."""
    return _CONTROLS.get()


def deadline_exceeded(stage: str) -> RequestError:
    return RequestError(
        504,
        f"the request's deadline passed before the {stage} stage could answer; send a larger "
        f"{DEADLINE_HEADER} budget or retry when the service is less busy",
        code="deadline_exceeded",
    )


def parse_controls(
    deadline_ms: str | None,
    priority: str | None,
    default_deadline_ms: float | None = None,
    now: float | None = None,
) -> RequestControls:
    """Reads the two headers; a bad value is the client's error (400), never ignored."""
    now = time.time() if now is None else now
    budget_ms: float | None = default_deadline_ms
    if deadline_ms is not None and deadline_ms.strip():
        try:
            budget_ms = float(deadline_ms)
        except ValueError:
            budget_ms = math.nan
        if not math.isfinite(budget_ms) or budget_ms < 0 or budget_ms > MAX_DEADLINE_MS:
            raise RequestError(
                400,
                f"header {DEADLINE_HEADER} is {deadline_ms[:40]!r}; send the time budget in "
                f"milliseconds, a number from 0 to {MAX_DEADLINE_MS}",
                param=DEADLINE_HEADER,
            )
    tier = (priority or "interactive").strip().lower()
    if tier not in PRIORITIES:
        raise RequestError(
            400,
            f"header {PRIORITY_HEADER} is {priority[:40] if priority else priority!r}; send one "
            f"of {', '.join(PRIORITIES)}",
            param=PRIORITY_HEADER,
        )
    deadline = None if budget_ms is None else now + budget_ms / 1000
    return RequestControls(deadline=deadline, priority=tier)  # type: ignore[arg-type]


class PassCostModel:
    """Forward-pass latency as ``fixed_ms + ms_per_token x tokens``, fitted online.

    Exponentially weighted least squares over recent passes, so it follows a replica that
    slows down (a neighbour on its core) without remembering its cold start forever.
    """

    def __init__(
        self,
        decay: float = 0.97,
        min_passes: int = 5,
        max_pass_items: int | None = None,
        max_pass_tokens: int | None = None,
    ) -> None:
        self.decay = decay
        self.min_passes = min_passes
        self.passes = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.fixed_ms = 0.0
        self.ms_per_token = 0.0
        self.mean_pass_items = 1.0
        # The batch limits: a deep queue runs in passes this full, whatever was seen lately.
        self.max_pass_items = max_pass_items
        self.max_pass_tokens = max_pass_tokens
        self.largest_pass_tokens = 0  # the largest pass seen: how far the fit reaches

    def observe(self, tokens: int, items: int, ms: float) -> None:
        d = self.decay
        self._w = d * self._w + 1
        self._x = d * self._x + tokens
        self._y = d * self._y + ms
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * ms
        self.mean_pass_items = (
            items if self.passes == 0 else 0.9 * self.mean_pass_items + 0.1 * items
        )
        self.passes += 1
        self.largest_pass_tokens = max(self.largest_pass_tokens, tokens)
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var > 1e-9:
            slope = (self._xy / self._w - mean_x * mean_y) / var
        else:
            slope = mean_y / mean_x if mean_x else 0.0
        slope = max(slope, 0.0)
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # all passes alike in size: attribute everything to tokens
            intercept, slope = 0.0, (mean_y / mean_x if mean_x else 0.0)
        self.fixed_ms, self.ms_per_token = intercept, slope

    @property
    def ready(self) -> bool:
        return self.passes >= self.min_passes

    def estimate_ms(self, items: int, tokens: int) -> float:
        """Time to run ``items`` items of ``tokens`` real tokens in total, in passes."""
        if not self.ready or items <= 0:
            return 0.0
        return self.passes_for(items, tokens) * self.fixed_ms + tokens * self.ms_per_token

    def confident(self, items: int, tokens: int) -> bool:
        """Whether an estimate for this work rests on passes of its size.

        A line fitted to small passes cannot say what a large one costs: on a busy CPU a
        few noisy single-request passes gave a slope that priced a 146-text burst at 31 s
        (8 s in fact). Past twice the largest pass seen, the estimate is a guess, and a
        guess is no reason to refuse work; the first large pass makes it a measurement.
        """
        if not self.ready or items <= 0:
            return False
        per_pass = tokens / self.passes_for(items, tokens)
        return per_pass <= 2 * self.largest_pass_tokens

    def passes_for(self, items: int, tokens: int) -> int:
        """Forward passes ``items`` queued items take.

        Passes as large as the recent ones, but never fewer items per pass than the limits
        allow: the executor runs everything queued, so a deep queue runs in full passes even
        when light load lately ran one item at a time. (Counting a 146-text burst as 146
        single-item passes once made a replica call 8 s of work 31 s and refuse it.)
        """
        passes = math.ceil(items / max(self.mean_pass_items, 1.0))
        if self.max_pass_items is None:
            return passes
        full = math.ceil(items / self.max_pass_items)
        if self.max_pass_tokens:
            full = max(full, math.ceil(tokens / self.max_pass_tokens))
        return max(1, min(passes, full))


@dataclass
class QueueState:
    """What a replica holds now (queued or running), and what a new job would add."""

    queued_items: int
    queued_tokens: int
    items: int
    tokens: int
    # The part of the queue that runs before this job: interactive jobs overtake queued batch
    # ones, so only those of their own tier are ahead of them. Default: the whole queue.
    ahead_items: int | None = None
    ahead_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.ahead_items is None:
            self.ahead_items = self.queued_items
        if self.ahead_tokens is None:
            self.ahead_tokens = self.queued_tokens


@dataclass
class AdmissionLimits:
    max_queued_items: int
    max_queue_delay_ms: float | None
    batch_tier_share: float
    target_queue_delay_ms: float = 500.0
    standing_queue_ms: float = 1000.0


class AdmissionPolicy(ABC):
    """Decides whether a replica takes a job now; ``None`` means yes."""

    def __init__(self, limits: AdmissionLimits, cost: PassCostModel) -> None:
        self.limits = limits
        self.cost = cost

    @abstractmethod
    def refuse(self, state: QueueState, controls: RequestControls) -> RequestError | None:
        """The error to answer with, or None to admit."""

    def _share(self, controls: RequestControls) -> float:
        # The batch tier may only fill part of the bounds: the rest stays free for interactive
        # requests, so bulk work never pushes them into refusals.
        return 1.0 if controls.priority == "interactive" else self.limits.batch_tier_share

    def _bounded(self, state: QueueState, controls: RequestControls) -> RequestError | None:
        bound = max(1, int(self.limits.max_queued_items * self._share(controls)))
        # An empty replica always admits, so a request larger than the bound is not starved.
        if state.queued_items and state.queued_items + state.items > bound:
            return RequestError(
                503,
                f"this replica already holds {state.queued_items} items (limit {bound} for "
                f"{controls.priority} requests); retry after the Retry-After delay or send "
                "fewer items",
                code="overloaded",
                retry_after_s=self._drain_s(state),
            )
        return None

    def _drain_s(self, state: QueueState) -> float:
        estimate = self.cost.estimate_ms(state.queued_items, state.queued_tokens)
        return max(estimate / 1000, 0.1)

    def _deadline(self, state: QueueState, controls: RequestControls) -> RequestError | None:
        remaining = controls.remaining_s()
        if remaining is None:
            return None
        if remaining <= 0:
            return deadline_exceeded("model")
        items = (state.ahead_items or 0) + state.items
        tokens = (state.ahead_tokens or 0) + state.tokens
        finish_ms = self.cost.estimate_ms(items, tokens)
        # Unsure estimates refuse nothing: the job still leaves the queue at its deadline.
        if finish_ms > remaining * 1000 and self.cost.confident(items, tokens):
            return RequestError(
                504,
                f"this replica expects to need {finish_ms:.0f} ms for the work ahead of this "
                f"request, more than the {remaining * 1000:.0f} ms left of its deadline; send "
                f"a larger {DEADLINE_HEADER} budget or retry later",
                code="deadline_unmeetable",
            )
        return None


class BoundedAdmission(AdmissionPolicy):
    """Refuses past a number of held items (and refuses what cannot meet its deadline)."""

    def refuse(self, state: QueueState, controls: RequestControls) -> RequestError | None:
        return self._deadline(state, controls) or self._bounded(state, controls)


class DrainAdmission(AdmissionPolicy):
    """Takes every job whose queue can drain within ``max_queue_delay_ms`` (the default).

    Refusing work below capacity costs goodput and buys latency only for clients that did
    not ask for it, so the bound is generous (seconds of work, e.g. a burst or a bulk client)
    and latency protection comes from each request's own deadline: a job that cannot finish
    before it is refused at once (504), one without a deadline waits. Bounding the wait, not
    the count, is what holds whatever the lengths: 4096 short texts and 4096 long ones
    differ 50x in time.
    """

    def refuse(self, state: QueueState, controls: RequestControls) -> RequestError | None:
        found = self._deadline(state, controls) or self._bounded(state, controls)
        if found is not None or self.limits.max_queue_delay_ms is None or not state.ahead_items:
            return found
        delay_ms = self.cost.estimate_ms(state.ahead_items, state.ahead_tokens or 0)
        bound_ms = self.limits.max_queue_delay_ms * self._share(controls)
        if delay_ms > bound_ms and self.cost.confident(state.ahead_items, state.ahead_tokens or 0):
            # Room opens as the queue drains below the bound, long before it is empty.
            excess_ms = delay_ms - bound_ms + self.cost.estimate_ms(state.items, state.tokens)
            return RequestError(
                503,
                f"this replica's queue is about {delay_ms:.0f} ms deep (limit {bound_ms:.0f} "
                f"ms for {controls.priority} requests); retry after the Retry-After delay",
                code="overloaded",
                retry_after_s=max(excess_ms / 1000, 0.5),
            )
        return None


class StandingQueueAdmission(DrainAdmission):
    """Tells a burst from overload, as CoDel does for packet queues.

    A burst (64 requests at once) makes a deep queue that drains; sustained overload makes a
    queue that stays. So the queue may pass ``target_queue_delay_ms`` for up to
    ``standing_queue_ms``; a queue still above target after that is standing, and requests are
    refused until it drains below target. ``max_queue_delay_ms`` still refuses at once, so
    one burst cannot queue without bound either. Accepted requests then wait about the target
    under overload, while a burst that fits the hard bound is served whole.

    Once it has refused, the replica remembers the overload for ``OVERLOAD_MEMORY`` standing
    intervals: while it lasts, a queue above target is refused at once. Without that memory
    (measured) every dip below target re-armed the grace period, each admitted another
    second of 3x overload, and accepted p99 sat near the hard bound instead of the target.
    """

    OVERLOAD_MEMORY = 10

    def __init__(
        self, limits: AdmissionLimits, cost: PassCostModel, clock: Any = time.monotonic
    ) -> None:
        super().__init__(limits, cost)
        self._clock = clock
        self._above_since: float | None = None
        self._last_seen = -math.inf
        self._last_refusal = -math.inf

    def refuse(self, state: QueueState, controls: RequestControls) -> RequestError | None:
        found = super().refuse(state, controls)  # deadline, item bound, hard delay bound
        if found is not None:
            return found
        now = self._clock()
        delay_ms = self.cost.estimate_ms(state.ahead_items or 0, state.ahead_tokens or 0)
        target_ms = self.limits.target_queue_delay_ms * self._share(controls)
        # Unobserved for a while: the queue may have drained meanwhile, so start afresh.
        if now - self._last_seen > self.limits.standing_queue_ms / 1000:
            self._above_since = None
        self._last_seen = now
        if delay_ms <= self.limits.target_queue_delay_ms:
            self._above_since = None
        if delay_ms <= target_ms:
            return None
        interval_s = self.limits.standing_queue_ms / 1000
        overloaded_lately = now - self._last_refusal < self.OVERLOAD_MEMORY * interval_s
        if self._above_since is None:
            self._above_since = now
        standing_ms = (now - self._above_since) * 1000
        if standing_ms < self.limits.standing_queue_ms and not overloaded_lately:
            return None
        self._last_refusal = now
        return RequestError(
            503,
            f"this replica's queue has stayed above {target_ms:.0f} ms for "
            f"{standing_ms:.0f} ms (now about {delay_ms:.0f} ms): it is overloaded, not "
            "bursting; retry after the Retry-After delay",
            code="overloaded",
            retry_after_s=max(delay_ms - target_ms, 100.0) / 1000,
        )


ADMISSION_POLICIES = ("drain", "bounded", "standing")


def make_admission_policy(
    name: str, limits: AdmissionLimits, cost: PassCostModel
) -> AdmissionPolicy:
    if name == "bounded":
        return BoundedAdmission(limits, cost)
    if name == "drain":
        return DrainAdmission(limits, cost)
    if name == "standing":
        return StandingQueueAdmission(limits, cost)
    raise ValueError(f"unknown admission policy {name!r}; choose one of {ADMISSION_POLICIES}")


@dataclass(frozen=True)
class SlotQueue:
    """A generator's waiting line for engine slots, as admission sees it."""

    waiting: int  # sequences submitted but not yet running
    mean_slot_s: float  # how long a sequence holds its slot, averaged (0 until one finished)
    slots: int  # max_num_seqs


def slot_refusal(
    model: str,
    queue: SlotQueue,
    controls: RequestControls,
    max_waiting: int,
    max_queue_delay_ms: float,
    batch_tier_share: float,
) -> RequestError | None:
    """A generator's admission, decided before any tokenizing or grammar compiling.

    Slots free at about ``slots / mean_slot_s`` per second, so a request queued behind
    ``waiting`` others waits about ``waiting * mean_slot_s / slots``. Refuses with 504 when
    that alone passes the request's deadline, with 503 + Retry-After when the queue is past
    its bound (a share of it for the batch tier); else None.
    """
    controls.check(f"{model} generator")
    share = batch_tier_share if controls.priority == "batch" else 1.0
    bound = int(max_waiting * share)
    wait_ms = 0.0
    if queue.waiting > 0 and queue.mean_slot_s > 0:
        wait_ms = queue.waiting * queue.mean_slot_s / max(queue.slots, 1) * 1000
    remaining = controls.remaining_s()
    if remaining is not None and wait_ms > remaining * 1000:
        return RequestError(
            504,
            f"model {model!r} expects a {wait_ms:.0f} ms wait for a slot, more than the "
            f"{remaining * 1000:.0f} ms left of this request's deadline; send a larger "
            f"{DEADLINE_HEADER} budget or retry later",
            code="deadline_unmeetable",
        )
    if queue.waiting >= bound or wait_ms > max_queue_delay_ms * share:
        # Room again once the line is back under both bounds: one sequence leaves the line
        # per slot time. Unknown (0) before the first sequence finished.
        slot_s = queue.mean_slot_s / max(queue.slots, 1)
        full_for_s = max(
            (queue.waiting - bound + 1) * slot_s,
            (wait_ms - max_queue_delay_ms * share) / 1000,
            0.0,
        )
        return RequestError(
            503,
            f"model {model!r} has {queue.waiting} requests waiting for a slot, about "
            f"{wait_ms:.0f} ms of waiting (limits {bound} requests, "
            f"{max_queue_delay_ms * share:.0f} ms for {controls.priority} requests); retry "
            "after the Retry-After delay",
            code="overloaded",
            retry_after_s=max(slot_s, 1.0),
            full_for_s=full_for_s,
        )
    return None
