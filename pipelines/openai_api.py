"""One OpenAI-compatible base URL for every model: ``/v1/*`` and Cohere's ``/v2/rerank``.

``GET /v1/models`` lists every served model (embedder, ranker, small, large, auto, rag), and
``/v1/embeddings``, ``/v1/rerank``, ``/v2/rerank``, ``/v1/completions`` and
``/v1/chat/completions`` route by the request's ``model`` to the pipeline that serves it, as
vLLM's and Ray Serve LLM's OpenAI servers do. The per-pipeline apps (``/embed``, ``/rank``,
``/generate``, ``/rag``) keep serving at their own prefixes.

This app owns no model. It reaches the other apps' deployments by name, so their batches are
shared, and it answers with the same handler classes as their ingresses, built from the
``settings()`` their ingresses report. Limits, served names, defaults and every field's
handling are therefore the per-pipeline apps' own, with no second copy in this app's config.
"""

import asyncio
import contextvars
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from ray import serve
from ray.serve.deployment import Application

from carpool.auth import health_body
from carpool.calls import call_backend
from carpool.config import IngressConfig, StrictModel
from carpool.errors import RequestError
from carpool.generation.schemas import ChatCompletionRequest, CompletionRequest
from carpool.http import MAX_BODY_BYTES, apply_ingress_defaults, make_api
from carpool.schemas import CohereRerankRequest, EmbeddingRequest, RerankRequest
from pipelines import embed, generate, rag, rank

logger = logging.getLogger(__name__)


class OpenAIArgs(StrictModel):
    """Arguments of the OpenAI app (the ``args:`` of its serve config entry).

    Only which apps to front: each app's own args (limits, model names, defaults) apply to
    requests that reach it through this one.
    """

    embed_app: str | None = Field(
        default="embed", description="App whose embedder answers /v1/embeddings; null: none."
    )
    rank_app: str | None = Field(
        default="rank", description="App whose ranker answers /v1/rerank and /v2/rerank."
    )
    generate_app: str | None = Field(
        default="generate",
        description="App whose generators (small, large, auto) answer /v1/completions and "
        "/v1/chat/completions.",
    )
    rag_app: str | None = Field(
        default="rag", description="App whose RAG pipeline answers chat for its model name."
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    def apps(self) -> dict[str, str]:
        """Pipeline kind -> the Serve app that hosts it, for the kinds this app fronts."""
        named = {
            "embed": self.embed_app,
            "rank": self.rank_app,
            "generate": self.generate_app,
            "rag": self.rag_app,
        }
        return {kind: app for kind, app in named.items() if app is not None}


@dataclass(frozen=True)
class Pipeline:
    """How to reach one kind of pipeline in another app."""

    ingress: tuple[str, ...]  # the app's ingress deployment, by each name it may have
    handler: Any  # a *Handler class with attach(app, settings)


PIPELINES: dict[str, Pipeline] = {
    "embed": Pipeline((embed.EMBED_INGRESS, embed.EMBEDDER_DEPLOYMENT), embed.EmbedHandler),
    "rank": Pipeline((rank.RANK_INGRESS,), rank.RankHandler),
    "generate": Pipeline(
        (generate.GENERATE_INGRESS, generate.DIRECT_INGRESS), generate.GenerateHandler
    ),
    "rag": Pipeline((rag.RAG_INGRESS,), rag.RagHandler),
}

# Which pipelines answer at each endpoint, the default (for an omitted model) first. Chat:
# generate's names are matched before rag's, so a rag app named like a generator tier is
# still reachable at its own /rag prefix, never ambiguous here.
ENDPOINT_PIPELINES: dict[str, tuple[str, ...]] = {
    "/v1/embeddings": ("embed",),
    "/v1/rerank": ("rank",),
    "/v2/rerank": ("rank",),
    "/v1/completions": ("generate",),
    "/v1/chat/completions": ("generate", "rag"),
}

# How long a pipeline's settings are trusted before they are read again: an app redeployed
# with new args (limits, model names) is followed within this, at one small call per period.
SETTINGS_TTL_S = 10.0
# How long a pipeline's ingress may take to report its settings before the request that
# needed them gets a 503 (an app being deployed, or one that was deleted).
SETTINGS_TIMEOUT_S = 10.0


def _ingress_handle(names: tuple[str, ...], app: str) -> Any:
    """A handle to ``app``'s ingress: the first of ``names`` deployed there (KeyError if none)."""
    for name in names[:-1]:
        try:
            return serve.get_deployment_handle(name, app_name=app)
        except KeyError:
            continue
    return serve.get_deployment_handle(names[-1], app_name=app)


def pick_pipeline(
    endpoint: str,
    requested: str | None,
    served: Mapping[str, Sequence[str]],
    unreachable: Mapping[str, str] | None = None,
) -> str:
    """Which pipeline answers ``model: requested`` at ``endpoint``.

    ``served`` maps each reachable pipeline to the names its ``model`` may take;
    ``unreachable`` maps a pipeline whose app did not answer to why. An omitted model goes
    to the endpoint's default pipeline, whose own default then applies, as at its prefix.
    Pure (no Ray), so routing is unit-tested on its own.
    """
    kinds = ENDPOINT_PIPELINES[endpoint]
    here = [k for k in kinds if k in served]
    if requested is None and here:
        return here[0]
    for kind in here:
        if requested in served[kind]:
            return kind
    down = [f"{k}: {why}" for k, why in (unreachable or {}).items() if k in kinds]
    if down:
        raise RequestError(
            503,
            f"model {requested!r} is not among those reachable at {endpoint} now, and an app "
            f"that may serve it did not answer ({'; '.join(down)}); retry shortly",
            param="model",
            code="backend_unavailable",
            retry_after_s=1.0,
        )
    valid = sorted({name for k in here for name in served[k]})
    if not valid:
        raise RequestError(
            404,
            f"no model is served at {endpoint} by this deployment (its app is not configured "
            f"in the OpenAI app's args); see GET /v1/models",
            param="model",
            code="model_not_found",
        )
    elsewhere = [
        other
        for other, others in ENDPOINT_PIPELINES.items()
        if other != endpoint and any(requested in served.get(k, ()) for k in others)
    ]
    hint = f" ({requested!r} is served at {', '.join(elsewhere)})" if elsewhere else ""
    raise RequestError(
        404,
        f"model {requested!r} is not served at {endpoint}; use one of {valid}{hint}",
        param="model",
        code="model_not_found",
    )


def validate_body(schema: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` as ``schema``; a bad field gets the same 400 as at the pipeline's own prefix.

    Chat bodies are read as plain JSON and validated here, once the model says whose schema
    applies (generate's and rag's differ in what they honour and refuse).
    """
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def requested_model(body: dict[str, Any]) -> str | None:
    """The body's ``model`` for routing; a non-string goes to the default pipeline, whose
    schema then refuses it by name."""
    model = body.get("model")
    return model if isinstance(model, str) else None


api = make_api(
    "carpool OpenAI",
    "One OpenAI-compatible base URL: every carpool model at /v1, routed by `model`; "
    "Cohere's rerank at /v2/rerank.",
    MAX_BODY_BYTES,
)


@serve.ingress(api)
class OpenAIIngress:
    """HTTP front of every pipeline at once: routes by ``model`` to the pipelines' handlers."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = OpenAIArgs.model_validate(args)
        apply_ingress_defaults(api, self.args.ingress)
        # kind -> (handler, monotonic time its settings were read)
        self._attached: dict[str, tuple[Any, float]] = {}
        self._locks = {kind: asyncio.Lock() for kind in PIPELINES}
        self._refreshing: dict[str, asyncio.Task[None]] = {}

    async def _attach(self, kind: str, app: str) -> Any:
        """A handler for ``kind`` built from the settings ``app``'s ingress reports now."""
        pipeline = PIPELINES[kind]
        try:
            # By name at first use: apps deploy in any order (as the rag app does).
            ingress = _ingress_handle(pipeline.ingress, app)
            # Bounded: a handle to a deleted app waits for replicas that never come. (A
            # timeout scope: wait_for can lose a cancellation on CPython 3.11, gh-86296.)
            async with asyncio.timeout(SETTINGS_TIMEOUT_S):
                settings = await call_backend(f"{app} app", ingress.settings.remote())
            return pipeline.handler.attach(app, settings)
        except KeyError:
            why = "is not deployed"
        except TimeoutError:
            why = f"did not report its settings within {SETTINGS_TIMEOUT_S:.0f} s"
        raise RequestError(
            503,
            f"the {app!r} app {why}; deploy it, or name the app that serves {kind} in this "
            f"app's {kind}_app (null to serve without it)",
            code="backend_unavailable",
            retry_after_s=1.0,
        )

    async def _handler(self, kind: str, app: str) -> Any:
        """The pipeline's handler: built at first use, then refreshed in the background.

        Requests never wait for a refresh: stale settings serve until the new ones are read
        (a redeploy changes them rarely, and the deployments answer meanwhile).
        """
        cached = self._attached.get(kind)
        if cached is None:
            async with self._locks[kind]:  # the first requests wait for one lookup, not many
                if kind not in self._attached:
                    self._attached[kind] = (await self._attach(kind, app), time.monotonic())
                return self._attached[kind][0]
        if time.monotonic() - cached[1] >= SETTINGS_TTL_S and kind not in self._refreshing:
            # In a fresh context: not bound by the deadline of the request that noticed.
            self._refreshing[kind] = asyncio.create_task(
                self._refresh(kind, app), context=contextvars.Context()
            )
        return cached[0]

    async def _refresh(self, kind: str, app: str) -> None:
        try:
            self._attached[kind] = (await self._attach(kind, app), time.monotonic())
        except Exception as exc:
            # A redeploy in progress: the last settings still describe what serves.
            logger.warning(
                "%s app %r: settings not refreshed (%s); keeping the last", kind, app, exc
            )
            self._attached[kind] = (self._attached[kind][0], time.monotonic())
        finally:
            self._refreshing.pop(kind, None)

    async def _handlers(self, kinds: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
        """Handlers of these pipelines (those configured), and why any could not be reached."""
        found: dict[str, Any] = {}
        unreachable: dict[str, str] = {}
        apps = self.args.apps()
        for kind in kinds:
            if kind not in apps:
                continue
            try:
                found[kind] = await self._handler(kind, apps[kind])
            except RequestError as exc:
                unreachable[kind] = exc.message
        return found, unreachable

    async def _route(self, endpoint: str, requested: str | None) -> tuple[str, Any]:
        """The pipeline kind and handler that answer ``model: requested`` at ``endpoint``."""
        handlers, unreachable = await self._handlers(ENDPOINT_PIPELINES[endpoint])
        served = {kind: handler.served_names() for kind, handler in handlers.items()}
        try:
            kind = pick_pipeline(endpoint, requested, served, unreachable)
        except RequestError as exc:
            if exc.status_code != 404:
                raise
            # A name not served here: ask every pipeline, so the 404 can say where it is.
            everywhere, _ = await self._handlers(list(PIPELINES))
            served = {kind: handler.served_names() for kind, handler in everywhere.items()}
            kind = pick_pipeline(endpoint, requested, served, unreachable)
        return kind, handlers[kind]

    @api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest) -> Response:
        _, handler = await self._route("/v1/embeddings", body.model)
        return await handler.embed_response(body)

    @api.post("/v1/rerank")
    async def rerank(self, body: RerankRequest) -> JSONResponse:
        _, handler = await self._route("/v1/rerank", body.model)
        return await handler.rerank_response(body)

    @api.post("/v2/rerank")
    async def rerank_v2(self, body: CohereRerankRequest) -> JSONResponse:
        """Cohere's v2 rerank (``cohere.ClientV2(base_url=<this server's root>)``)."""
        _, handler = await self._route("/v2/rerank", body.model)
        return await handler.cohere_rerank_response(body)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Any:
        _, handler = await self._route("/v1/completions", body.model)
        return await handler.completion_response(body)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: dict[str, Any]) -> Any:
        """OpenAI chat: a generator's (small, large, auto) or the RAG pipeline's, by ``model``.

        The body is /generate's chat request or /rag's, whichever pipeline the model names.
        """
        kind, handler = await self._route("/v1/chat/completions", requested_model(body))
        schema = rag.RagChatRequest if kind == "rag" else ChatCompletionRequest
        return await handler.chat_response(validate_body(schema, body))

    @api.get("/v1/models")
    async def models(self) -> JSONResponse:
        """Every model this URL serves, each pipeline's cards as at its own prefix.

        An app that does not answer is left out and named in ``x-carpool-unreachable``.
        """
        handlers, unreachable = await self._handlers(list(PIPELINES))
        cards: list[dict[str, Any]] = []
        for handler in handlers.values():
            cards += [card.model_dump() for card in await handler.model_cards()]
        headers = {"x-carpool-unreachable": ",".join(sorted(unreachable))} if unreachable else None
        return JSONResponse({"object": "list", "data": cards}, headers=headers)

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return health_body()  # {"status": "ok"}, plus warnings when open to anyone


def build_openai_app(args: dict[str, Any] | None = None) -> Application:
    """The OpenAI app: one ingress over the other apps' deployments (no model of its own)."""
    parsed = OpenAIArgs.model_validate(args or {})
    ingress = serve.deployment(OpenAIIngress).options(
        **parsed.ingress.serve_options("openai_ingress")
    )
    return ingress.bind(parsed.model_dump())


app = build_openai_app
