"""Which replica of ``small`` an HTTP request reaches: HAProxy asks carpool's router.

With ``direct_streaming`` the small generator's replicas serve ``/generate`` themselves and
HAProxy picks among them. By default (``policy: leastconn``) it picks the one with the fewest
open connections, blind to prompts. With ``policy: cost`` (or ``ray_prefix``, for
comparison) the deployment gets an ingress request router (Ray 2.60's hook, the one Ray
Serve LLM's direct streaming uses): HAProxy's Lua hands each POST's body to
``PlacementRouter`` at ``/internal/route``, which runs the deployment's request router
(``router.replica_router.CarpoolRequestRouter``: the cheapest replica given the prefix it
has cached and the work it holds) and answers the replica's id; HAProxy then sends the
request straight to that replica. The request itself still crosses no Ray hop; the
decision is one local HTTP call. A body HAProxy could not read whole (over its buffer) or
that is not JSON is placed by load alone; the replica then answers it as before (a 400 for
bad JSON). Handle calls to ``small`` from other apps run the same request router in their
own process.
"""

import json
from types import SimpleNamespace
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import Field
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from carpool.config import StrictModel

ROUTER_CLASSES = {
    "cost": "router.replica_router:CarpoolRequestRouter",
    "ray_prefix": "router.ray_prefix_router:RayPrefixRouter",
}
PLACEMENT_ROUTER = "placement_router"


class PlacementArgs(StrictModel):
    """How requests to the small generator's replicas are placed (``args.placement``)."""

    policy: Literal["leastconn", "cost", "ray_prefix"] = Field(
        default="cost",
        description="leastconn: HAProxy's fewest connections (prompt-blind); cost: carpool's "
        "router, cheapest replica by uncached prefill + queued work + output; ray_prefix: Ray "
        "Serve LLM's PrefixCacheAffinityRouter (for comparison).",
    )
    block_chars: int = Field(
        default=64,
        ge=16,
        le=65536,
        description="cost: characters per hashed prompt block (about vLLM's 16-token block).",
    )
    chars_per_token: float = Field(
        default=4.0, gt=0, le=32, description="cost: characters per token, to size caches."
    )
    prefill_weight: float = Field(
        default=1.0,
        gt=0,
        le=10,
        description="cost: what a prompt token to prefill weighs (the request's own uncached "
        "part, and the prompts waiting on the replica), against decode_weight per output "
        "token still to decode there.",
    )
    decode_weight: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description="cost: what an output token still to decode on a replica weighs. At 1 "
        "load and cached prefix balance; near 0 the prefix wins and conversations pile onto "
        "the replicas that hold them (benchmarks/ROUTING.md).",
    )
    default_output_tokens: float = Field(
        default=128, gt=0, le=65536, description="cost: output assumed without max_tokens."
    )
    stats_period_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="How often each request router reads each replica's pending tokens "
        "(Serve's request_routing_stats_period_s); between reads it adds what it sent.",
    )
    router_num_cpus: float = Field(
        default=0, ge=0, le=8, description="CPU reserved for the placement router replica."
    )

    def request_router_config(self) -> RequestRouterConfig | None:
        """Serve's request router for the generator deployment; None: Serve's default."""
        if self.policy == "leastconn":
            return None
        kwargs: dict[str, Any] = {}
        if self.policy == "cost":
            kwargs = {
                "block_chars": self.block_chars,
                "chars_per_token": self.chars_per_token,
                "prefill_weight": self.prefill_weight,
                "decode_weight": self.decode_weight,
                "default_output_tokens": self.default_output_tokens,
            }
        return RequestRouterConfig(
            request_router_class=ROUTER_CLASSES[self.policy],
            request_router_kwargs=kwargs,
            request_routing_stats_period_s=self.stats_period_s,
            request_routing_stats_timeout_s=min(self.stats_period_s, 1.0),
        )


def routing_payload(body: bytes) -> SimpleNamespace | None:
    """The OpenAI body as attributes (what request routers read), or None: place by load."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    return SimpleNamespace(**data)


router_api = FastAPI()


@serve.ingress(router_api)
class PlacementRouter:
    """HAProxy's ``/internal/route``: the body in, the chosen replica's id out."""

    def __init__(self, server: DeploymentHandle) -> None:
        self.handle = server
        self.handle._init()

    @router_api.post("/internal/route")
    async def route(self, request: Request) -> dict[str, Any]:
        payload = routing_payload(await request.body())
        args = (payload,) if payload is not None else ()
        try:
            # _reserve=False: the request goes out through HAProxy, not this handle, so no
            # slot is held for it here (as Ray Serve LLM's router does).
            async with self.handle.choose_replica(*args, _reserve=False) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    raise RuntimeError(f"replica {selection.replica_id} has no HTTP endpoint")
                host, port = endpoint
                return {
                    "host": host,
                    "port": port,
                    "replica_id": replica.replica_id.to_full_id_str(),
                }
        except (RuntimeError, DeploymentUnavailableError) as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from None

    @router_api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}


def haproxy_enabled() -> bool:
    """Whether Serve's HTTP runs on HAProxy, as Ray's own build check reads it where the app
    is built (``serve run``: the controller, whose environment Ray started with; a driver's
    ``serve.run``: that process, which must set the variable before importing Serve)."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_ENABLE_HA_PROXY)


def with_placement_router(app: Application, placement: PlacementArgs) -> Application:
    """``app`` (the direct-streaming generator) with HAProxy asking the router, or as is."""
    if placement.policy == "leastconn":
        return app
    router = serve.deployment(PlacementRouter).options(
        name=PLACEMENT_ROUTER,
        # On the ingress hot path: never the limit (Ray Serve LLM's router takes 1000).
        max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": placement.router_num_cpus},
    )
    return app._with_ingress_request_router(router.bind(app))
