"""The router's logic: per request, which model and which lane, and whether to escalate.

``RouterServer`` is plain Python over the pure policies in this package and a dict of
generator clients (anything with async ``generate(call)`` / ``stream(call)``, as the generator
deployments' handles have); ``router.deployment`` is its Serve shell. It answers like a
generator, plus a ``carpool`` record of what was decided.

The flow of one request is three synchronous steps, so that it exists once:

- ``plan``: features -> predicted length -> lane -> model (``decide``), as a ``Route``;
- ``after_answer``: the cascade judges small's answer; escalate or not (the learner learns);
- ``finish``: the length predictor learns the real length, the decision is recorded.

Between them a driver waits at the target's gate (``router.gate``) and calls the model.
``generate`` and ``stream`` here are the asyncio drivers; the digital twin
(``carpool_twin.sim``) drives the same steps and gates from its event loop.

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

import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

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
from router.config import RouterConfig
from router.features import RequestFeatures, extract_features
from router.gate import Gate
from router.lanes import Lane, LanePolicy, ShortestFirstQueue, Tier
from router.length import LengthPredictor


class GeneratorClient(Protocol):
    async def generate(self, call: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...


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


@dataclass
class Route:
    """One request's way through the router, from ``plan`` to ``finish``."""

    tier: Tier
    features: RequestFeatures
    predicted: float
    lane: Lane
    decision: Decision
    escalated: bool = False
    reason: str = ""  # the decision's, then the cascade's verdict on small's answer

    @property
    def model(self) -> str:
        """The model answering now: the decision's, or large once escalated."""
        return LARGE if self.escalated else self.decision.model

    @property
    def target(self) -> str:
        """The deployment called: the lane's own, else the model's."""
        return self.lane.target or self.model

    def record(self, queue_ms: float) -> dict[str, Any]:
        """What was decided, as the ``carpool`` field of the answer and the metrics see it."""
        return {
            "model": self.model,
            "lane": self.lane.name,
            "predicted_tokens": round(self.predicted, 1),
            "escalated": self.escalated,
            "overflow": self.decision.overflow,
            "reason": self.reason,
            "queue_ms": round(queue_ms, 1),
        }


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
            name: Gate(
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

    # --- the flow, one synchronous step at a time -------------------------------------

    def plan(
        self,
        call: dict[str, Any],
        requested: str = "auto",
        tier: Tier | None = None,
        stream: bool = False,
    ) -> Route:
        """A request arrives: its features, predicted length, lane and model."""
        features = self.features(call)
        predicted = self.predictor.predict(features)
        lane = self.lanes.assign(predicted)
        decision = self.decide(features, predicted, requested, stream)
        tier = tier or call.get("priority") or "interactive"
        return Route(tier, features, predicted, lane, decision, reason=decision.reason)

    def gate(self, route: Route) -> Gate:
        """The gate the route's next call waits at (its cap refreshed from ``caps``)."""
        name = route.target if route.target in self.gates else route.model
        gate = self.gates[name]
        cap = self.caps(name)
        if cap != gate.limit:
            gate.resize(cap)
        return gate

    def after_answer(self, route: Route, outcome: Callable[[], SmallOutcome]) -> bool:
        """A model answered the route whole: True when that answer was small's in a cascade
        and is judged poor, so large answers next. ``outcome`` reads the answer as the cascade
        sees it (called only when judged); the learner learns from each verdict."""
        if not route.decision.cascade or route.escalated:
            return False
        escalated, route.reason = self.cascade.should_escalate(outcome())
        self.learner.observe(route.features, escalated)
        route.escalated = escalated
        return escalated

    def finish(self, route: Route, actual_tokens: int, queue_ms: float = 0.0) -> dict[str, Any]:
        """The final answer came, ``actual_tokens`` long: the predictor learns, the decision is
        recorded and handed to the listeners (metrics)."""
        self.predictor.observe(route.features, actual_tokens)
        record = route.record(queue_ms)
        record["actual_tokens"] = actual_tokens
        for listener in self.listeners:
            listener.on_decision(record)
        return record

    # --- serving: the asyncio drivers -----------------------------------------------

    def _client(self, route: Route) -> GeneratorClient:
        return self.clients.get(route.target) or self.clients[route.model]

    async def _call(self, route: Route, call: dict[str, Any]) -> dict[str, Any]:
        gate = self.gate(route)
        waited = time.monotonic()
        await gate.enter(route.predicted, route.tier, call.get("deadline"), route.lane.name)
        queue_ms = (time.monotonic() - waited) * 1000
        started = time.monotonic()
        result: dict[str, Any] = {}
        try:
            # The prediction rides along: vLLM's priority queue orders by it (docs/vllm.md).
            result = await self._client(route).generate(
                {**call, "predicted_tokens": route.predicted}
            )
        finally:
            tokens = int(result.get("completion_tokens") or 0)
            gate.leave(route.predicted, tokens, time.monotonic() - started)
        result["_queue_ms"] = queue_ms
        return result

    async def generate(
        self, call: dict[str, Any], requested: str = "auto", tier: Tier | None = None
    ) -> dict[str, Any]:
        route = self.plan(call, requested, tier)
        result = await self._call(route, call)
        if self.after_answer(route, lambda: small_outcome(result)):
            result = await self._call(route, call)
        actual = int(result.get("completion_tokens") or 0)
        result["carpool"] = self.finish(route, actual, result.pop("_queue_ms", 0.0))
        return result

    async def stream(
        self, call: dict[str, Any], requested: str = "auto", tier: Tier | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Streams from the model chosen before generating (no cascade: the first token goes
        out as soon as it exists). The start event names that model, and carries the decision.
        """
        route = self.plan(call, requested, tier, stream=True)
        gate = self.gate(route)
        waited = time.monotonic()
        await gate.enter(route.predicted, route.tier, call.get("deadline"), route.lane.name)
        queue_ms = (time.monotonic() - waited) * 1000
        record = route.record(queue_ms)
        actual = 0
        try:
            client = self._client(route)
            async for event in client.stream({**call, "predicted_tokens": route.predicted}):
                if event["type"] == "start":
                    event = {**event, "model": route.model, "carpool": record}
                if event["type"] == "end":
                    actual = int(event.get("completion_tokens") or 0)
                yield event
        finally:
            gate.leave(route.predicted)
        self.finish(route, actual, queue_ms)

    def stats(self) -> dict[str, Any]:
        return {
            "predictor_observations": self.predictor.observations,
            "learner_observations": self.learner.observations,
            "in_flight": {k: g.in_flight for k, g in self.gates.items()},
            "in_flight_caps": {k: g.limit for k, g in self.gates.items()},
            "waiting": {k: len(g.queue) for k, g in self.gates.items()},
        }


def small_outcome(result: dict[str, Any]) -> SmallOutcome:
    """What the cascade reads in a generator's whole answer."""
    return SmallOutcome(
        token_ids=result.get("token_ids") or _word_ids(result),
        token_logprobs=result.get("token_logprobs") or [],
        finish_reason=result["choices"][0]["finish_reason"],
    )


def _word_ids(result: dict[str, Any]) -> list[int]:
    """Stand-in token ids (hashed words) for the repetition check when none were returned."""
    text = result["choices"][0]["text"] if result.get("choices") else ""
    return [hash(w) % 1_000_003 for w in text.split()]
