"""``/rag``: embed -> retrieve -> rerank -> generate, with the answer citing its sources.

Every stage is another app's deployment reached by name: the search app's retriever (one
shared, persisted index), the rank app's ranker and the generate app's generator. Each stage
batches on its own, so a slow generation does not hold up other pipelines' embeddings.

Citations are by construction: the model sees the chosen chunks labelled with their document
ids and is asked to cite them; the response lists exactly those ids (``citations``) and the
answer text ends with them, so a client can always tell which documents the answer used.
"""

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from fastapi.responses import JSONResponse
from pydantic import Field
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from carpool.admission import current_controls
from carpool.auth import health_body
from carpool.calls import call_idempotent, call_once
from carpool.config import IngressConfig, StrictModel
from carpool.errors import RequestError
from carpool.generation.schemas import GenerationCall
from carpool.http import MAX_BODY_BYTES, ClosingStreamingResponse, apply_ingress_defaults, make_api
from carpool.schemas import (
    IngestRequest,
    IngestResponse,
    ModelList,
    SearchHit,
    SearchRequest,
)
from pipelines.handler import PipelineHandler
from pipelines.rag_schemas import RagChatRequest, generation_call
from pipelines.router_access import ROUTER_DEPLOYMENT, router_handle
from pipelines.search import DocumentRoutes, retrieve_and_rerank

SYSTEM_PROMPT = (
    "Answer the question using only the sources below. Cite the source ids you used in "
    "square brackets, like [id]. If the sources do not contain the answer, say so.\n\n"
    "{sources}"
)


class RagArgs(StrictModel):
    """Arguments of the RAG pipeline (the ``args:`` of its serve config entry)."""

    search_app: str = Field(default="search", description="App that owns the retriever.")
    retriever_deployment: str = Field(default="retriever")
    rank_app: str = Field(default="rank", description="App that hosts the ranker.")
    rank_deployment: str = Field(default="ranker")
    rerank_weight: float = Field(
        default=0.3, ge=0, le=1, description="As in the search pipeline's args."
    )
    generate_app: str = Field(default="generate", description="App that hosts the generators.")
    generator_deployment: str = Field(
        default="router",
        description="Who answers: 'router' (model auto: small or large per request, with "
        "cascades; the generate app's ingress hosts it), or a generator deployment, 'small' "
        "or 'large'.",
    )
    top_k: int = Field(default=8, ge=1, le=200, description="Chunks retrieved before reranking.")
    context_chunks: int = Field(
        default=2, ge=1, le=20, description="Best chunks given to the generator as sources."
    )
    max_source_chars: int = Field(
        default=1200, ge=100, le=100_000, description="Characters kept of each source chunk."
    )
    default_max_tokens: int = Field(default=128, ge=1, le=4096)
    max_tokens_limit: int = Field(default=1024, ge=1, le=32_768)
    system_prompt: str = Field(default=SYSTEM_PROMPT, max_length=8000)
    model_name: str = Field(
        default="rag",
        min_length=1,
        max_length=256,
        description="The name clients put in `model` (listed by GET /rag/v1/models).",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)


# OpenAI chat fields this pipeline cannot honour, each with what to do instead. They are
# refused by name (400) rather than ignored: a client that sends them expects them to work.
# The deployment name other apps find this pipeline by (serve.get_deployment_handle).
RAG_INGRESS = "rag_ingress"

api = make_api(
    "carpool rag",
    "Retrieval-augmented answers: embed, retrieve, rerank, generate; answers cite documents.",
    MAX_BODY_BYTES,
)


def build_sources(hits: list[SearchHit], max_chars: int) -> str:
    return "\n\n".join(f"[{h.doc_id}] {h.text[:max_chars]}" for h in hits)


def cited_ids(hits: list[SearchHit]) -> list[str]:
    return list(dict.fromkeys(h.doc_id for h in hits))


def citations_header(ids: list[str]) -> str:
    """Cited ids for the ``x-carpool-citations`` header, each percent-encoded, comma-separated.

    Ids are any text a client ingested, but a header value must be latin-1 without CR/LF (an
    id outside that failed the whole answer with 500), and an id holding a comma would split
    in two. Ids of URL-safe ASCII other than ',' and '%' read as themselves.
    """
    return ",".join(quote(i, safe="!$&'()*+/:;=?@[]~") for i in ids)


def citation_suffix(ids: list[str]) -> str:
    return "\n\nSources: " + ", ".join(f"[{i}]" for i in ids) if ids else ""


class RagHandler(PipelineHandler):
    """The RAG pipeline's chat handling; every stage is another app's deployment, by name.

    The rag app's ingress and the OpenAI app (``pipelines.openai_api``) both answer with it,
    so a request is checked and answered the same whichever URL it came in by.
    """

    def __init__(self, args: RagArgs, created: int | None = None) -> None:
        self.args = args
        self.model_name = args.model_name
        self._handles: dict[str, Any] = {}
        self.created = created or int(time.time())

    @classmethod
    def attach(cls, app: str, settings: dict[str, Any]) -> "RagHandler":
        """The handler of a running rag app, from its ingress's ``settings()``.

        ``app`` is unused: the stages are the search, rank and generate apps that the rag
        app's own args name, so both answer with the same deployments.
        """
        return cls(RagArgs.model_validate(settings["args"]), settings["created"])

    def _handle(self, deployment: str, app: str) -> DeploymentHandle:
        # By name at first use: apps deploy in any order.
        key = f"{app}/{deployment}"
        if key not in self._handles:
            self._handles[key] = serve.get_deployment_handle(deployment, app_name=app)
        return self._handles[key]

    @property
    def retriever(self) -> DeploymentHandle:
        return self._handle(self.args.retriever_deployment, self.args.search_app)

    def _generator(self) -> Any:
        if self.args.generator_deployment == ROUTER_DEPLOYMENT:
            # `auto` is no deployment: the generate app's ingress hosts the router.
            key = f"{self.args.generate_app}/{ROUTER_DEPLOYMENT}"
            if key not in self._handles:
                self._handles[key] = router_handle(self.args.generate_app)
            return self._handles[key]
        return self._handle(self.args.generator_deployment, self.args.generate_app)

    def _check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.args.model_name:
            raise RequestError(
                404,
                f"model {requested!r} is not served here; use {self.args.model_name!r} or omit "
                "model (the answering generator is set by this app's generator_deployment)",
                param="model",
                code="model_not_found",
            )

    async def _prepare(self, body: RagChatRequest) -> tuple[list[SearchHit], GenerationCall]:
        self._check_model(body.model)
        question = body.question()
        search = SearchRequest(
            query=question[:8000],
            top_k=body.top_k or self.args.top_k,
            top_n=self.args.context_chunks,
        )
        hits = await retrieve_and_rerank(
            self.retriever,
            self._handle(self.args.rank_deployment, self.args.rank_app),
            search,
            self.args.rerank_weight,
        )
        max_tokens = body.max_completion_tokens or body.max_tokens or self.args.default_max_tokens
        if max_tokens > self.args.max_tokens_limit:
            raise RequestError(
                400,
                f"max_tokens {max_tokens} is over this pipeline's limit "
                f"{self.args.max_tokens_limit}; ask for fewer",
                param="max_tokens",
            )
        system = self.args.system_prompt.replace(
            "{sources}", build_sources(hits, self.args.max_source_chars) or "(no sources found)"
        )
        # Validated once, here: the generator (or the router) takes it as it comes.
        call = GenerationCall.model_validate(
            generation_call(body, system, max_tokens, current_controls())
        )
        return hits, call

    async def chat_response(self, body: RagChatRequest) -> Any:
        hits, call = await self._prepare(body)
        ids = cited_ids(hits)
        headers = {"x-carpool-citations": citations_header(ids)}
        if body.stream:
            return ClosingStreamingResponse(
                self._stream(call, ids, body.include_usage()),
                media_type="text/event-stream",
                headers=headers,
            )
        generator = self._generator()
        # The router retries its own calls to the generators: one loop, not one around it.
        via_router = self.args.generator_deployment == ROUTER_DEPLOYMENT
        call_generator = call_once if via_router else call_idempotent
        result = await call_generator("generator", lambda: generator.generate.remote(call))
        choice = result.choices[0]
        response: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": result.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": choice.text + citation_suffix(ids),
                    },
                    "finish_reason": choice.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
            },
            "citations": ids,
            "sources": [h.model_dump() for h in hits],
        }
        if result.decision is not None:  # the router's decision: model, lane, escalation
            response["carpool"] = result.decision.to_dict()
        return JSONResponse(response, headers=headers)

    async def _stream(
        self, call: GenerationCall, ids: list[str], include_usage: bool = False
    ) -> AsyncIterator[str]:
        stream_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = "unknown"

        def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
            body = {
                "id": stream_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": []
                if delta is None
                else [{"index": 0, "delta": delta, "finish_reason": finish}],
                **extra,
            }
            if include_usage:  # as OpenAI: null on every chunk but the last
                body.setdefault("usage", None)
            return f"data: {json.dumps(body)}\n\n"

        finish = "stop"
        usage: dict[str, int] | None = None
        events = self._generator().options(stream=True).stream.remote(call)
        finished = False
        try:
            async for event in events:
                if event.type == "start":
                    model = event.model
                    yield chunk({"role": "assistant", "content": ""})
                elif event.type == "delta":
                    if event.text:
                        yield chunk({"content": event.text})
                    if event.finish_reason is not None:
                        finish = event.finish_reason
                elif event.type == "end":
                    usage = {
                        "prompt_tokens": event.prompt_tokens,
                        "completion_tokens": event.completion_tokens,
                        "total_tokens": event.prompt_tokens + event.completion_tokens,
                    }
            finished = True
            yield chunk({"content": citation_suffix(ids)}, finish, citations=ids)
            if include_usage and usage is not None:
                yield chunk(None, usage=usage)
        except Exception as exc:  # headers are gone: report in-band, as OpenAI streams do
            message = str(exc.message) if isinstance(exc, RequestError) else "generation failed"
            yield f"data: {json.dumps({'error': {'message': message}})}\n\n"
        finally:
            if not finished:
                # The client left or the stream broke: free the generator's slot (through the
                # router) instead of generating for no one.
                events.cancel()
        yield "data: [DONE]\n\n"


@serve.ingress(api)
class RagIngress(RagHandler, DocumentRoutes):
    """HTTP front of the RAG pipeline; all stages are other apps' deployments."""

    def __init__(self, args: dict[str, Any]) -> None:
        super().__init__(RagArgs.model_validate(args))
        apply_ingress_defaults(api, self.args.ingress)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: RagChatRequest) -> Any:
        return await self.chat_response(body)

    @api.post("/v1/documents", response_model=IngestResponse)
    async def add_documents(self, body: IngestRequest) -> IngestResponse:
        return await self.add_docs(body)

    @api.get("/v1/documents")
    async def list_documents(self) -> dict[str, Any]:
        return await self.list_docs()

    @api.delete("/v1/documents/{doc_id}")
    async def delete_document(self, doc_id: str) -> dict[str, Any]:
        return await self.delete_doc(doc_id)

    @api.get("/v1/models", response_model=ModelList)
    async def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return health_body()  # {"status": "ok"}, plus warnings when open to anyone


def build_rag_app(args: dict[str, Any] | None = None) -> Application:
    """The RAG pipeline: an ingress over the search, rank and generate apps' deployments."""
    parsed = RagArgs.model_validate(args or {})
    ingress = serve.deployment(RagIngress).options(**parsed.ingress.serve_options(RAG_INGRESS))
    return ingress.bind(parsed.model_dump())


app = build_rag_app
