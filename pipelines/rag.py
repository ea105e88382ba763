"""``/rag``: embed -> retrieve -> rerank -> generate, with the answer citing its sources.

Every stage is another app's deployment reached by name: the search app's retriever (one
shared, persisted index), the rank app's ranker and the generate app's generator. Each stage
batches on its own, so a slow generation does not hold up other pipelines' embeddings.

rag builds a generation call (the retrieved sources in its system prompt) and answers it on
the generate path (``pipelines.generate_path``), as ``/generate`` answers its own chat: the
same router for ``auto``, first-event check, refusal retry, deadlines and formatting, so an
overloaded generator is a 503 with Retry-After here as there, never a 200 stream that
carries the error.

Citations are by construction: the model sees the chosen chunks labelled with their document
ids and is asked to cite them; the response lists exactly those ids (``citations``) and the
answer text ends with them, so a client can always tell which documents the answer used.
"""

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from pydantic import Field
from ray import serve
from ray.serve.deployment import Application

from carpool.auth import health_body
from carpool.config import IngressConfig, StrictModel
from carpool.errors import RequestError
from carpool.generation.hops import GenerationEvent
from carpool.generation.schemas import GenerationCall
from carpool.http import MAX_BODY_BYTES, apply_ingress_defaults, make_api
from carpool.schemas import (
    IngestRequest,
    IngestResponse,
    ModelList,
    SearchHit,
    SearchRequest,
)
from pipelines.generate_path import AUTO, Additions, ChatForm, EventFormat, GeneratePath
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


def citing(hits: list[SearchHit]) -> Additions:
    """rag's citations on an answer the generate path formats (one choice: ``n`` is 1).

    The ``x-carpool-citations`` header on the response, whole or streamed; a whole answer's
    text ends with the citation suffix and its body gains ``citations`` and ``sources``; a
    stream's finishing chunk (the delta that carries ``finish_reason``, which every answer's
    last delta does) ends with the suffix and carries ``citations``.
    """
    ids = cited_ids(hits)
    suffix = citation_suffix(ids)

    def whole(body: dict[str, Any]) -> None:
        message = body["choices"][0]["message"]
        message["content"] = (message["content"] or "") + suffix
        body["citations"] = ids
        body["sources"] = [h.model_dump() for h in hits]

    def stream(fmt: EventFormat) -> EventFormat:
        def cited(event: GenerationEvent) -> list[dict[str, Any]]:
            chunks = fmt(event)
            if event.type == "delta" and event.finish_reason is not None and chunks:
                last = chunks[-1]
                delta = last["choices"][0]["delta"]
                delta["content"] = (delta.get("content") or "") + suffix
                last["citations"] = ids
            return chunks

        return cited

    return Additions({"x-carpool-citations": citations_header(ids)}, whole, stream)


class RagHandler(GeneratePath, PipelineHandler):
    """The RAG pipeline's chat handling; every stage is another app's deployment, by name.

    The rag app's ingress and the OpenAI app (``pipelines.openai_api``) both answer with it,
    so a request is checked and answered the same whichever URL it came in by. ``handles``
    (by stage: ``retriever``, ``ranker``, ``generator``) replaces the lookup by name, for
    tests.
    """

    def __init__(
        self,
        args: RagArgs,
        created: int | None = None,
        handles: Mapping[str, Any] | None = None,
    ) -> None:
        self.args = args
        self.model_name = args.model_name
        self.created = created or int(time.time())
        # The tier that answers, as /generate names it: `auto` is the generate app's router.
        deployment = args.generator_deployment
        self.tier = AUTO if deployment == ROUTER_DEPLOYMENT else deployment
        self._handles: dict[str, Any] = dict(handles or {})

    @classmethod
    def attach(cls, app: str, settings: dict[str, Any]) -> "RagHandler":
        """The handler of a running rag app, from its ingress's ``settings()``.

        ``app`` is unused: the stages are the search, rank and generate apps that the rag
        app's own args name, so both answer with the same deployments.
        """
        return cls(RagArgs.model_validate(settings["args"]), settings["created"])

    def _stage(self, stage: str) -> Any:
        """A stage's handle, looked up by name at first use: apps deploy in any order."""
        if stage not in self._handles:
            a = self.args
            if stage == "generator" and self.tier == AUTO:
                # `auto` is no deployment: the generate app's ingress hosts the router.
                self._handles[stage] = router_handle(a.generate_app)
            else:
                name, app = {
                    "retriever": (a.retriever_deployment, a.search_app),
                    "ranker": (a.rank_deployment, a.rank_app),
                    "generator": (a.generator_deployment, a.generate_app),
                }[stage]
                self._handles[stage] = serve.get_deployment_handle(name, app_name=app)
        return self._handles[stage]

    @property
    def retriever(self) -> Any:
        return self._stage("retriever")

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
        """The sources (retrieved, reranked) and the generation call that cites them."""
        self._check_model(body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens or self.args.default_max_tokens
        if max_tokens > self.args.max_tokens_limit:
            raise RequestError(
                400,
                f"max_tokens {max_tokens} is over this pipeline's limit "
                f"{self.args.max_tokens_limit}; ask for fewer",
                param="max_tokens",
            )
        question = body.question()
        search = SearchRequest(
            query=question[:8000],
            top_k=body.top_k or self.args.top_k,
            top_n=self.args.context_chunks,
        )
        ranker = self._stage("ranker") if self.args.rerank_weight > 0 else None
        hits = await retrieve_and_rerank(self.retriever, ranker, search, self.args.rerank_weight)
        system = self.args.system_prompt.replace(
            "{sources}", build_sources(hits, self.args.max_source_chars) or "(no sources found)"
        )
        # Validated once, here: the generator (or the router) takes it as it comes.
        return hits, GenerationCall.model_validate(generation_call(body, system, max_tokens))

    async def chat_response(self, body: RagChatRequest) -> Any:
        """The cited answer: sources first, then the call answered on the generate path."""
        hits, call = await self._prepare(body)
        form = ChatForm(stream=bool(body.stream), include_usage=body.include_usage())
        generator = self._stage("generator")
        return await self.answer_chat(self.tier, generator, self.tier, call, form, citing(hits))


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
