"""Retriever: ingest documents (chunk, embed through the embedder, index) and search them.

``RetrievalServer`` is plain Python over a ``VectorIndex`` and an injected ``embed`` coroutine;
the Serve shell wires ``embed`` to the embedder deployment of the embed app, so one set of
embedder replicas serves the whole cluster. The index lives in this replica's memory and is
persisted to ``index_dir``, so run one replica per index (``num_replicas: 1``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field, model_validator
from ray import serve
from ray.serve.deployment import Application

from carpool.admission import RequestControls
from carpool.calls import await_or_cancel
from carpool.config import StrictModel
from carpool.errors import RequestError, find_request_error
from carpool.index import (
    Chunk,
    IndexHome,
    IndexLost,
    VectorIndex,
    check_index_home,
    chunk_text,
)
from carpool.models import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "carpool" / "corpus"

# embed(texts, controls=None): controls carry the request's deadline and priority.
Embed = Callable[..., Awaitable[list[np.ndarray]]]
# Embedder calls one ingest keeps in flight: enough to overlap with the embedder's passes,
# few enough that one large ingest does not fill its queue and get refused.
INGEST_CALLS_IN_FLIGHT = 2
# Longest an ingest waits out the embedder's overload refusals before it fails with them.
INGEST_MAX_WAIT_S = 60.0


class RetrieverConfig(StrictModel):
    """The retriever's index, chunking and placement."""

    index_dir: str | None = Field(
        default=None,
        max_length=4096,
        description="Where the index persists (snapshot + append log); default "
        "$CARPOOL_CACHE/index/<app>. Empty string: memory only.",
    )
    chunk_chars: int = Field(default=800, ge=50, le=100_000, description="Chunk size, characters.")
    overlap_chars: int = Field(
        default=160, ge=0, le=50_000, description="Characters shared by neighbouring chunks."
    )
    embed_batch_texts: int = Field(
        default=64, ge=1, le=4096, description="Chunks per call to the embedder while ingesting."
    )
    compact_every: int = Field(
        default=1000, ge=1, le=10_000_000, description="Log entries before a new snapshot."
    )
    seed_default_corpus: bool = Field(
        default=True,
        description="Ingest carpool's own docs when the index starts empty, so a fresh "
        "deployment answers something real.",
    )
    embed_app: str = Field(default="embed", description="Serve app that hosts the embedder.")
    embed_deployment: str = Field(default="embedder", description="Embedder deployment name.")
    num_cpus: float = Field(default=0.1, gt=0, le=64, description="CPUs for the replica.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources, to pin it to a node type."
    )
    max_ongoing_requests: int = Field(default=256, ge=1, le=100_000)
    on_lost_index: Literal["refuse", "start_empty"] = Field(
        default="refuse",
        description="When the index held chunks (as the cluster recorded) but opens empty, "
        "because the replica moved to another node or the folder was wiped: 'refuse' answers "
        "503 saying so until the index is back; 'start_empty' starts over (and seeds the "
        "default corpus if asked).",
    )

    @model_validator(mode="after")
    def _overlap_below_chunk(self) -> RetrieverConfig:
        if self.overlap_chars >= self.chunk_chars:
            raise ValueError(
                f"overlap_chars ({self.overlap_chars}) must be below chunk_chars "
                f"({self.chunk_chars})"
            )
        return self


class IndexHomeStore(Protocol):
    """Where the index was last seen, kept off the node (see ``check_index_home``)."""

    def get(self) -> IndexHome | None: ...

    def put(self, home: IndexHome) -> None: ...


class RetrievalServer:
    """Plain-Python retriever: tests pass any ``embed`` coroutine."""

    def __init__(
        self,
        config: RetrieverConfig | dict,
        embed: Embed,
        app_name: str = "search",
        home_store: IndexHomeStore | None = None,
        node_id: str = "local",
    ):
        self.config = (
            config
            if isinstance(config, RetrieverConfig)
            else RetrieverConfig.model_validate(config)
        )
        self._embed = embed
        self._app_name = app_name
        self._home_store = home_store
        self._node_id = node_id
        self._index: VectorIndex | None = None
        self._ready = asyncio.Lock()
        # Ingestion is serialised: concurrent upserts of one id must not interleave.
        self._writes = asyncio.Lock()

    def _index_dir(self) -> str | None:
        configured = self.config.index_dir
        if configured == "":
            return None
        return (
            os.path.expanduser(configured)
            if configured
            else str(cache_dir() / "index" / self._app_name)
        )

    async def index(self) -> VectorIndex:
        """The index, opened on first use (the embedder tells its dimension then)."""
        async with self._ready:
            if self._index is None:
                probe = await self._embed(["dimension probe"])
                index = VectorIndex(len(probe[0]), self._index_dir(), self.config.compact_every)
                await self._check_home(index)
                self._index = index
                if len(index) == 0 and self.config.seed_default_corpus:
                    await self._ingest(self._default_corpus(), index)
                await self._record_home(index)
            return self._index

    def _home(self, index: VectorIndex) -> IndexHome | None:
        if self._home_store is None or index.directory is None:
            return None  # memory only: nothing persists, so nothing can be lost
        return IndexHome(self._node_id, str(index.directory), len(index))

    async def _check_home(self, index: VectorIndex) -> None:
        here = self._home(index)
        if here is None or self._home_store is None or self.config.on_lost_index != "refuse":
            return
        try:
            check_index_home(await asyncio.to_thread(self._home_store.get), here)
        except IndexLost as exc:
            # Not opened: every call checks again, so restoring the folder (or moving the
            # replica back) heals it without a redeploy.
            logger.error("%s", exc)
            raise RequestError(503, str(exc), code="index_lost") from None

    async def _record_home(self, index: VectorIndex) -> None:
        here = self._home(index)
        if here is not None and self._home_store is not None:
            await asyncio.to_thread(self._home_store.put, here)

    @staticmethod
    def _default_corpus() -> list[dict[str, Any]]:
        docs = []
        for path in sorted(DEFAULT_CORPUS.glob("*.md")):
            docs.append(
                {
                    "id": f"carpool:{path.stem}",
                    "text": path.read_text(),
                    "metadata": {"source": "carpool docs"},
                }
            )
        return docs

    async def add_documents(self, documents: list[dict[str, Any]]) -> dict[str, Any]:
        index = await self.index()
        return await self._ingest(documents, index)

    async def _ingest(self, documents: list[dict[str, Any]], index: VectorIndex) -> dict[str, Any]:
        planned: list[tuple[dict[str, Any], list[Chunk]]] = []
        for doc in documents:
            pieces = chunk_text(doc["text"], self.config.chunk_chars, self.config.overlap_chars)
            if not pieces:
                raise RequestError(400, f"document {doc['id']!r} has no text; send some text")
            planned.append(
                (
                    doc,
                    [
                        Chunk(doc["id"], i, text, start, dict(doc.get("metadata") or {}))
                        for i, (start, text) in enumerate(pieces)
                    ],
                )
            )
        texts = [c.text for _, chunks in planned for c in chunks]
        step = self.config.embed_batch_texts
        # Calls in flight together: the embedder batches them with everyone else's requests.
        gate = asyncio.Semaphore(INGEST_CALLS_IN_FLIGHT)
        parts = await asyncio.gather(
            *(self._embed_paced(texts[i : i + step], gate) for i in range(0, len(texts), step))
        )
        vectors = np.asarray([v for part in parts for v in part], dtype=np.float32)
        async with self._writes:
            offset = 0
            for doc, chunks in planned:
                index.upsert(
                    doc["id"],
                    dict(doc.get("metadata") or {}),
                    chunks,
                    vectors[offset : offset + len(chunks)],
                )
                offset += len(chunks)
            await self._record_home(index)
        return {
            "ids": [doc["id"] for doc, _ in planned],
            "chunks": sum(len(chunks) for _, chunks in planned),
        }

    # Deadline and priority of the embedder calls an ingest makes (None: the embedder's default).
    ingest_controls: RequestControls | None = None

    async def _embed_paced(self, texts: list[str], gate: asyncio.Semaphore) -> list[np.ndarray]:
        """Embeds one slice of an ingest, waiting out the embedder's overload refusals.

        One ingest request of many chunks is many embedder jobs. Sent all at once they filled
        the embedder's queue, and its admission control refused the tail with 503: a valid
        ingest failed on an idle service. So slices go a few at a time, and a refusal that
        says when to retry is retried, up to ``INGEST_MAX_WAIT_S`` of waiting in all.
        """
        waited = 0.0
        async with gate:
            while True:
                try:
                    controls = self.ingest_controls
                    return await (self._embed(texts, controls) if controls else self._embed(texts))
                except Exception as exc:
                    found = find_request_error(exc)
                    if found is None or found.code != "overloaded" or waited >= INGEST_MAX_WAIT_S:
                        raise
                    delay = min(max(found.retry_after_s or 0.0, 0.05), 2.0)
                    await asyncio.sleep(delay)
                    waited += delay

    async def delete_document(self, doc_id: str) -> bool:
        index = await self.index()
        async with self._writes:
            deleted = index.delete(doc_id)
            await self._record_home(index)
            return deleted

    async def list_documents(self) -> list[dict[str, Any]]:
        return (await self.index()).documents()

    async def search(
        self, query: str, top_k: int, controls: RequestControls | None = None
    ) -> list[dict[str, Any]]:
        if controls is not None:
            controls.check("retriever")
        index = await self.index()
        embedded = await (self._embed([query], controls) if controls else self._embed([query]))
        vector = embedded[0]
        return [
            {
                "doc_id": c.doc_id,
                "chunk_id": c.chunk_id,
                "text": c.text,
                "start": c.start,
                "metadata": c.metadata,
                "score": score,
            }
            for c, score in index.search(vector, top_k)
        ]


class ClusterIndexHomeStore:
    """The index's home in Ray's cluster key-value store (GCS): it outlives any one node."""

    def __init__(self, app_name: str) -> None:
        self.key = f"index-home:{app_name}".encode()

    def get(self) -> IndexHome | None:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(self.key, namespace="carpool")
        return IndexHome(**json.loads(raw)) if raw else None

    def put(self, home: IndexHome) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        value = json.dumps(asdict(home)).encode()
        _internal_kv_put(self.key, value, overwrite=True, namespace="carpool")


class RetrievalDeployment(RetrievalServer):
    """Serve shell: embeds through the embed app's embedder deployment."""

    # Ingestion is bulk work: at the embedder it runs in the batch tier, behind searches, and
    # fills only part of the embedder's queue, so a large ingest does not get searches refused.
    ingest_controls = RequestControls(priority="batch")

    def __init__(self, config: dict, app_name: str) -> None:
        parsed = RetrieverConfig.model_validate(config)
        import ray

        self._handle: Any = None
        super().__init__(
            parsed,
            self._embed_remote,
            app_name,
            ClusterIndexHomeStore(app_name),
            ray.get_runtime_context().get_node_id(),
        )

    async def _embed_remote(
        self, texts: list[str], controls: RequestControls | None = None
    ) -> list[np.ndarray]:
        if self._handle is None:
            # Looked up on first use: apps deploy in any order, and this one must not fail
            # to start just because the embed app is still coming up.
            self._handle = serve.get_deployment_handle(
                self.config.embed_deployment, app_name=self.config.embed_app
            )
        result = await await_or_cancel(self._handle.embed.remote(texts, True, controls))
        return result.vectors


def build_retrieval_deployment(config: RetrieverConfig, app_name: str) -> Application:
    return (
        serve.deployment(RetrievalDeployment)
        .options(
            name="retriever",
            num_replicas=1,
            max_ongoing_requests=config.max_ongoing_requests,
            max_queued_requests=config.max_ongoing_requests,
            ray_actor_options={"num_cpus": config.num_cpus, "resources": dict(config.resources)},
        )
        .bind(config.model_dump(), app_name)
    )
