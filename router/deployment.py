"""The router in Serve: ``router.core.RouterServer`` hosted by the generate app's ingress.

``HostedRouter`` binds the router to the generate app's ``small`` and ``large`` generator
handles; ``model: "auto"`` is decided in the ingress replica that received the request, with
no router deployment in between (docs/ingress.md, hops per URL). Serve-side only: its caps
follow the live replicas of each model and of the hosting deployment (``carpool.topology``),
its calls to the generators are retried here and nowhere else (``_HandleClient``: a refusal
on another replica of the same model, a lost replica once elsewhere; ``carpool.calls``), its
length predictor merges with the other hosting replicas' through a deployment-scoped actor,
and its decisions go to Ray metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import AsyncIterator
from typing import Any

from carpool.calls import (
    LiveCount,
    Recount,
    RefusalMemory,
    await_or_cancel,
    call_retrying,
    no_live_counts,
    open_stream,
)
from carpool.generation.hops import GenerationEvent, GenerationResult, RouteDecision
from carpool.generation.schemas import GenerationCall
from router.choice import LARGE, SMALL
from router.config import RouterConfig
from router.core import FALLBACK_PER_REPLICA, GeneratorClient, RouterServer, share_of_cap
from router.length import PredictorStore

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

    def on_decision(self, decision: RouteDecision) -> None:
        tags = {"model": decision.model, "lane": decision.lane}
        m = self._m
        m["carpool_router_decisions_total"].inc(tags=tags)
        if decision.escalated:
            m["carpool_router_escalations_total"].inc(tags=tags)
        if decision.overflow:
            m["carpool_router_overflows_total"].inc(tags=tags)
        m["carpool_router_predicted_tokens"].observe(decision.predicted_tokens, tags=tags)
        m["carpool_router_lane_queue_ms"].observe(decision.queue_ms, tags=tags)
        if decision.actual_tokens is not None:
            error = abs(math.log1p(decision.predicted_tokens) - math.log1p(decision.actual_tokens))
            m["carpool_router_prediction_error_log"].observe(error, tags=tags)


class _HandleClient:
    """Adapts a generator DeploymentHandle to the GeneratorClient protocol.

    The one retry loop of an ``auto`` request (``carpool.calls.call_retrying``; the ingress
    calling the router does not retry, ``call_once``): a replica's overload refusal (decided
    before it generates anything) is tried on another replica of the same model while one has
    room, and a call whose replica died before answering, or before a stream's first event, is
    tried once elsewhere. A stream under way is never restarted.
    """

    def __init__(
        self,
        handle: Any,
        live: LiveCount = no_live_counts,
        recount: Recount | None = None,
        name: str = "generator",
    ) -> None:
        self.handle = handle
        self.live = live
        self.recount = recount
        self.name = name
        self.refusals = RefusalMemory()

    async def generate(self, call: GenerationCall) -> GenerationResult:
        return await call_retrying(
            lambda: await_or_cancel(self.handle.generate.remote(call)),
            self.refusals,
            call.priority,
            self.live,
            recount=self.recount,
            stage=self.name,
        )

    async def stream(self, call: GenerationCall) -> AsyncIterator[GenerationEvent]:
        events, first = await call_retrying(
            lambda: open_stream(self.handle, call),
            self.refusals,
            call.priority,
            self.live,
            recount=self.recount,
            stage=self.name,
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


class HostedRouter(RouterServer):
    """The router inside a replica of the generate app's ingress, which answers ``auto``.

    No router deployment and no Ray hop of its own: a request for ``auto`` is decided in the
    process that received it, and reaches the chosen generator in one hop (none, for small,
    when small's replica is the ingress). Clients are the generator handles (or, for the
    replica's own model, a ``LocalHandle``). Its caps follow the live replicas of each model
    and of the deployment hosting it (polled from Serve's controller), and its length
    predictor merges with the other hosting replicas' through the deployment-scoped actor
    ``PREDICTOR_ACTOR``, which the hosting deployment declares (``predictor_store``).
    """

    def __init__(self, config: RouterConfig | dict, small: Any, large: Any = None) -> None:
        from carpool.topology import current_replica, live_replicas

        where = current_replica()
        self._host = where[0] if where else ""
        app = self._host.split("/")[0]
        self._deployments = {SMALL: f"{app}/small", LARGE: f"{app}/large"}
        self._live = live_replicas()
        clients: dict[str, GeneratorClient] = {
            SMALL: _HandleClient(small, self._live.count, self._live.recount, SMALL)
        }
        if large is not None:
            clients[LARGE] = _HandleClient(large, self._live.count, self._live.recount, LARGE)
        super().__init__(config, clients, caps=self._cap, share_predictor=where is not None)
        self._small = small
        self._epoch: str | None = None
        self._sync_task: asyncio.Task[None] | None = None
        if where is not None:
            self.listeners.append(RayRouterMetrics())
            loop = asyncio.get_event_loop()
            self._sync_task = loop.create_task(self._sync_predictor_forever())

    def _cap(self, model: str) -> int:
        deployment = self._deployments.get(model, "")
        view = self._live.view(deployment)
        per_replica = self.config.max_in_flight_per_replica.get(model) or (
            view.max_ongoing_requests if view and view.max_ongoing_requests else None
        )
        return share_of_cap(
            per_replica or FALLBACK_PER_REPLICA,
            view.running if view else None,
            self._live.count(self._host) if self._host else None,
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

    def close(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()


class SharedLengthPredictor(PredictorStore):
    """The deployment-scoped actor behind PREDICTOR_ACTOR (plain class; Ray wraps it)."""


def predictor_store(config: RouterConfig, resources: dict[str, float] | None = None) -> Any:
    """The deployment actor that merges the hosting replicas' length predictors; the
    deployment that hosts the router lists it in ``deployment_actors``."""
    import ray
    from ray.serve.config import DeploymentActorConfig

    snapshot = os.path.expanduser(config.predictor_snapshot) if config.predictor_snapshot else None
    placed = config.predictor_resources
    return DeploymentActorConfig(
        name=PREDICTOR_ACTOR,
        actor_class=ray.remote(SharedLengthPredictor),
        init_kwargs={
            "default_tokens": config.predictor_default_tokens,
            "snapshot_path": snapshot,
        },
        actor_options={
            "num_cpus": 0.01,
            "resources": dict(placed) if placed is not None else actor_resources(resources),
        },
    )


# By default the actor follows its hosts onto the same node type but must not take one of
# their units: with `carpool_ingress: 1` per ingress replica, a whole unit for the actor left
# the last replica of a fully packed head without one (generate stayed DEPLOYING).
ACTOR_RESOURCE_SHARE = 0.01


def actor_resources(resources: dict[str, float] | None) -> dict[str, float]:
    """The hosting replica's custom resources, each cut to a token share: same nodes, no unit."""
    return {name: min(amount, ACTOR_RESOURCE_SHARE) for name, amount in (resources or {}).items()}
