"""``/search``: embed -> retrieve top-k -> rerank, over the shared embed and rank apps.

This app owns the retriever (and its persisted index). The embedder and ranker are the
deployments of the ``embed`` and ``rank`` apps, reached by name, so every pipeline shares one
set of model replicas and their batches.
"""

import time
from typing import Any

from fastapi.responses import JSONResponse
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
from carpool.schemas import (
    IngestRequest,
    IngestResponse,
    ModelCard,
    ModelList,
    SearchHit,
    SearchRequest,
    SearchResponse,
)
from deployments.ranker import sigmoid
from deployments.retriever import RetrieverConfig, build_retrieval_deployment


class SearchArgs(StrictModel):
    """Arguments of the search pipeline (the ``args:`` of its serve config entry)."""

    app_name: str = Field(default="search", description="This app's name (names its index dir).")
    retriever: RetrieverConfig = Field(default_factory=RetrieverConfig)
    rank_app: str = Field(default="rank", description="Serve app that hosts the ranker.")
    rank_deployment: str = Field(default="ranker", description="Ranker deployment name.")
    rerank_weight: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description="Weight of the reranker in the final score (z-scored rerank and retrieval "
        "scores, mixed). The packaged LLM judge is weak, so retrieval leads by default; with a "
        "real cross-encoder set 1.0 (rerank order only).",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)


api = make_api(
    "carpool search", "Embed, retrieve and rerank over ingested documents.", MAX_BODY_BYTES
)


class DocumentRoutes:
    """Ingestion routes shared by every pipeline that fronts a retriever."""

    retriever: DeploymentHandle

    async def add_docs(self, body: IngestRequest) -> IngestResponse:
        docs = [d.model_dump() for d in body.documents]
        result = await call_backend("retriever", self.retriever.add_documents.remote(docs))
        return IngestResponse(**result)

    async def list_docs(self) -> dict[str, Any]:
        docs = await call_backend("retriever", self.retriever.list_documents.remote())
        return {"documents": docs}

    async def delete_doc(self, doc_id: str) -> dict[str, Any]:
        if not await call_backend("retriever", self.retriever.delete_document.remote(doc_id)):
            raise RequestError(404, f"no document with id {doc_id!r}; list them with GET", "id")
        return {"id": doc_id, "deleted": True}


def zscores(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    spread = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    return [(v - mean) / spread if spread > 1e-9 else 0.0 for v in values]


async def retrieve_and_rerank(
    retriever: DeploymentHandle,
    ranker: DeploymentHandle | None,
    body: SearchRequest,
    rerank_weight: float,
) -> list[SearchHit]:
    """The search DAG; the RAG pipeline runs the same stages before generating."""
    controls = current_controls()
    chunks = await call_idempotent(
        "retriever", lambda: retriever.search.remote(body.query, body.top_k, controls)
    )
    if not chunks:
        return []
    retrieval = [c["score"] for c in chunks]
    final = retrieval
    rerank: list[float | None] = [None] * len(chunks)
    if ranker is not None and rerank_weight > 0:
        texts = [c["text"] for c in chunks]
        ranked = await call_idempotent(
            "ranker", lambda: ranker.rank.remote(body.query, texts, True, controls)
        )
        rerank = [sigmoid(s) for s in ranked.scores]
        # z-scores put both on one scale; the weights then say whose opinion counts more.
        final = [
            rerank_weight * r + (1 - rerank_weight) * q
            for r, q in zip(zscores(ranked.scores), zscores(retrieval), strict=True)
        ]
    order = sorted(range(len(chunks)), key=lambda i: -final[i])[: body.top_n]
    return [
        SearchHit(
            doc_id=chunks[i]["doc_id"],
            chunk_id=chunks[i]["chunk_id"],
            text=chunks[i]["text"],
            score=final[i],
            retrieval_score=retrieval[i],
            rerank_score=rerank[i],
            metadata=chunks[i]["metadata"],
        )
        for i in order
    ]


@serve.ingress(api)
class SearchIngress(DocumentRoutes):
    def __init__(self, retriever: DeploymentHandle, args: dict[str, Any]) -> None:
        self.args = SearchArgs.model_validate(args)
        apply_ingress_defaults(api, self.args.ingress)
        self.retriever = retriever
        self._ranker: DeploymentHandle | None = None
        # OpenAI's `created` on the model card: when this app started.
        self.created = int(time.time())

    def ranker(self) -> DeploymentHandle:
        if self._ranker is None:
            self._ranker = serve.get_deployment_handle(
                self.args.rank_deployment, app_name=self.args.rank_app
            )
        return self._ranker

    @api.post("/v1/search", response_model=SearchResponse)
    async def search(self, body: SearchRequest) -> JSONResponse:
        hits = await retrieve_and_rerank(
            self.retriever, self.ranker() if body.rerank else None, body, self.args.rerank_weight
        )
        response = SearchResponse(query=body.query, results=hits, reranked=body.rerank)
        return JSONResponse(response.model_dump())

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
        """What this app serves: the search pipeline itself, under its app name.

        Its embedder and ranker belong to the embed and rank apps and are listed there.
        """
        return ModelList(data=[ModelCard(id=self.args.app_name, created=self.created)])

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return health_body()  # {"status": "ok"}, plus warnings when open to anyone


def build_search_app(args: dict[str, Any] | None = None) -> Application:
    """The search pipeline: ingress -> retriever (-> embed app's embedder), rank app's ranker."""
    parsed = SearchArgs.model_validate(args or {})
    retriever = build_retrieval_deployment(parsed.retriever, parsed.app_name)
    ingress = serve.deployment(SearchIngress).options(
        **parsed.ingress.serve_options("search_ingress")
    )
    return ingress.bind(retriever, parsed.model_dump())


app = build_search_app
