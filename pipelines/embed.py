"""``/embed``: OpenAI-compatible embeddings over the batched embedder deployment.

``serve run pipelines.embed:app`` serves it alone; the default serve config deploys it with
the other pipelines.
"""

import base64
import time
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import Field
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from carpool.admission import current_controls
from carpool.auth import health_body
from carpool.calls import call_backend, call_idempotent
from carpool.config import IngressConfig, StrictModel
from carpool.errors import RequestError
from carpool.http import MAX_BODY_BYTES, apply_ingress_defaults, make_api
from carpool.local_handle import LocalHandle
from carpool.schemas import (
    EmbeddingRequest,
    EmbeddingResponse,
    ModelList,
)
from deployments.embedder import (
    EmbedderConfig,
    EmbeddingDeployment,
    EmbedResult,
    build_embedding_deployment,
)
from pipelines.handler import PipelineHandler


class EmbedArgs(StrictModel):
    """Arguments of the embed pipeline (the ``args:`` of its serve config entry)."""

    embedder: EmbedderConfig = Field(default_factory=EmbedderConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    max_inputs_per_request: int = Field(
        default=2048,
        ge=1,
        le=4096,
        description="Most inputs one request may carry (OpenAI's limit, 2048, by default: "
        "clients such as LangChain send up to 1000). The 16 MiB body limit and the replica's "
        "admission bound the work one request can bring.",
    )
    max_chars_per_input: int = Field(
        default=32_000,
        ge=1,
        le=1_000_000,
        description="Longest text accepted, in characters (bounds tokenizer work per request).",
    )
    direct_ingress: bool = Field(
        default=False,
        description="The embedder's replicas serve this app's HTTP themselves: a request goes "
        "HAProxy -> embedder replica, with no separate ingress process and no Ray hop "
        "(benchmarks/PATH.md). HTTP capacity then follows the embedder's replica count, and a "
        "lost embedder replica takes the requests it holds: off in the cluster configs, where "
        "the embedder sits on GPU workers and the ingresses on the head. `ingress` then only "
        "sets the default deadline.",
    )


# Deployment names other apps find this pipeline's parts by (serve.get_deployment_handle).
EMBED_INGRESS = "embed_ingress"
EMBEDDER_DEPLOYMENT = "embedder"


def encode_vector(vector: Any, encoding_format: str) -> np.ndarray | str:
    """A vector as float32: base64 of its little-endian bytes, or the array itself, which
    ``embedding_body`` writes as JSON numbers."""
    f32 = np.ascontiguousarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(f32.tobytes()).decode("ascii")
    return f32


def embedding_body(result: EmbedResult, encoding_format: str) -> bytes:
    """The ``/v1/embeddings`` body (the shape of ``EmbeddingResponse``), serialized once.

    Building the pydantic response and dumping it through the stdlib json cost the ingress
    ~0.9 ms of CPU for five MiniLM vectors on a quiet core (every float widened to a Python
    float and written with 17 digits), about a tenth of the ~10 ms an embed request cost it
    under mixed load (benchmarks/PEERS.md, "Where the CPU goes with both at once"); orjson
    writes the float32 arrays directly, each number at its shortest form that reads back as
    the same float32 (about half the bytes for Ray's proxy to forward), in ~0.05 ms.
    """
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": encode_vector(vector, encoding_format),
            "truncated": cut,
        }
        for i, (vector, cut) in enumerate(zip(result.vectors, result.truncated, strict=True))
    ]
    tokens = sum(result.token_counts)
    body = {
        "object": "list",
        "data": data,
        "model": result.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def served_model_name(args: EmbedArgs) -> str:
    """The name ``model`` takes for this app's embedder (pure: pipelines.direct_routes)."""
    return args.embedder.source.served_model_name or "embedder"


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise RequestError(
            404,
            f"model {requested!r} is not served here; use {served!r} or omit model",
            param="model",
            code="model_not_found",
        )


class EmbedHandler(PipelineHandler):
    """The embed pipeline's request handling over an embedder handle.

    The embed app's ingress and the OpenAI app (``pipelines.openai_api``) both answer with it,
    so a request is checked, limited and answered the same whichever URL it came in by.
    """

    def __init__(self, embedder: DeploymentHandle, args: EmbedArgs, created: int | None = None):
        self.args = args
        self.embedder = embedder
        self.model_name = served_model_name(args)
        self.created = created or int(time.time())

    @classmethod
    def attach(cls, app: str, settings: dict[str, Any]) -> "EmbedHandler":
        """The handler of a running embed app, from its ingress's ``settings()``."""
        embedder = serve.get_deployment_handle(EMBEDDER_DEPLOYMENT, app_name=app)
        return cls(embedder, EmbedArgs.model_validate(settings["args"]), settings["created"])

    async def embed_response(self, body: EmbeddingRequest) -> Response:
        check_model(body.model, self.model_name)
        if body.dimensions is not None:
            raise RequestError(
                400,
                "dimensions is not supported: this model always returns its full size; "
                "remove dimensions (and cut vectors client-side if you must)",
                param="dimensions",
            )
        count = body.count()
        if count > self.args.max_inputs_per_request:
            raise RequestError(
                400,
                f"input has {count} items; this server takes at most "
                f"{self.args.max_inputs_per_request} per request: split it into several "
                f"requests (LangChain OpenAIEmbeddings: chunk_size="
                f"{self.args.max_inputs_per_request} or less)",
                param="input",
            )
        controls = current_controls()
        if body.is_token_ids():
            ids = body.token_ids()
            result: EmbedResult = await call_idempotent(
                "embedder", lambda: self.embedder.embed_tokens.remote(ids, body.truncate, controls)
            )
        else:
            texts = body.texts()
            for i, text in enumerate(texts):
                if len(text) > self.args.max_chars_per_input:
                    raise RequestError(
                        413,
                        f"input[{i}] has {len(text)} characters; send at most "
                        f"{self.args.max_chars_per_input} (split it, or raise the embed app's "
                        "max_chars_per_input)",
                        param=f"input[{i}]",
                    )
            result = await call_idempotent(
                "embedder", lambda: self.embedder.embed.remote(texts, body.truncate, controls)
            )
        body_bytes = embedding_body(result, body.encoding_format)
        return Response(body_bytes, media_type="application/json")


def embed_api(handler: EmbedHandler) -> FastAPI:
    """The pipeline's HTTP routes over ``handler``; built in the replica that serves them."""
    api = make_api(
        "carpool embed",
        "OpenAI-compatible embeddings with length-aware dynamic batching.",
        MAX_BODY_BYTES,
    )

    @api.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(body: EmbeddingRequest) -> Response:
        return await handler.embed_response(body)

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[handler.model_card()])

    @api.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        """Batching figures of one embedder replica (the one this call reaches)."""
        return await call_backend("embedder", handler.embedder.stats.remote())

    @api.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return health_body()  # {"status": "ok"}, plus warnings when open to anyone

    return api


@serve.ingress()
class EmbedIngress(EmbedHandler):
    """HTTP front of the embed pipeline: validates, forwards, formats."""

    def __init__(self, embedder: DeploymentHandle, args: dict[str, Any]) -> None:
        super().__init__(embedder, EmbedArgs.model_validate(args))

    def __serve_build_asgi_app__(self) -> FastAPI:
        api = embed_api(self)
        apply_ingress_defaults(api, self.args.ingress)
        return api


@serve.ingress()
class DirectEmbedIngress(EmbeddingDeployment):
    """The embedder serving the pipeline's HTTP itself (``direct_ingress``).

    Its own model is called in-process (``LocalHandle``): a request is parsed, batched with
    the others in this replica and answered here, with no Ray hop. Other apps (search, rag,
    the OpenAI URL) still reach it as the ``embedder`` deployment. The ingress's own niceness
    is not applied: this process computes.
    """

    def __init__(self, config: dict[str, Any], args: dict[str, Any]) -> None:
        EmbeddingDeployment.__init__(self, config)
        self.http = EmbedHandler(LocalHandle(self), EmbedArgs.model_validate(args))

    def __serve_build_asgi_app__(self) -> FastAPI:
        api = embed_api(self.http)
        apply_ingress_defaults(api, self.http.args.ingress, own_process=False)
        return api

    def settings(self) -> dict[str, Any]:
        return self.http.settings()


def build_embed_app(args: dict[str, Any] | None = None) -> Application:
    """The embed pipeline: ingress -> embedder, or the embedder alone (``direct_ingress``)."""
    parsed = EmbedArgs.model_validate(args or {})
    # Without the batching knobs: they reach the model replica as user_config, and the ingress
    # must not restart when only they change.
    http_args = parsed.model_dump(exclude={"embedder": {"batching"}})
    if parsed.direct_ingress:
        return build_embedding_deployment(
            parsed.embedder, EMBEDDER_DEPLOYMENT, DirectEmbedIngress, (http_args,)
        )
    embedder = build_embedding_deployment(parsed.embedder, EMBEDDER_DEPLOYMENT)
    ingress = serve.deployment(EmbedIngress).options(**parsed.ingress.serve_options(EMBED_INGRESS))
    return ingress.bind(embedder, http_args)


app = build_embed_app
