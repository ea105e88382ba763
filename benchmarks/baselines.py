"""The plain alternatives carpool is measured against, as their own Serve apps.

Both wrap the very same ``TextEmbedder`` carpool's embedder uses (same tokenizer, same
truncation, same padded forward), speak the same OpenAI wire format through the same
``carpool.http`` error handling, and run one forward pass at a time in a worker thread, as
carpool's executor does. Only the batching differs:

- ``naive``: one forward pass per request (a request's own texts padded to its longest).
- ``naive-rank``: the same for ``/rank``: one pass per request through the very scorer
  carpool's ranker wraps (``deployments.ranker``: ``LlmPointwiseScorer`` or
  ``CrossEncoderScorer``, serve.yaml's rank settings), so light-load latency compares.
- ``serve-batch``: ``@serve.batch(max_batch_size=32)`` as Ray's docs show, one forward pass
  per collected batch padded to its longest text. The batch size counts texts
  (``batch_size_fn``), so 32 means 32 texts per pass whatever the texts-per-request mix.

Each keeps carpool's ``BatchStats`` and answers ``GET /v1/stats`` with the same keys, plus an
exact histogram of items per pass, so the harness reads every system the same way.

No ``from __future__ import annotations`` here: Serve rebuilds the FastAPI routes of an
ingress class elsewhere, where string annotations no longer resolve to the request models
(pipelines/embed.py avoids it for the same reason).
"""

import asyncio
import time
from collections import Counter
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.deployment import Application

from carpool.batching import BatchStats, PassRecord
from carpool.errors import RequestError
from carpool.http import MAX_BODY_BYTES, make_api
from carpool.schemas import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    Usage,
)
from carpool.threads import size_torch_threads
from deployments.embedder import EmbedderConfig, TextEmbedder
from deployments.ranker import CrossEncoderScorer, LlmPointwiseScorer, RankerConfig, sigmoid
from pipelines.embed import encode_vector

HISTOGRAM_KEY = "items_per_pass_histogram"


def _plain(embedding: Any) -> list[float] | str:
    # A plain server's path, as before carpool wrote float32 arrays with orjson: the vector as
    # a Python list for pydantic (validating an ndarray element by element costs it ~4x).
    return embedding.tolist() if hasattr(embedding, "tolist") else embedding


class BaselineArgs(BaseModel):
    """Arguments of a baseline app (the harness fills them from the suite's resources)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    embedder: EmbedderConfig = Field(
        default_factory=EmbedderConfig,
        description="Model source and replica resources; the same values as carpool's.",
    )
    max_batch_size: int = Field(
        default=32, ge=1, le=4096, description="serve-batch: texts per collected batch."
    )
    batch_wait_timeout_s: float = Field(
        default=0.01,
        ge=0,
        le=5,
        description="serve-batch: how long a batch waits to fill (Serve's default, and carpool's).",
    )
    max_ongoing_requests: int = Field(
        default=1024,
        ge=1,
        description="Requests a replica holds at once; Serve's default of 5 would starve "
        "batching and turn load into proxy-side queueing.",
    )
    max_inputs_per_request: int = Field(default=256, ge=1, le=4096)


class _PassStats:
    """carpool's cumulative ``BatchStats`` plus an exact items-per-pass histogram."""

    def __init__(self) -> None:
        self.batch = BatchStats()
        self.hist: Counter[int] = Counter()
        self.forward_ms = 0.0

    def record(self, lengths: list[int], forward_ms: float) -> None:
        self.batch.steps += 1  # a baseline step is one pass: nothing is merged
        self.batch.on_pass(
            PassRecord(
                items=len(lengths),
                real_tokens=sum(lengths),
                padded_tokens=len(lengths) * max(lengths),
                forward_ms=forward_ms,
                queue_wait_ms=[],
                step_items=len(lengths),
            )
        )
        self.hist[len(lengths)] += 1
        self.forward_ms += forward_ms

    def snapshot(self) -> dict[str, Any]:
        return {
            **self.batch.snapshot(),
            "forward_ms": self.forward_ms,
            HISTOGRAM_KEY: {str(k): v for k, v in sorted(self.hist.items())},
        }


class _EmbedderCore:
    """Model, tokenisation and response formatting shared by both baselines."""

    def _setup(self, args: dict[str, Any]) -> None:
        self.args = BaselineArgs.model_validate(args)
        cfg = self.args.embedder
        size_torch_threads(cfg.replica.num_cpus, cfg.replica.torch_threads)
        self.model = TextEmbedder(cfg)
        self.stats = _PassStats()
        # One forward pass at a time, as in carpool's executor: a second concurrent pass
        # would take more CPU than the replica reserves.
        self.model_lock = asyncio.Lock()

    def _token_ids(self, body: EmbeddingRequest) -> list[list[int]]:
        texts = body.texts()
        if len(texts) > self.args.max_inputs_per_request:
            raise RequestError(
                400,
                f"input has {len(texts)} texts; send at most "
                f"{self.args.max_inputs_per_request} per request",
                param="input",
            )
        ids = self.model.tokenize(texts)
        for i, seq in enumerate(ids):
            if len(seq) > self.model.max_length:
                if not body.truncate:
                    raise RequestError(
                        413,
                        f"input[{i}] has {len(seq)} tokens; this model takes at most "
                        f"{self.model.max_length}",
                        param=f"input[{i}]",
                        code="input_too_long",
                    )
                ids[i] = self.model.truncate(texts[i])
        return ids

    def _forward(self, batch: list[list[int]]) -> list[np.ndarray]:
        started = time.perf_counter()
        out = self.model.embed_ids(batch)
        self.stats.record([len(s) for s in batch], (time.perf_counter() - started) * 1000)
        return out

    async def _run_pass(self, batch: list[list[int]]) -> list[np.ndarray]:
        async with self.model_lock:
            return await asyncio.to_thread(self._forward, batch)

    def _respond(
        self, body: EmbeddingRequest, ids: list[list[int]], vectors: list[np.ndarray]
    ) -> JSONResponse:
        tokens = sum(len(s) for s in ids)
        response = EmbeddingResponse(
            data=[
                EmbeddingData(index=i, embedding=_plain(encode_vector(v, body.encoding_format)))
                for i, v in enumerate(vectors)
            ],
            model=self.model.name,
            usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
        )
        return JSONResponse(response.model_dump(exclude_none=True))


naive_api = make_api("naive embedder", "One forward pass per request.", MAX_BODY_BYTES)


@serve.ingress(naive_api)
class NaiveEmbedder(_EmbedderCore):
    def __init__(self, args: dict[str, Any]) -> None:
        self._setup(args)

    @naive_api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest) -> JSONResponse:
        ids = self._token_ids(body)
        return self._respond(body, ids, await self._run_pass(ids))

    @naive_api.get("/v1/stats")
    async def get_stats(self) -> dict[str, Any]:
        return self.stats.snapshot()

    @naive_api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model.name, "object": "model"}]}


def _count_texts(batch: list[list[list[int]]]) -> int:
    """``batch_size_fn``: a request weighs as many as the texts it carries."""
    return sum(len(request) for request in batch)


servebatch_api = make_api(
    "serve-batch embedder", "Plain @serve.batch, padded to the longest.", MAX_BODY_BYTES
)


@serve.ingress(servebatch_api)
class ServeBatchEmbedder(_EmbedderCore):
    def __init__(self, args: dict[str, Any]) -> None:
        self._setup(args)
        self._embed_batch.set_max_batch_size(self.args.max_batch_size)
        self._embed_batch.set_batch_wait_timeout_s(self.args.batch_wait_timeout_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01, batch_size_fn=_count_texts)
    async def _embed_batch(self, requests: list[list[list[int]]]) -> list[list[np.ndarray]]:
        flat = [seq for request in requests for seq in request]
        vectors = await self._run_pass(flat)  # one pass, padded to the batch's longest text
        out, start = [], 0
        for request in requests:
            out.append(vectors[start : start + len(request)])
            start += len(request)
        return out

    @servebatch_api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest) -> JSONResponse:
        ids = self._token_ids(body)
        if len(ids) > self.args.max_batch_size:
            # Serve refuses an item heavier than the batch cap; run such a request alone in
            # cap-sized passes, as a user of plain @serve.batch would have to.
            size = self.args.max_batch_size
            vectors: list[np.ndarray] = []
            for i in range(0, len(ids), size):
                vectors.extend(await self._run_pass(ids[i : i + size]))
        else:
            vectors = await self._embed_batch(ids)
        return self._respond(body, ids, vectors)

    @servebatch_api.get("/v1/stats")
    async def get_stats(self) -> dict[str, Any]:
        return self.stats.snapshot()

    @servebatch_api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model.name, "object": "model"}]}


def _options(name: str, args: BaselineArgs) -> dict[str, Any]:
    replica = args.embedder.replica
    return {
        "name": name,
        "max_ongoing_requests": args.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": replica.num_cpus, "num_gpus": replica.num_gpus},
    }


def build_naive_app(args: dict[str, Any] | None = None) -> Application:
    parsed = BaselineArgs.model_validate(args or {})
    return (
        serve.deployment(NaiveEmbedder)
        .options(**_options("naive_embedder", parsed))
        .bind(parsed.model_dump())
    )


def build_servebatch_app(args: dict[str, Any] | None = None) -> Application:
    parsed = BaselineArgs.model_validate(args or {})
    return (
        serve.deployment(ServeBatchEmbedder)
        .options(**_options("servebatch_embedder", parsed))
        .bind(parsed.model_dump())
    )


class NaiveRankArgs(BaseModel):
    """Arguments of the naive rank baseline: the ranker config carpool's rank app gets."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    ranker: RankerConfig = Field(default_factory=RankerConfig)
    max_ongoing_requests: int = Field(default=1024, ge=1, description="As the embed baselines.")


naive_rank_api = make_api("naive ranker", "One scoring pass per request.", MAX_BODY_BYTES)


@serve.ingress(naive_rank_api)
class NaiveRanker:
    """One pass per request over all its (query, document) pairs; no batching across requests."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = NaiveRankArgs.model_validate(args)
        cfg = self.args.ranker
        size_torch_threads(cfg.replica.num_cpus, cfg.replica.torch_threads)
        cls = LlmPointwiseScorer if cfg.backend == "llm" else CrossEncoderScorer
        self.scorer = cls(cfg)
        self.stats = _PassStats()
        self.model_lock = asyncio.Lock()  # one pass at a time, as carpool's executor

    def _score(self, query: str, documents: list[str], truncate: bool) -> tuple[list[float], int]:
        pairs = [pair for pair, _ in self.scorer.encode(query, documents, truncate)]
        started = time.perf_counter()
        scores = self.scorer.score(pairs)
        lengths = [len(ids) for ids, _ in pairs]
        self.stats.record(lengths, (time.perf_counter() - started) * 1000)
        return scores, sum(lengths)

    @naive_rank_api.post("/v1/rerank")
    async def rerank(self, body: RerankRequest) -> JSONResponse:
        if not body.documents:
            raise RequestError(400, "no documents to rank; send at least one", param="documents")
        async with self.model_lock:
            scores, tokens = await asyncio.to_thread(
                self._score, body.query, body.documents, body.truncate
            )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
        response = RerankResponse(
            model=self.scorer.name,
            results=[
                RerankResult(
                    index=i, relevance_score=scores[i] if body.raw_scores else sigmoid(scores[i])
                )
                for i in order
            ],
            usage=RerankUsage(total_tokens=tokens),
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    @naive_rank_api.get("/v1/stats")
    async def get_stats(self) -> dict[str, Any]:
        return self.stats.snapshot()

    @naive_rank_api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.scorer.name, "object": "model"}]}


def build_naive_rank_app(args: dict[str, Any] | None = None) -> Application:
    parsed = NaiveRankArgs.model_validate(args or {})
    replica = parsed.ranker.replica
    return (
        serve.deployment(NaiveRanker)
        .options(
            name="naive_ranker",
            max_ongoing_requests=parsed.max_ongoing_requests,
            ray_actor_options={"num_cpus": replica.num_cpus, "num_gpus": replica.num_gpus},
        )
        .bind(parsed.model_dump())
    )
