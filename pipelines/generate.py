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

``serve run pipelines.generate:app`` serves it alone; the default serve config deploys it
with the other pipelines.
"""

from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from carpool.auth import health_body
from carpool.generation.responses import ChatCompletionResponse, CompletionResponse
from carpool.generation.schemas import ChatCompletionRequest, CompletionRequest
from carpool.http import MAX_BODY_BYTES, apply_ingress_defaults, call_backend, make_api
from carpool.local_handle import LocalHandle
from carpool.schemas import ModelList
from deployments.generator import GeneratorDeployment, build_generator_deployment
from pipelines.generate_handler import (
    DIRECT_INGRESS,
    GENERATE_INGRESS,
    ROUTER_DEPLOYMENT,
    TIERS,
    GenerateArgs,
    GenerateHandler,
)
from router.deployment import build_router_deployment

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


@serve.ingress()
class GenerateIngress(GenerateHandler):
    """HTTP front of the generate pipeline: validates, picks the model, formats, streams."""

    def __init__(
        self,
        small: DeploymentHandle,
        large: DeploymentHandle | None,
        args: dict[str, Any],
        router: DeploymentHandle | None = None,
    ) -> None:
        super().__init__(small, large, GenerateArgs.model_validate(args), router)

    def __serve_build_asgi_app__(self) -> FastAPI:
        api = generate_api(self)
        apply_ingress_defaults(api, self.args.ingress)
        return api


@serve.ingress()
class DirectGenerateIngress(GeneratorDeployment):
    """The small generator serving the pipeline's HTTP itself (``direct_streaming``).

    Its own model is called in-process (``LocalHandle``); large and the router over handles.
    Other apps (the OpenAI URL, rag, the router) still reach it as the ``small`` deployment.
    The ingress's own niceness is not applied: this process generates.
    """

    def __init__(
        self,
        config: dict[str, Any],
        large: DeploymentHandle | None,
        args: dict[str, Any],
        router: DeploymentHandle | None = None,
    ) -> None:
        GeneratorDeployment.__init__(self, config)
        self.http = GenerateHandler(
            LocalHandle(self), large, GenerateArgs.model_validate(args), router
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        api = generate_api(self.http)
        apply_ingress_defaults(api, self.http.args.ingress, own_process=False)
        return api

    def settings(self) -> dict[str, Any]:
        return self.http.settings()

    async def __del__(self) -> None:  # type: ignore[override]
        # Serve awaits it: the engine is closed, then the HTTP app's lifespan ends.
        GeneratorDeployment.__del__(self)
        lifespan = getattr(self, "_serve_asgi_lifespan", None)
        if lifespan is not None:
            await lifespan.shutdown()


def build_generate_app(args: dict[str, Any] | None = None) -> Application:
    """The generate pipeline: ingress -> small generator (+ large generator, + router)."""
    parsed = GenerateArgs.model_validate(args or {})
    large = build_generator_deployment(parsed.large, "large") if parsed.large else None
    if parsed.direct_streaming:
        # The router finds small by name (it cannot bind the deployment that binds it).
        router = build_router_deployment(parsed.router, None, large) if parsed.router else None
        return build_generator_deployment(
            parsed.small,
            DIRECT_INGRESS,
            DirectGenerateIngress,
            (large, parsed.model_dump(), router),
        )
    small = build_generator_deployment(parsed.small, "small")
    router = build_router_deployment(parsed.router, small, large) if parsed.router else None
    ingress = serve.deployment(GenerateIngress).options(
        **parsed.ingress.serve_options(GENERATE_INGRESS)
    )
    return ingress.bind(small, large, parsed.model_dump(), router)


app = build_generate_app
