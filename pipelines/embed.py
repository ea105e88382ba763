"""``/embed``: OpenAI-compatible embeddings over the batched embedder deployment.

``serve run pipelines.embed:app`` serves it alone; the default serve config deploys it with
the other pipelines.
"""

import base64
import time
from typing import Any

import numpy as np
import orjson
from fastapi.responses import Response
from pydantic import Field
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from carpool.auth import health_body
from carpool.config import IngressConfig, StrictModel
from carpool.errors import RequestError
from carpool.http import (
    MAX_BODY_BYTES,
    apply_ingress_defaults,
    call_backend,
    call_idempotent,
    current_controls,
    make_api,
)
from carpool.schemas import (
    EmbeddingRequest,
    EmbeddingResponse,
    ModelList,
)
from deployments.embedder import EmbedderConfig, EmbedResult, build_embedding_deployment
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


# Deployment names other apps find this pipeline's parts by (serve.get_deployment_handle).
EMBED_INGRESS = "embed_ingress"
EMBEDDER_DEPLOYMENT = "embedder"

api = make_api(
    "carpool embed",
    "OpenAI-compatible embeddings with length-aware dynamic batching.",
    MAX_BODY_BYTES,
)


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
    under mixed load (benchmarks/PEERS.md, "Status 2026-11-27, 22:25"); orjson writes the
    float32 arrays directly, each number at its shortest form that reads back as the same
    float32 (about half the bytes for Ray's proxy to forward), in ~0.05 ms.
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
        self.model_name = args.embedder.source.served_model_name or "embedder"
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


@serve.ingress(api)
class EmbedIngress(EmbedHandler):
    """HTTP front of the embed pipeline: validates, forwards, formats."""

    def __init__(self, embedder: DeploymentHandle, args: dict[str, Any]) -> None:
        super().__init__(embedder, EmbedArgs.model_validate(args))
        apply_ingress_defaults(api, self.args.ingress)

    @api.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(self, body: EmbeddingRequest) -> Response:
        return await self.embed_response(body)

    @api.get("/v1/models", response_model=ModelList)
    async def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    @api.get("/v1/stats")
    async def stats(self) -> dict[str, Any]:
        """Batching figures of one embedder replica (the one this call reaches)."""
        return await call_backend("embedder", self.embedder.stats.remote())

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return health_body()  # {"status": "ok"}, plus warnings when open to anyone


def build_embed_app(args: dict[str, Any] | None = None) -> Application:
    """The embed pipeline: ingress -> embedder."""
    parsed = EmbedArgs.model_validate(args or {})
    embedder = build_embedding_deployment(parsed.embedder, EMBEDDER_DEPLOYMENT)
    ingress = serve.deployment(EmbedIngress).options(**parsed.ingress.serve_options(EMBED_INGRESS))
    # Without the batching knobs: they reach the model replica as user_config, and the ingress
    # must not restart when only they change.
    return ingress.bind(embedder, parsed.model_dump(exclude={"embedder": {"batching"}}))


app = build_embed_app
