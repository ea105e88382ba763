"""The router's logic: per request, which model and which lane, and whether to escalate.

``RouterServer`` is plain Python over the pure policies in this package and a dict of
generator clients (anything with async ``generate(call)`` / ``stream(call)``, as the generator
deployments' handles have); ``router.deployment`` is its Serve shell. It answers like a
generator, plus a ``carpool`` record of what was decided.

Lanes with a shared target are priorities inside the router: each model has a bounded number
of requests in flight (per live replica of it, ``share_of_cap``), and waiting requests are
admitted shortest-predicted-first with aging (``ShortestFirstQueue``), so short requests stop
waiting behind long ones and long ones never starve. A lane with its own ``target``
deployment bypasses that queue.

A request answered whole may cascade (small first, escalated when its answer is judged poor);
a streamed one commits to a model before generating (``choice.commit_up_front``), so its first
token is not held back for a whole small answer.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from carpool.admission import deadline_exceeded
from carpool.aging import DEFAULT_AGING_TOKENS_PER_S
from carpool.config import StrictModel
from carpool.errors import RequestError
from router.choice import (
    LARGE,
    SMALL,
    CascadePolicy,
    Decision,
    EscalationLearner,
    LargeLoad,
    SmallOutcome,
    ThresholdChoice,
    commit_up_front,
    overflow,
)
from router.features import RequestFeatures, extract_features
from router.lanes import Lane, LanePolicy, ShortestFirstQueue, Tier
from router.length import LengthPredictor


class LaneSpec(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    max_predicted_tokens: float | None = Field(
        default=None, gt=0, description="Upper bound of this lane; null for the last lane."
    )
    target: str | None = Field(
        default=None, description="Own generator deployment; null shares the chosen model's."
    )


class RouterConfig(StrictModel):
    """The router's policies, picked by name."""

    policy: Literal["threshold", "cascade", "learned_cascade"] = Field(
        default="learned_cascade",
        description="How `auto` picks: by predicted length/cues, small-first cascade, or a "
        "cascade that learns which prompts escalate and sends them straight to large.",
    )
    max_small_tokens: float = Field(default=128, gt=0, description="threshold: above -> large.")
    min_mean_logprob: float = Field(
        default=-1.2, le=0, description="cascade: escalate below this mean token logprob."
    )
    max_repetition: float = Field(default=0.3, ge=0, le=1, description="cascade: n-gram repeat.")
    escalate_on_length: bool = Field(default=True, description="cascade: escalate if cut off.")
    latency_target_ms: float = Field(
        default=30_000, gt=0, description="Overflow to small when large's backlog is longer."
    )
    lanes: list[LaneSpec] = Field(
        default_factory=lambda: [
            LaneSpec(name="short", max_predicted_tokens=64),
            LaneSpec(name="long"),
        ]
    )
    lanes_enabled: bool = Field(
        default=True, description="false: one FIFO lane (the benchmarks' baseline)."
    )
    max_in_flight_per_replica: dict[str, int] = Field(
        default_factory=dict,
        description="Requests a model may have in flight per live replica of it, from all "
        "replicas hosting the router (the generate ingress) together; more wait in lanes, shortest first. The cap follows the "
        "model's live replica count, so autoscaling adds room. A model not listed gets its "
        "deployment's max_ongoing_requests (Serve's own per-replica limit): a backlog then "
        "waits at the replicas, where autoscaling counts it.",
    )
    predictor_sync_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How often each replica hosting the router (the generate app's ingress) "
        "merges its length predictor's learning with the others'.",
    )
    aging_tokens_per_s: float = Field(
        default=DEFAULT_AGING_TOKENS_PER_S,
        gt=0,
        description="Lane aging: predicted tokens a waiting request gains per second "
        "(carpool.aging; ~5 for a CPU model decoding tens of tokens/s).",
    )
    max_queued_per_lane: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="Admission bound per lane: requests waiting in one lane (for one model) "
        "before new ones for it are refused with 503 + Retry-After. The batch tier may fill "
        "half of it.",
    )
    default_max_tokens: int = Field(default=256, ge=1, le=131_072)
    predictor_default_tokens: float = Field(default=48, ge=1)
    predictor_snapshot: str | None = Field(
        default=None,
        description="Where the merged length predictor's state persists, on the node of the "
        "actor that merges it (the node of the generate app's ingress, which hosts the "
        "router: pin the ingress with resources to choose that node).",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_in_flight" in data:
            raise ValueError(
                "router.max_in_flight was replaced by max_in_flight_per_replica (requests per "
                "live replica of each model, so the cap grows as a model scales out); rename "
                "it, e.g. max_in_flight_per_replica: {small: 16, large: 16}"
            )
        for moved in ("num_replicas", "resources"):
            if isinstance(data, dict) and moved in data:
                raise ValueError(
                    f"router.{moved}: the router runs inside the generate app's ingress "
                    "replicas (no router deployment, no extra hop), so it has no replicas or "
                    f"resources of its own; remove router.{moved} and set the ingress's "
                    "(args.ingress.resources, or num_replicas of deployment generate_ingress "
                    "under deployments:)"
                )
        return data

    @model_validator(mode="after")
    def _lanes_ordered(self) -> RouterConfig:
        LanePolicy([Lane(s.name, s.max_predicted_tokens, s.target) for s in self.lanes])
        return self


class GeneratorClient(Protocol):
    async def generate(self, call: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...


@dataclass
class _Gate:
    """Bounded in-flight requests to one target, admitted by lane priority."""

    limit: int
    queue: ShortestFirstQueue[asyncio.Future[None]]
    in_flight: int = 0
    queued_tokens: float = 0.0
    tokens_per_s: float = 20.0  # learned from completions; a modest CPU prior
    waiters: dict[int, float] = field(default_factory=dict)
    # One FIFO lane (lanes disabled): admit in arrival order, not shortest-predicted first.
    fifo: bool = False
    max_queued_per_lane: int = 256
    lane_waiting: dict[str, int] = field(default_factory=dict)

    async def enter(
        self, predicted: float, tier: Tier, deadline: float | None = None, lane: str = ""
    ) -> None:
        """Waits for a slot; past ``deadline`` (time.time()) it gives up with 504."""
        if deadline is not None and deadline <= time.time():
            raise deadline_exceeded("router")
        if self.in_flight < self.limit and not len(self.queue):
            self.queued_tokens += predicted
            self.in_flight += 1
            return
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
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.push(future, 0.0 if self.fifo else predicted, time.monotonic(), tier)
        try:
            if deadline is None:
                await future
            else:
                # shield: a timeout must not cancel the future behind leave()'s back. A
                # timeout scope, not wait_for: on CPython 3.11 wait_for returns normally when
                # the slot is granted just as the caller is cancelled (gh-86296), and the
                # cancelled request would then generate anyway.
                async with asyncio.timeout(deadline - time.time()):
                    await asyncio.shield(future)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled():
                self.leave(predicted)  # admitted just as the caller left: give the slot back
            else:
                future.cancel()  # leave() skips it
                self.queued_tokens = max(0.0, self.queued_tokens - predicted)
            if isinstance(exc, asyncio.TimeoutError):
                raise deadline_exceeded("router") from None
            raise
        finally:
            self.lane_waiting[lane] -= 1

    def leave(self, predicted: float) -> None:
        self.queued_tokens = max(0.0, self.queued_tokens - predicted)
        self.in_flight -= 1
        self._admit_waiting()

    def resize(self, limit: int) -> None:
        """A new cap (the model's replicas changed); a larger one admits waiting requests."""
        self.limit = max(1, limit)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self.in_flight < self.limit and len(self.queue):
            future = self.queue.pop()
            if not future.done():
                self.in_flight += 1
                future.set_result(None)


def prompt_text(call: dict[str, Any]) -> tuple[str, int]:
    """The text the request asks about, and its chat turns."""
    if call.get("messages"):
        users = [m["content"] for m in call["messages"] if m.get("role") == "user"]
        return (users[-1] if users else "", len(call["messages"]))
    prompts = call.get("prompts") or [""]
    return prompts[0], 1


# A model's in-flight cap per replica when neither the config nor Serve says (outside Serve).
FALLBACK_PER_REPLICA = 16


def share_of_cap(per_replica: int, model_replicas: int | None, router_replicas: int | None) -> int:
    """This router's in-flight cap for one model: per-replica cap x the model's live
    replicas, split between the live replicas hosting a router (at least 1: a model scaled to zero
    still gets a request through, which is what makes Serve start a replica)."""
    total = per_replica * max(model_replicas or 1, 1)
    return max(1, math.ceil(total / max(router_replicas or 1, 1)))


# (model) -> this router's in-flight cap for it now.
CapSource = Callable[[str], int]


class RouterServer:
    """Plain-Python router; tests pass fake generator clients."""

    def __init__(
        self,
        config: RouterConfig | dict,
        clients: dict[str, GeneratorClient],
        caps: CapSource | None = None,
        share_predictor: bool = False,
    ) -> None:
        self.config = (
            config if isinstance(config, RouterConfig) else RouterConfig.model_validate(config)
        )
        if SMALL not in clients:
            raise ValueError("the router needs at least a 'small' generator client")
        self.clients = clients
        c = self.config
        self.caps = caps or (
            lambda model: c.max_in_flight_per_replica.get(model, FALLBACK_PER_REPLICA)
        )
        # A shared predictor persists where it is merged (PredictorStore), not per replica.
        snapshot = os.path.expanduser(c.predictor_snapshot) if c.predictor_snapshot else None
        snapshot = None if share_predictor else snapshot
        self.predictor = LengthPredictor(
            default_tokens=c.predictor_default_tokens, snapshot_path=snapshot
        )
        lanes = [Lane(s.name, s.max_predicted_tokens, s.target) for s in c.lanes]
        self.lanes = LanePolicy(lanes if c.lanes_enabled else [Lane("fifo", None)])
        self.threshold = ThresholdChoice(c.max_small_tokens)
        self.cascade = CascadePolicy(c.min_mean_logprob, c.max_repetition, c.escalate_on_length)
        dims = len(extract_features("x", 1, 1).vector())
        self.learner = EscalationLearner(dims)
        self.gates = {
            name: _Gate(
                self.caps(name),
                ShortestFirstQueue(c.aging_tokens_per_s),
                fifo=not c.lanes_enabled,
                max_queued_per_lane=c.max_queued_per_lane,
            )
            for name in clients
        }
        self.listeners: list[Any] = []

    # --- decisions ------------------------------------------------------------------

    def features(self, call: dict[str, Any]) -> RequestFeatures:
        text, turns = prompt_text(call)
        # ~4 characters per token: the router holds no tokenizer, and the predictor learns
        # its scale from real outcomes anyway.
        return extract_features(
            text,
            prompt_tokens=max(1, len(text) // 4),
            max_tokens=call.get("max_tokens") or self.config.default_max_tokens,
            chat_turns=turns,
        )

    def decide(
        self, features: RequestFeatures, predicted: float, requested: str, stream: bool = False
    ) -> Decision:
        """Which model answers. ``stream``: chosen before generating, never a cascade."""
        if requested in (SMALL, LARGE):
            if requested not in self.clients:
                raise ValueError(f"model {requested!r} is not deployed")
            return Decision(requested, "requested")
        if LARGE not in self.clients:
            return Decision(SMALL, "only small is deployed")
        policy = self.config.policy
        if policy == "threshold":
            decision = self.threshold.choose(features, predicted)
        elif policy == "learned_cascade" and self.learner.skip_small(features):
            decision = Decision(LARGE, "learned: this kind of prompt escalates")
        else:
            decision = self.cascade.choose(features, predicted)
        if stream:
            decision = commit_up_front(decision, self.threshold, features, predicted)
        gate = self.gates[LARGE]
        load = LargeLoad(gate.queued_tokens, gate.tokens_per_s)
        return overflow(decision, load, self.config.latency_target_ms)

    # --- serving --------------------------------------------------------------------

    def _gate(self, target: str, model: str) -> _Gate:
        name = target if target in self.gates else model
        gate = self.gates[name]
        cap = self.caps(name)
        if cap != gate.limit:
            gate.resize(cap)
        return gate

    async def _run(
        self, model: str, lane: Lane, call: dict[str, Any], predicted: float, tier: Tier
    ) -> dict[str, Any]:
        gate = self._gate(lane.target or model, model)
        waited = time.monotonic()
        await gate.enter(predicted, tier, call.get("deadline"), lane.name)
        queue_ms = (time.monotonic() - waited) * 1000
        started = time.monotonic()
        try:
            client = self.clients.get(lane.target or model) or self.clients[model]
            # The prediction rides along: vLLM's priority queue orders by it (docs/vllm.md).
            result = await client.generate({**call, "predicted_tokens": predicted})
        finally:
            gate.leave(predicted)
        elapsed = time.monotonic() - started
        if result.get("completion_tokens") and elapsed > 0:
            # Exponential average of this target's decode speed, for the overflow estimate.
            gate.tokens_per_s = (
                0.8 * gate.tokens_per_s + 0.2 * result["completion_tokens"] / elapsed
            )
        result["_queue_ms"] = queue_ms
        return result

    async def generate(
        self, call: dict[str, Any], requested: str = "auto", tier: Tier | None = None
    ) -> dict[str, Any]:
        tier = tier or call.get("priority") or "interactive"
        features = self.features(call)
        predicted = self.predictor.predict(features)
        lane = self.lanes.assign(predicted)
        decision = self.decide(features, predicted, requested)
        result = await self._run(decision.model, lane, call, predicted, tier)
        escalated, reason = False, decision.reason
        if decision.cascade:
            outcome = SmallOutcome(
                token_ids=result.get("token_ids") or _word_ids(result),
                token_logprobs=result.get("token_logprobs") or [],
                finish_reason=result["choices"][0]["finish_reason"],
            )
            escalated, reason = self.cascade.should_escalate(outcome)
            self.learner.observe(features, escalated)
            if escalated:
                result = await self._run(LARGE, lane, call, predicted, tier)
        actual = int(result.get("completion_tokens") or 0)
        self.predictor.observe(features, actual)
        record = {
            "model": LARGE if escalated else decision.model,
            "lane": lane.name,
            "predicted_tokens": round(predicted, 1),
            "actual_tokens": actual,
            "escalated": escalated,
            "overflow": decision.overflow,
            "reason": reason,
            "queue_ms": round(result.pop("_queue_ms", 0.0), 1),
        }
        for listener in self.listeners:
            listener.on_decision(record)
        result["carpool"] = record
        return result

    async def stream(
        self, call: dict[str, Any], requested: str = "auto", tier: Tier | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Streams from the model chosen before generating (no cascade: the first token goes
        out as soon as it exists). The start event names that model, and carries the decision.
        """
        tier = tier or call.get("priority") or "interactive"
        features = self.features(call)
        predicted = self.predictor.predict(features)
        lane = self.lanes.assign(predicted)
        decision = self.decide(features, predicted, requested, stream=True)
        target = lane.target or decision.model
        gate = self._gate(target, decision.model)
        waited = time.monotonic()
        await gate.enter(predicted, tier, call.get("deadline"), lane.name)
        record = {
            "model": decision.model,
            "lane": lane.name,
            "predicted_tokens": round(predicted, 1),
            "escalated": False,
            "overflow": decision.overflow,
            "reason": decision.reason,
            "queue_ms": round((time.monotonic() - waited) * 1000, 1),
        }
        actual = 0
        try:
            client = self.clients.get(target) or self.clients[decision.model]
            async for event in client.stream({**call, "predicted_tokens": predicted}):
                if event["type"] == "start":
                    event = {**event, "model": decision.model, "carpool": record}
                if event["type"] == "end":
                    actual = int(event.get("completion_tokens") or 0)
                yield event
        finally:
            gate.leave(predicted)
        self.predictor.observe(features, actual)
        for listener in self.listeners:
            listener.on_decision({**record, "actual_tokens": actual})

    def stats(self) -> dict[str, Any]:
        return {
            "predictor_observations": self.predictor.observations,
            "learner_observations": self.learner.observations,
            "in_flight": {k: g.in_flight for k, g in self.gates.items()},
            "in_flight_caps": {k: g.limit for k, g in self.gates.items()},
            "waiting": {k: len(g.queue) for k, g in self.gates.items()},
        }


def _word_ids(result: dict[str, Any]) -> list[int]:
    """Stand-in token ids (hashed words) for the repetition check when none were returned."""
    text = result["choices"][0]["text"] if result.get("choices") else ""
    return [hash(w) % 1_000_003 for w in text.split()]
