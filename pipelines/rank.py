"""``/rank``: rerank documents for a query over the batched ranker deployment.

``POST /rank/v1/rerank`` takes the rerank shape Cohere v1, Jina and TEI share;
``POST /rank/v2/rerank`` takes and answers Cohere's v2 shape (what ``cohere.ClientV2`` posts).
"""

import math
import time
import uuid
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
    CohereRerankRequest,
    CohereRerankResponse,
    CohereRerankResult,
    ModelList,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
)
from deployments.ranker import RankerConfig, RankResult, build_ranking_deployment, sigmoid
from pipelines.embed import check_model
from pipelines.handler import PipelineHandler


class RankArgs(StrictModel):
    """Arguments of the rank pipeline (the ``args:`` of its serve config entry)."""

    ranker: RankerConfig = Field(default_factory=RankerConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    max_documents_per_request: int = Field(
        default=256, ge=1, le=4096, description="Most documents one request may carry."
    )
    max_chars_per_document: int = Field(
        default=32_000, ge=1, le=1_000_000, description="Longest document accepted, in characters."
    )


# Deployment names other apps find this pipeline's parts by (serve.get_deployment_handle).
RANK_INGRESS = "rank_ingress"
RANKER_DEPLOYMENT = "ranker"

api = make_api(
    "carpool rank", "Rerank documents with length-aware dynamic batching.", MAX_BODY_BYTES
)


class RankHandler(PipelineHandler):
    """The rank pipeline's request handling over a ranker handle.

    The rank app's ingress and the OpenAI app (``pipelines.openai_api``) both answer with it,
    so a request is checked, limited and answered the same whichever URL it came in by.
    """

    def __init__(self, ranker: DeploymentHandle, args: RankArgs, created: int | None = None):
        self.args = args
        self.ranker = ranker
        self.model_name = args.ranker.source.served_model_name or "ranker"
        self.created = created or int(time.time())
        self._described: dict[str, Any] | None = None

    @classmethod
    def attach(cls, app: str, settings: dict[str, Any]) -> "RankHandler":
        """The handler of a running rank app, from its ingress's ``settings()``."""
        ranker = serve.get_deployment_handle(RANKER_DEPLOYMENT, app_name=app)
        return cls(ranker, RankArgs.model_validate(settings["args"]), settings["created"])

    async def _score(
        self, query: str, docs: list[str], truncate: bool, top_n: int | None
    ) -> tuple[RankResult, list[int]]:
        """Checks the request against this app's limits, scores, and orders best first."""
        if len(docs) > self.args.max_documents_per_request:
            raise RequestError(
                400,
                f"documents has {len(docs)} items; send at most "
                f"{self.args.max_documents_per_request} per request (split the rest into "
                "another request)",
                param="documents",
            )
        for i, text in enumerate([query, *docs]):
            if len(text) > self.args.max_chars_per_document:
                where = "query" if i == 0 else f"documents[{i - 1}]"
                raise RequestError(
                    413,
                    f"{where} has {len(text)} characters; send at most "
                    f"{self.args.max_chars_per_document}",
                    param=where,
                )
        result: RankResult = await call_idempotent(
            "ranker",
            lambda: self.ranker.rank.remote(query, docs, truncate, current_controls()),
        )
        order = sorted(range(len(docs)), key=lambda i: -result.scores[i])
        if top_n is not None:
            order = order[:top_n]
        return result, order

    async def rerank_response(self, body: RerankRequest) -> JSONResponse:
        check_model(body.model, self.model_name)
        docs = body.documents
        result, order = await self._score(body.query, docs, body.truncate, body.top_n)
        response = RerankResponse(
            model=result.model,
            results=[
                RerankResult(
                    index=i,
                    relevance_score=result.scores[i]
                    if body.raw_scores
                    else sigmoid(result.scores[i]),
                    document=RerankDocument(text=docs[i]) if body.return_documents else None,
                    truncated=result.truncated[i],
                )
                for i in order
            ],
            usage=RerankUsage(total_tokens=result.total_tokens),
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    async def _max_length(self) -> int:
        if self._described is None:
            self._described = await call_backend("ranker", self.ranker.describe.remote())
        return int(self._described["max_length"])

    async def cohere_rerank_response(self, body: CohereRerankRequest) -> JSONResponse:
        """The answer to ``POST /v2/rerank`` (what ``cohere.ClientV2`` posts)."""
        check_model(body.model, self.model_name)
        if body.max_tokens_per_doc is not None:
            limit = await self._max_length()
            if body.max_tokens_per_doc < limit:
                raise RequestError(
                    400,
                    f"max_tokens_per_doc {body.max_tokens_per_doc} is below this ranker's "
                    f"limit of {limit} tokens per query-document pair, and carpool cannot cut "
                    f"documents shorter; remove max_tokens_per_doc or send at least {limit}",
                    param="max_tokens_per_doc",
                )
        docs = body.texts()
        # Cohere truncates long documents; so does this route (never a 413).
        result, order = await self._score(body.query, docs, True, body.top_n)
        response = CohereRerankResponse(
            id=str(uuid.uuid4()),
            model=result.model,
            results=[
                CohereRerankResult(
                    index=i,
                    relevance_score=sigmoid(result.scores[i]),
                    document=RerankDocument(text=docs[i]) if body.return_documents else None,
                )
                for i in order
            ],
            meta={
                "api_version": {"version": "2"},
                # Cohere bills one search unit per query with up to 100 documents.
                "billed_units": {"search_units": math.ceil(len(docs) / 100)},
                "tokens": {"input_tokens": result.total_tokens, "output_tokens": 0},
            },
        )
        return JSONResponse(response.model_dump(exclude_none=True))


@serve.ingress(api)
class RankIngress(RankHandler):
    """HTTP front of the rank pipeline: validates, forwards, sorts, formats."""

    def __init__(self, ranker: DeploymentHandle, args: dict[str, Any]) -> None:
        super().__init__(ranker, RankArgs.model_validate(args))
        apply_ingress_defaults(api, self.args.ingress)

    @api.post("/v1/rerank", response_model=RerankResponse)
    async def rerank(self, body: RerankRequest) -> JSONResponse:
        return await self.rerank_response(body)

    @api.post("/v2/rerank", response_model=CohereRerankResponse)
    async def rerank_v2(self, body: CohereRerankRequest) -> JSONResponse:
        """Cohere's v2 shape: ``results`` of index and relevance score, ``meta`` with units."""
        return await self.cohere_rerank_response(body)

    @api.get("/v1/models", response_model=ModelList)
    async def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    @api.get("/v1/stats")
    async def stats(self) -> dict[str, Any]:
        """Batching figures of one ranker replica (the one this call reaches)."""
        return await call_backend("ranker", self.ranker.stats.remote())

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return health_body()  # {"status": "ok"}, plus warnings when open to anyone


def build_rank_app(args: dict[str, Any] | None = None) -> Application:
    """The rank pipeline: ingress -> ranker."""
    parsed = RankArgs.model_validate(args or {})
    ranker = build_ranking_deployment(parsed.ranker, RANKER_DEPLOYMENT)
    ingress = serve.deployment(RankIngress).options(**parsed.ingress.serve_options(RANK_INGRESS))
    # Without the batching knobs, so changing them reconfigures the ranker in place.
    return ingress.bind(ranker, parsed.model_dump(exclude={"ranker": {"batching"}}))


app = build_rank_app
