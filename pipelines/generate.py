"""``/generate``: OpenAI-compatible completions and chat over the small and large generators.

``POST /generate/v1/completions`` and ``POST /generate/v1/chat/completions`` (streamed as
server-sent events with ``stream: true``), ``GET /generate/v1/models``. ``model`` picks the
deployment: ``small``, ``large`` or ``auto`` (the router), or the served name of either;
omitted, ``default_model``.

Two shapes, one set of routes (``generate_api``) over one handler (``GenerateHandler``):
a separate ingress deployment in front of the generators (the default), or, with
``direct_streaming``, the small generator's replicas serving the HTTP themselves, as Ray
Serve LLM's direct streaming does: the small model's tokens then reach Serve's proxy
straight from the replica that generates them.

``model: "auto"`` is decided in the ingress process itself (``router.deployment.HostedRouter``):
no router deployment, so a request for auto crosses one Ray hop to the chosen generator, as
one naming a model does. Other apps (the OpenAI URL, rag) reach the router through the
ingress's ``route_*`` methods (``RouterHandle``).

``serve run pipelines.generate:app`` serves it alone; the default serve config deploys it
with the other pipelines.
"""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from carpool.auth import health_body
from carpool.calls import call_backend
from carpool.generation.hops import GenerationEvent, GenerationResult
from carpool.generation.responses import ChatCompletionResponse, CompletionResponse
from carpool.generation.schemas import ChatCompletionRequest, CompletionRequest, GenerationCall
from carpool.http import MAX_BODY_BYTES, apply_ingress_defaults, make_api
from carpool.local_handle import LocalHandle
from carpool.schemas import ModelList
from deployments.generator import GeneratorDeployment, build_generator_deployment
from pipelines.generate_handler import (
    DIRECT_INGRESS,
    GENERATE_INGRESS,
    TIERS,
    GenerateArgs,
    GenerateHandler,
)
from pipelines.placement import haproxy_enabled, with_placement_router
from pipelines.router_access import ROUTER_DEPLOYMENT
from router.deployment import HostedRouter, predictor_store

__all__ = [
    "DIRECT_INGRESS",
    "GENERATE_INGRESS",
    "ROUTER_DEPLOYMENT",
    "TIERS",
    "DirectGenerateIngress",
    "GenerateArgs",
    "GenerateHandler",
    "GenerateIngress",
    "build_generate_app",
    "generate_api",
]


def generate_api(handler: GenerateHandler) -> FastAPI:
    """The pipeline's HTTP routes over ``handler``; built in the replica that serves them."""
    api = make_api(
        "carpool generate",
        "OpenAI-compatible completions and chat completions with continuous batching.",
        MAX_BODY_BYTES,
    )

    @api.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest) -> Any:
        return await handler.completion_response(body)

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        return await handler.chat_response(body)

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=await handler.model_cards())

    @api.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        """Engine figures of one replica per model (the one each call reaches)."""
        return {
            tier: await call_backend(tier, handle.stats.remote())
            for tier, handle in handler.handles.items()
        }

    @api.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return health_body()  # {"status": "ok"}, plus warnings when open to anyone

    return api


class RouterHost:
    """What an ingress hosting the router gives other apps: ``auto`` as a handle's methods.

    ``route_generate`` / ``route_stream`` / ``route_describe`` answer as a generator's
    ``generate`` / ``stream`` / ``describe`` do (``RouterHandle`` maps them): a
    ``GenerationCall`` in, a ``GenerationResult`` or ``GenerationEvent``s out, with this
    replica's router's ``RouteDecision`` in them; ``route_stats`` reads the router.
    """

    router: HostedRouter | None = None

    def _host_router(self, args: GenerateArgs, small: Any, large: Any) -> LocalHandle | None:
        """Starts this replica's router (none with ``router: null``); the handler's ``auto``."""
        self.router = HostedRouter(args.router, small, large) if args.router is not None else None
        return LocalHandle(self.router) if self.router is not None else None

    def _stop_router(self) -> None:
        if self.router is not None:
            self.router.close()

    def _router(self) -> HostedRouter:
        if self.router is None:
            raise RuntimeError("this generate app has no router (args.router: null)")
        return self.router

    async def route_generate(self, call: GenerationCall) -> GenerationResult:
        return await self._router().generate(call)

    async def route_stream(self, call: GenerationCall) -> AsyncIterator[GenerationEvent]:
        async for event in self._router().stream(call):
            yield event

    async def route_describe(self) -> dict[str, Any]:
        return await self._router().describe()

    def route_stats(self) -> dict[str, Any]:
        """This replica's router: in-flight caps and counts, what its predictor has seen."""
        return self._router().stats()


@serve.ingress()
class GenerateIngress(RouterHost, GenerateHandler):
    """HTTP front of the generate pipeline: validates, picks the model, formats, streams.

    It hosts the router: ``auto`` is decided here and goes straight to the chosen generator.
    """

    def __init__(
        self,
        small: DeploymentHandle,
        large: DeploymentHandle | None,
        args: dict[str, Any],
    ) -> None:
        parsed = GenerateArgs.model_validate(args)
        auto = self._host_router(parsed, small, large)
        GenerateHandler.__init__(self, small, large, parsed, auto)

    def __serve_build_asgi_app__(self) -> FastAPI:
        api = generate_api(self)
        apply_ingress_defaults(api, self.args.ingress)
        return api

    def __del__(self) -> None:
        self._stop_router()


@serve.ingress()
class DirectGenerateIngress(RouterHost, GeneratorDeployment):
    """The small generator serving the pipeline's HTTP itself (``direct_streaming``).

    Its own model is called in-process (``LocalHandle``), and so is the router it hosts: an
    ``auto`` request answered by small never leaves this process; large is reached over a
    handle. Other apps (the OpenAI URL, rag) still reach it as the ``small`` deployment, and
    ``auto`` through ``route_*``. The ingress's own niceness is not applied: this process
    generates.
    """

    def __init__(
        self,
        config: dict[str, Any],
        large: DeploymentHandle | None,
        args: dict[str, Any],
    ) -> None:
        GeneratorDeployment.__init__(self, config)
        parsed = GenerateArgs.model_validate(args)
        own = LocalHandle(self)
        self.http = GenerateHandler(own, large, parsed, self._host_router(parsed, own, large))

    def __serve_build_asgi_app__(self) -> FastAPI:
        api = generate_api(self.http)
        apply_ingress_defaults(api, self.http.args.ingress, own_process=False)
        return api

    def settings(self) -> dict[str, Any]:
        return self.http.settings()

    async def __del__(self) -> None:  # type: ignore[override]
        # Serve awaits it: the router's sync stops, the engine is closed, then the HTTP
        # app's lifespan ends.
        self._stop_router()
        GeneratorDeployment.__del__(self)
        lifespan = getattr(self, "_serve_asgi_lifespan", None)
        if lifespan is not None:
            await lifespan.shutdown()


def build_generate_app(args: dict[str, Any] | None = None) -> Application:
    """The generate pipeline: ingress (hosting the router) -> small and large generators."""
    parsed = GenerateArgs.model_validate(args or {})
    large = build_generator_deployment(parsed.large, "large") if parsed.large else None
    placement = parsed.placement
    if parsed.direct_streaming:
        direct = build_generator_deployment(
            parsed.small,
            DIRECT_INGRESS,
            DirectGenerateIngress,
            (large, parsed.model_dump()),
            deployment_actors=_router_actors(parsed, parsed.small.replica.resources),
            request_router=placement.request_router_config(),
        )
        # Under HAProxy, HAProxy asks the placement router; under Serve's Python proxy, the
        # proxy's handle runs the deployment's request router itself.
        return with_placement_router(direct, placement) if haproxy_enabled() else direct
    small = build_generator_deployment(
        parsed.small, "small", request_router=placement.request_router_config()
    )
    options = parsed.ingress.serve_options(GENERATE_INGRESS)
    actors = _router_actors(parsed, parsed.ingress.resources)
    if actors:
        options["deployment_actors"] = actors
    ingress = serve.deployment(GenerateIngress).options(**options)
    return ingress.bind(small, large, parsed.model_dump())


def _router_actors(parsed: GenerateArgs, resources: dict[str, float]) -> list[Any]:
    """The length predictors' merge actor, declared by the deployment hosting the router."""
    return [predictor_store(parsed.router, resources)] if parsed.router is not None else []


app = build_generate_app
