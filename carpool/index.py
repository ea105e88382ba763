"""An exact in-memory vector index over document chunks, persisted as snapshot + append log.

Pure Python + numpy (no Ray). Search is one matrix-vector product over normalised vectors:
exact, and fast enough here (100k chunks x 384 dims is ~40 ms on one core), so no
approximate index until a measurement says one is needed.

Durability: every change is appended to ``log.jsonl`` (and flushed) before it is applied;
``snapshot.npz`` holds the state at some point and the log holds what came
after. Start-up loads the snapshot, then replays the log. When the log grows past
``compact_every`` entries a new snapshot is written atomically and the log truncated, so a
crash at any point loses nothing that was acknowledged.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Chunk:
    doc_id: str
    chunk_id: int
    text: str
    start: int  # character offset in the document
    metadata: dict[str, Any] = field(default_factory=dict)


def chunk_text(
    text: str, chunk_chars: int = 800, overlap_chars: int = 160
) -> list[tuple[int, str]]:
    """Overlapping character windows, cut at whitespace when one is near.

    Overlap keeps a sentence that straddles a boundary whole in at least one chunk.
    """
    if chunk_chars <= 0 or not 0 <= overlap_chars < chunk_chars:
        raise ValueError(
            f"need chunk_chars > overlap_chars >= 0; got {chunk_chars}, {overlap_chars}"
        )
    text = text.strip()
    if len(text) <= chunk_chars:
        return [(0, text)] if text else []
    out: list[tuple[int, str]] = []
    start = 0
    while start < len(text):
        end = min(start + chunk_chars, len(text))
        if end < len(text):
            cut = text.rfind(" ", start + chunk_chars // 2, end)
            end = cut if cut > start else end
        piece = text[start:end].strip()
        if piece:
            out.append((start, piece))
        if end >= len(text):
            break
        start = max(end - overlap_chars, start + 1)
    return out


class VectorIndex:
    """Chunks and their vectors; ``directory=None`` keeps everything in memory only."""

    def __init__(
        self,
        dimension: int,
        directory: str | os.PathLike[str] | None = None,
        compact_every: int = 1000,
    ) -> None:
        self.dimension = dimension
        self.directory = Path(directory) if directory else None
        self.compact_every = compact_every
        self._vectors = np.zeros((0, dimension), dtype=np.float32)
        self._chunks: list[Chunk] = []
        self._docs: dict[str, dict[str, Any]] = {}  # doc_id -> metadata
        self._log_entries = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load()

    # --- queries -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._chunks)

    def documents(self) -> list[dict[str, Any]]:
        counts: dict[str, int] = {}
        for chunk in self._chunks:
            counts[chunk.doc_id] = counts.get(chunk.doc_id, 0) + 1
        return [
            {"id": doc_id, "chunks": counts.get(doc_id, 0), "metadata": meta}
            for doc_id, meta in self._docs.items()
        ]

    def search(self, query: np.ndarray, top_k: int) -> list[tuple[Chunk, float]]:
        if not self._chunks:
            return []
        scores = self._vectors @ np.asarray(query, dtype=np.float32)
        k = min(top_k, len(scores))
        best = np.argpartition(-scores, k - 1)[:k]
        best = best[np.argsort(-scores[best])]
        return [(self._chunks[i], float(scores[i])) for i in best]

    # --- changes -------------------------------------------------------------------

    def upsert(
        self, doc_id: str, metadata: dict[str, Any], chunks: list[Chunk], vectors: np.ndarray
    ) -> None:
        """Replaces a document's chunks (a re-ingested id overwrites, it does not duplicate)."""
        vectors = np.asarray(vectors, dtype=np.float32).reshape(len(chunks), self.dimension)
        self._append(
            {
                "op": "upsert",
                "doc_id": doc_id,
                "metadata": metadata,
                "chunks": [asdict(c) for c in chunks],
                "vectors": base64.b64encode(vectors.astype("<f4").tobytes()).decode("ascii"),
            }
        )
        self._apply_upsert(doc_id, metadata, chunks, vectors)
        self._maybe_compact()

    def delete(self, doc_id: str) -> bool:
        if doc_id not in self._docs:
            return False
        self._append({"op": "delete", "doc_id": doc_id})
        self._apply_delete(doc_id)
        self._maybe_compact()
        return True

    def _apply_upsert(
        self, doc_id: str, metadata: dict[str, Any], chunks: list[Chunk], vectors: np.ndarray
    ) -> None:
        self._apply_delete(doc_id)
        self._docs[doc_id] = metadata
        self._chunks.extend(chunks)
        self._vectors = np.concatenate([self._vectors, vectors.astype(np.float32)])

    def _apply_delete(self, doc_id: str) -> None:
        if doc_id not in self._docs:
            return
        keep = [i for i, c in enumerate(self._chunks) if c.doc_id != doc_id]
        self._chunks = [self._chunks[i] for i in keep]
        self._vectors = self._vectors[keep]
        del self._docs[doc_id]

    # --- persistence ---------------------------------------------------------------

    @property
    def _log_path(self) -> Path:
        assert self.directory is not None
        return self.directory / "log.jsonl"

    def _append(self, entry: dict[str, Any]) -> None:
        if self.directory is None:
            return
        with open(self._log_path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self._log_entries += 1

    def _replay(self, entries: Iterable[dict[str, Any]]) -> None:
        for entry in entries:
            if entry["op"] == "upsert":
                chunks = [Chunk(**c) for c in entry["chunks"]]
                raw = np.frombuffer(base64.b64decode(entry["vectors"]), dtype="<f4")
                self._apply_upsert(
                    entry["doc_id"],
                    entry["metadata"],
                    chunks,
                    raw.reshape(len(chunks), self.dimension),
                )
            elif entry["op"] == "delete":
                self._apply_delete(entry["doc_id"])

    def _load(self) -> None:
        assert self.directory is not None
        snapshot_path = self.directory / "snapshot.npz"
        if snapshot_path.exists():
            with np.load(snapshot_path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                vectors = data["vectors"]
            if meta["dimension"] != self.dimension:
                raise ValueError(
                    f"index in {self.directory} has dimension {meta['dimension']}, the embedder "
                    f"gives {self.dimension}; point index_dir elsewhere or re-ingest"
                )
            self._chunks = [Chunk(**c) for c in meta["chunks"]]
            self._docs = meta["documents"]
            self._vectors = vectors.astype(np.float32).reshape(len(self._chunks), self.dimension)
        if self._log_path.exists():
            entries = []
            for line in self._log_path.read_text().splitlines():
                try:
                    entries.append(json.loads(line))
                except ValueError:
                    break  # a torn last line from a crash mid-write: it was never acknowledged
            self._replay(entries)
            self._log_entries = len(entries)

    def _maybe_compact(self) -> None:
        if self.directory is not None and self._log_entries >= self.compact_every:
            self.snapshot()

    def snapshot(self) -> None:
        """Writes the whole state and truncates the log (each file replaced atomically)."""
        if self.directory is None:
            return
        meta = {
            "dimension": self.dimension,
            "documents": self._docs,
            "chunks": [asdict(c) for c in self._chunks],
        }
        # Vectors and metadata in one file, so a single rename switches both at once.
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".npz")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, vectors=self._vectors, meta=np.array(json.dumps(meta)))
        os.replace(tmp, self.directory / "snapshot.npz")
        # A crash between the rename above and this truncation only means the log's
        # entries get replayed on top of a snapshot that already has them: upserts and
        # deletes are idempotent, so the result is the same.
        open(self._log_path, "w").close()
        self._log_entries = 0


@dataclass(frozen=True)
class IndexHome:
    """Where a persisted index lives, and how many chunks it held there last."""

    node_id: str
    directory: str
    chunks: int


class IndexLost(Exception):
    """A persisted index that held chunks opened empty: it is on another node, or was wiped."""


def check_index_home(recorded: IndexHome | None, here: IndexHome) -> None:
    """Raises ``IndexLost`` when ``here`` opened empty an index ``recorded`` saw with chunks.

    The index persists to a node-local folder. A replica rescheduled onto another node (or a
    node whose disk was replaced) finds that folder empty, and without this check it would
    seed the default corpus and answer every search from it, silently dropping the user's
    documents. The record lives outside the node (the serving layer keeps it in the
    cluster's key-value store), so it survives the move that the folder did not.
    """
    if recorded is None or recorded.chunks == 0 or here.chunks > 0:
        return
    where = (
        f"on node {recorded.node_id} in {recorded.directory}"
        if recorded.node_id != here.node_id
        else f"in {recorded.directory} on this node (the folder was emptied)"
    )
    raise IndexLost(
        f"the retriever's index held {recorded.chunks} chunks {where}, and opened empty in "
        f"{here.directory} on node {here.node_id}. Put index_dir on storage every node "
        "mounts, or pin the retriever to the node that holds it (its `resources`, e.g. "
        "{carpool_head_node: 0.01}); to start over with an empty index on purpose, set the "
        "retriever's on_lost_index: start_empty."
    )
