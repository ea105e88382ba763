"""The Router deployment: per request, which model and which lane, and whether to escalate.

``RouterServer`` is plain Python over the pure policies in this package and a dict of
generator clients (anything with async ``generate(call)`` / ``stream(call)``, as the generator
deployments' handles have). The Serve shell binds it to the ``small`` and ``large`` generator
deployments of the generate app, which sends ``model: "auto"`` here. It answers like a
generator, plus a ``carpool`` record of what was decided.

Lanes with a shared target are priorities inside the router: each model has a bounded number
of requests in flight, and waiting requests are admitted shortest-predicted-first with aging
(``ShortestFirstQueue``), so short requests stop waiting behind long ones and long ones never
starve. A lane with its own ``target`` deployment bypasses that queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from carpool.admission import await_or_cancel, deadline_exceeded
from carpool.config import StrictModel
from carpool.errors import RequestError
from carpool.refusals import LiveCount, RefusalMemory, call_refusable, no_live_counts
from router.choice import (
    LARGE,
    SMALL,
    CascadePolicy,
    Decision,
    EscalationLearner,
    LargeLoad,
    SmallOutcome,
    ThresholdChoice,
    overflow,
)
from router.features import RequestFeatures, extract_features
from router.lanes import Lane, LanePolicy, ShortestFirstQueue, Tier
from router.length import LengthPredictor, PredictorStore

logger = logging.getLogger(__name__)

ROUTER_METRICS: dict[str, tuple[str, str, list[float] | None]] = {
    "carpool_router_decisions_total": ("counter", "Requests routed, by model and lane.", None),
    "carpool_router_escalations_total": ("counter", "Cascade escalations to large.", None),
    "carpool_router_overflows_total": ("counter", "Served on small: large was backed up.", None),
    "carpool_router_predicted_tokens": (
        "histogram",
        "Predicted output tokens.",
        [1, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
    ),
    "carpool_router_prediction_error_log": (
        "histogram",
        "|log(1+predicted) - log(1+actual)| per completed request.",
        [0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3],
    ),
    "carpool_router_lane_queue_ms": (
        "histogram",
        "Time a request waited in its lane before reaching a generator.",
        [1, 5, 10, 50, 100, 500, 1000, 5000, 20000, 60000],
    ),
}


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
        "router replicas together; more wait in lanes, shortest first. The cap follows the "
        "model's live replica count, so autoscaling adds room. A model not listed gets its "
        "deployment's max_ongoing_requests (Serve's own per-replica limit): a backlog then "
        "waits at the replicas, where autoscaling counts it.",
    )
    num_replicas: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Router replicas. Each holds its share of the in-flight caps; their "
        "length predictors merge what they learn through a deployment-scoped Ray actor.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each router replica asks for, to pin it to a node "
        "type (serve-gpu.yaml: the head node, with the ingresses).",
    )
    predictor_sync_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How often each router replica merges its length predictor's learning "
        "with the others'.",
    )
    aging_tokens_per_s: float = Field(default=50, gt=0, description="Lane aging rate.")
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
        "actor that merges it (pin the router with resources to choose that node).",
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
                # shield: a timeout must not cancel the future behind leave()'s back.
                await asyncio.wait_for(asyncio.shield(future), deadline - time.time())
        except (asyncio.CancelledError, asyncio.TimeoutError) as exc:
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
    """This router replica's in-flight cap for one model: per-replica cap x the model's live
    replicas, split between the live router replicas (at least 1: a model scaled to zero
    still gets a request through, which is what makes Serve start a replica)."""
    total = per_replica * max(model_replicas or 1, 1)
    return max(1, math.ceil(total / max(router_replicas or 1, 1)))


# (model) -> this router replica's in-flight cap for it now.
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

    def decide(self, features: RequestFeatures, predicted: float, requested: str) -> Decision:
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
        """Streams when no cascade is needed; a cascade answers once the small one is judged."""
        tier = tier or call.get("priority") or "interactive"
        features = self.features(call)
        predicted = self.predictor.predict(features)
        lane = self.lanes.assign(predicted)
        decision = self.decide(features, predicted, requested)
        if decision.cascade:
            result = await self.generate(call, requested, tier)
            yield {
                "type": "start",
                "model": result["model"],
                "prompt_tokens": result["prompt_tokens"],
                "carpool": result["carpool"],
            }
            for choice in result["choices"]:
                yield {
                    "type": "delta",
                    "index": choice["index"],
                    "text": choice["text"],
                    "finish_reason": choice["finish_reason"],
                }
            yield {
                "type": "end",
                "prompt_tokens": result["prompt_tokens"],
                "completion_tokens": result["completion_tokens"],
            }
            return
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
                    event = {**event, "carpool": record}
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


class RayRouterMetrics:
    """Records every decision in Ray's metrics (inside the replica only)."""

    def __init__(self) -> None:
        from ray.serve import metrics

        made: dict[str, Any] = {}
        for name, (kind, description, buckets) in ROUTER_METRICS.items():
            keys = ("model", "lane")
            if kind == "counter":
                made[name] = metrics.Counter(name, description=description, tag_keys=keys)
            else:
                made[name] = metrics.Histogram(
                    name, description=description, boundaries=buckets, tag_keys=keys
                )
        self._m = made

    def on_decision(self, record: dict[str, Any]) -> None:
        tags = {"model": record["model"], "lane": record["lane"]}
        m = self._m
        m["carpool_router_decisions_total"].inc(tags=tags)
        if record.get("escalated"):
            m["carpool_router_escalations_total"].inc(tags=tags)
        if record.get("overflow"):
            m["carpool_router_overflows_total"].inc(tags=tags)
        m["carpool_router_predicted_tokens"].observe(record["predicted_tokens"], tags=tags)
        m["carpool_router_lane_queue_ms"].observe(record["queue_ms"], tags=tags)
        if "actual_tokens" in record:
            error = abs(
                math.log1p(record["predicted_tokens"]) - math.log1p(record["actual_tokens"])
            )
            m["carpool_router_prediction_error_log"].observe(error, tags=tags)


class _HandleClient:
    """Adapts a generator DeploymentHandle to the GeneratorClient protocol.

    A replica's overload refusal (decided before it generates anything) is tried on another
    replica of the same model while one has room (carpool/refusals.py).
    """

    def __init__(self, handle: Any, live: LiveCount = no_live_counts) -> None:
        self.handle = handle
        self.live = live
        self.refusals = RefusalMemory()

    async def generate(self, call: dict[str, Any]) -> dict[str, Any]:
        return await call_refusable(
            lambda: await_or_cancel(self.handle.generate.remote(call)),
            self.refusals,
            call.get("priority") or "interactive",
            self.live,
        )

    async def _open(self, call: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        events = self.handle.options(stream=True).stream.remote(call)
        try:
            return events, await events.__anext__()
        except BaseException:
            events.cancel()
            raise

    async def stream(self, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        events, first = await call_refusable(
            lambda: self._open(call),
            self.refusals,
            call.get("priority") or "interactive",
            self.live,
        )
        finished = False
        try:
            yield first
            async for event in events:
                yield event
            finished = True
        finally:
            if not finished:  # our caller left: free the generator's slot too
                events.cancel()


PREDICTOR_ACTOR = "length_predictor"


class RouterDeployment(RouterServer):
    """Serve shell: clients are the generate app's generator handles.

    Its caps follow the live replicas of each model and of the router itself (polled from
    Serve's controller), and its length predictor merges with the other router replicas'
    through the deployment-scoped actor ``PREDICTOR_ACTOR``.
    """

    def __init__(self, config: dict, small: Any, large: Any = None) -> None:
        from carpool.topology import current_replica, live_replicas

        where = current_replica()
        app = where[0].split("/")[0] if where else ""
        self._deployments = {SMALL: f"{app}/small", LARGE: f"{app}/large"}
        self._router = f"{app}/{ROUTER_NAME}"
        self._live = live_replicas()

        def live(deployment: str) -> int | None:
            return self._live.count(deployment)

        clients: dict[str, GeneratorClient] = {SMALL: _HandleClient(small, live)}
        if large is not None:
            clients[LARGE] = _HandleClient(large, live)
        super().__init__(config, clients, caps=self._cap, share_predictor=True)
        self._small = small
        self.listeners.append(RayRouterMetrics())
        self._epoch: str | None = None
        self._sync_task = asyncio.get_event_loop().create_task(self._sync_predictor_forever())

    def _cap(self, model: str) -> int:
        deployment = self._deployments.get(model, "")
        view = self._live.view(deployment)
        per_replica = self.config.max_in_flight_per_replica.get(model) or (
            view.max_ongoing_requests if view and view.max_ongoing_requests else None
        )
        return share_of_cap(
            per_replica or FALLBACK_PER_REPLICA,
            view.running if view else None,
            self._live.count(self._router),
        )

    async def _sync_predictor_forever(self) -> None:
        from ray import serve

        warned = False
        while True:
            await asyncio.sleep(self.config.predictor_sync_s)
            try:
                store = serve.get_deployment_actor(PREDICTOR_ACTOR)
                pending, own = self.predictor.take_learned()
                try:
                    merged = await store.sync.remote(self._epoch, pending, own)
                except BaseException:
                    self.predictor.return_learned(pending)  # send it again next time
                    raise
                self._epoch = merged.pop("epoch")
                self.predictor.adopt(merged)
                warned = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor is restarting: learn locally meanwhile
                if not warned:
                    logger.warning("length predictor sync failed (%s); retrying", exc)
                    warned = True

    async def describe(self) -> dict[str, Any]:
        """For /v1/models: `auto` accepts what the small model accepts."""
        small = await self._small.describe.remote()
        return {**small, "model": f"router ({self.config.policy})"}


class SharedLengthPredictor(PredictorStore):
    """The deployment-scoped actor behind PREDICTOR_ACTOR (plain class; Ray wraps it)."""


ROUTER_NAME = "router"


def build_router_deployment(config: RouterConfig, small: Any, large: Any = None) -> Any:
    import ray
    from ray import serve
    from ray.serve.config import DeploymentActorConfig

    snapshot = os.path.expanduser(config.predictor_snapshot) if config.predictor_snapshot else None
    store = DeploymentActorConfig(
        name=PREDICTOR_ACTOR,
        actor_class=ray.remote(SharedLengthPredictor),
        init_kwargs={
            "default_tokens": config.predictor_default_tokens,
            "snapshot_path": snapshot,
        },
        actor_options={"num_cpus": 0.01, "resources": dict(config.resources)},
    )
    return (
        serve.deployment(RouterDeployment)
        .options(
            name=ROUTER_NAME,
            num_replicas=config.num_replicas,
            max_ongoing_requests=1024,
            max_queued_requests=1024,
            ray_actor_options={"num_cpus": 0.05, "resources": dict(config.resources)},
            deployment_actors=[store],
        )
        .bind(config.model_dump(), small, large)
    )
