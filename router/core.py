"""The router's logic: per request, which model and which lane, and whether to escalate.

``RouterServer`` is plain Python over the pure policies in this package and a dict of
generator clients (anything with async ``generate(call)`` / ``stream(call)``, as the generator
deployments' handles have); ``router.deployment`` is its Serve shell. It takes a
``GenerationCall`` and answers like a generator (``carpool.generation.hops``), with what it
decided in the answer's ``decision`` (a ``RouteDecision``; on a stream, the start event's).
The call it forwards carries its predicted length (``predicted_tokens``).

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
from dataclasses import dataclass, replace
from typing import Any, Protocol

from carpool.generation.hops import GenerationEvent, GenerationResult, RouteDecision
from carpool.generation.schemas import GenerationCall
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
    """A generator as the router calls it: a generator deployment's handle, adapted."""

    async def generate(self, call: GenerationCall) -> GenerationResult: ...

    def stream(self, call: GenerationCall) -> AsyncIterator[GenerationEvent]: ...


def prompt_text(call: GenerationCall) -> tuple[str, int]:
    """The text the request asks about, and its chat turns."""
    if call.messages:
        users = [m["content"] for m in call.messages if m.get("role") == "user"]
        return (users[-1] if users else "", len(call.messages))
    prompts = call.prompts or [""]
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
    def judged(self) -> bool:
        """The next answer is small's in a cascade: judged by its tokens' logprobs."""
        return self.decision.cascade and not self.escalated

    @property
    def target(self) -> str:
        """The deployment called: the lane's own, else the model's."""
        return self.lane.target or self.model

    def record(self, queue_ms: float, actual_tokens: int | None = None) -> RouteDecision:
        """What was decided, as the answer's ``decision`` and the metrics see it."""
        return RouteDecision(
            model=self.model,
            lane=self.lane.name,
            predicted_tokens=round(self.predicted, 1),
            escalated=self.escalated,
            overflow=self.decision.overflow,
            reason=self.reason,
            queue_ms=round(queue_ms, 1),
            actual_tokens=actual_tokens,
        )


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

    def features(self, call: GenerationCall) -> RequestFeatures:
        text, turns = prompt_text(call)
        # ~4 characters per token: the router holds no tokenizer, and the predictor learns
        # its scale from real outcomes anyway.
        return extract_features(
            text,
            prompt_tokens=max(1, len(text) // 4),
            max_tokens=call.max_tokens or self.config.default_max_tokens,
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
        call: GenerationCall,
        requested: str = "auto",
        tier: Tier | None = None,
        stream: bool = False,
    ) -> Route:
        """A request arrives: its features, predicted length, lane and model."""
        features = self.features(call)
        predicted = self.predictor.predict(features)
        lane = self.lanes.assign(predicted)
        decision = self.decide(features, predicted, requested, stream)
        tier = tier or call.priority
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
        if not route.judged:
            return False
        escalated, route.reason = self.cascade.should_escalate(outcome())
        self.learner.observe(route.features, escalated)
        route.escalated = escalated
        return escalated

    def finish(self, route: Route, actual_tokens: int, queue_ms: float = 0.0) -> RouteDecision:
        """The final answer came, ``actual_tokens`` long: the predictor learns, the decision is
        recorded and handed to the listeners (metrics)."""
        self.predictor.observe(route.features, actual_tokens)
        decision = route.record(queue_ms, actual_tokens)
        for listener in self.listeners:
            listener.on_decision(decision)
        return decision

    # --- serving: the asyncio drivers -----------------------------------------------

    def _client(self, route: Route) -> GeneratorClient:
        return self.clients.get(route.target) or self.clients[route.model]

    async def _call(self, route: Route, call: GenerationCall) -> tuple[GenerationResult, float]:
        """Calls the route's model through its gate: the answer, and ms waited at the gate."""
        gate = self.gate(route)
        waited = time.monotonic()
        await gate.enter(route.predicted, route.tier, call.deadline, route.lane.name)
        queue_ms = (time.monotonic() - waited) * 1000
        started = time.monotonic()
        tokens = 0
        try:
            # The prediction rides along: vLLM's priority queue orders by it (docs/vllm.md).
            # So does whether the cascade reads the answer's logprobs (vLLM computes them
            # only then).
            ahead = {"predicted_tokens": route.predicted, "judged": route.judged}
            result = await self._client(route).generate(call.model_copy(update=ahead))
            tokens = result.completion_tokens
        finally:
            gate.leave(route.predicted, tokens, time.monotonic() - started)
        return result, queue_ms

    async def generate(
        self, call: GenerationCall, requested: str = "auto", tier: Tier | None = None
    ) -> GenerationResult:
        """Answers whole (a cascade may call small, then large); the answer's ``decision``
        says what was decided."""
        route = self.plan(call, requested, tier)
        result, queue_ms = await self._call(route, call)
        if self.after_answer(route, lambda: small_outcome(result)):
            result, queue_ms = await self._call(route, call)
        result.decision = self.finish(route, result.completion_tokens, queue_ms)
        return result

    async def stream(
        self, call: GenerationCall, requested: str = "auto", tier: Tier | None = None
    ) -> AsyncIterator[GenerationEvent]:
        """Streams from the model chosen before generating (no cascade: the first token goes
        out as soon as it exists). The start event names that model, and carries the decision.
        """
        route = self.plan(call, requested, tier, stream=True)
        gate = self.gate(route)
        waited = time.monotonic()
        await gate.enter(route.predicted, route.tier, call.deadline, route.lane.name)
        queue_ms = (time.monotonic() - waited) * 1000
        decision = route.record(queue_ms)
        actual = 0
        try:
            client = self._client(route)
            ahead = call.model_copy(update={"predicted_tokens": route.predicted})
            async for event in client.stream(ahead):
                if event.type == "start":
                    event = replace(event, model=route.model, decision=decision)
                elif event.type == "end":
                    actual = event.completion_tokens
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


def small_outcome(result: GenerationResult) -> SmallOutcome:
    """What the cascade reads in a generator's whole answer."""
    return SmallOutcome(
        token_ids=result.token_ids or _word_ids(result),
        token_logprobs=result.token_logprobs,
        finish_reason=result.choices[0].finish_reason,
    )


def _word_ids(result: GenerationResult) -> list[int]:
    """Stand-in token ids (hashed words) for the repetition check when none were returned."""
    text = result.choices[0].text if result.choices else ""
    return [hash(w) % 1_000_003 for w in text.split()]
