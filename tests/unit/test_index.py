"""The vector index and chunking: correctness and durability, no Ray."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from carpool.index import Chunk, VectorIndex, chunk_text
from deployments.retriever import RetrievalServer


def _unit(v: list[float]) -> np.ndarray:
    a = np.asarray(v, dtype=np.float32)
    return a / np.linalg.norm(a)


def _chunks(doc: str, n: int) -> list[Chunk]:
    return [Chunk(doc, i, f"{doc} part {i}", i * 10) for i in range(n)]


def test_chunks_overlap_and_cover_the_text() -> None:
    text = " ".join(f"word{i}" for i in range(600))
    pieces = chunk_text(text, chunk_chars=200, overlap_chars=50)
    assert len(pieces) > 5
    assert all(len(p) <= 200 for _, p in pieces)
    for (s1, p1), (s2, _) in itertools.pairwise(pieces):
        assert s2 < s1 + len(p1), "neighbouring chunks must overlap"
    assert pieces[-1][1].endswith("word599")
    assert chunk_text("short text", 200, 50) == [(0, "short text")]
    with pytest.raises(ValueError):
        chunk_text("x", 100, 100)


def test_search_returns_nearest_chunks_in_order() -> None:
    index = VectorIndex(3)
    index.upsert("a", {}, _chunks("a", 2), np.stack([_unit([1, 0, 0]), _unit([0.9, 0.1, 0])]))
    index.upsert("b", {}, _chunks("b", 1), np.stack([_unit([0, 1, 0])]))
    hits = index.search(_unit([1, 0.05, 0]), top_k=2)
    assert [(c.doc_id, c.chunk_id) for c, _ in hits] == [("a", 0), ("a", 1)]
    assert hits[0][1] > hits[1][1]
    assert index.search(_unit([0, 1, 0]), top_k=1)[0][0].doc_id == "b"


def test_reupsert_replaces_and_delete_removes() -> None:
    index = VectorIndex(2)
    index.upsert("a", {"v": 1}, _chunks("a", 3), np.ones((3, 2)) / np.sqrt(2))
    index.upsert("a", {"v": 2}, _chunks("a", 1), np.ones((1, 2)) / np.sqrt(2))
    assert len(index) == 1
    assert index.documents() == [{"id": "a", "chunks": 1, "metadata": {"v": 2}}]
    assert index.delete("a") and not index.delete("a")
    assert len(index) == 0 and index.search(np.ones(2), 3) == []


def test_state_survives_reopen_through_log_and_snapshot(tmp_path) -> None:
    index = VectorIndex(2, tmp_path, compact_every=3)
    for i in range(5):  # crosses a compaction: snapshot + a log tail
        index.upsert(f"d{i}", {"i": i}, _chunks(f"d{i}", 2), np.tile(_unit([1, i]), (2, 1)))
    index.delete("d1")
    reopened = VectorIndex(2, tmp_path, compact_every=3)
    assert sorted(d["id"] for d in reopened.documents()) == ["d0", "d2", "d3", "d4"]
    query = _unit([1, 3])
    assert reopened.search(query, 1)[0][0].doc_id == index.search(query, 1)[0][0].doc_id == "d3"


def test_a_torn_last_log_line_is_ignored(tmp_path) -> None:
    index = VectorIndex(2, tmp_path)
    index.upsert("ok", {}, _chunks("ok", 1), np.stack([_unit([1, 0])]))
    with open(tmp_path / "log.jsonl", "a") as fh:
        fh.write('{"op": "upsert", "doc_id": "half')  # a crash mid-write
    assert [d["id"] for d in VectorIndex(2, tmp_path).documents()] == ["ok"]


def test_dimension_mismatch_says_what_to_do(tmp_path) -> None:
    index = VectorIndex(2, tmp_path)
    index.upsert("a", {}, _chunks("a", 1), np.stack([_unit([1, 0])]))
    index.snapshot()
    with pytest.raises(ValueError, match="index_dir"):
        VectorIndex(3, tmp_path)


def test_retrieval_server_ingests_and_finds_with_a_fake_embedder(tmp_path) -> None:
    vocabulary = ["river", "mountain", "guitar", "market"]

    async def embed(texts: list[str]) -> list[np.ndarray]:
        out = []
        for text in texts:
            v = np.array([text.count(w) for w in vocabulary], dtype=np.float32) + 0.01
            out.append(v / np.linalg.norm(v))
        return out

    config = {
        "index_dir": str(tmp_path),
        "chunk_chars": 60,
        "overlap_chars": 10,
        "seed_default_corpus": False,
    }
    server = RetrievalServer(config, embed)

    async def main() -> list[dict]:
        await server.add_documents(
            [
                {"id": "music", "text": "the guitar and more guitar " * 6, "metadata": {}},
                {"id": "geo", "text": "a river runs by the mountain " * 6, "metadata": {"k": "v"}},
            ]
        )
        return await server.search("mountain river", top_k=3)

    hits = asyncio.run(main())
    assert hits[0]["doc_id"] == "geo" and hits[0]["metadata"] == {"k": "v"}
    restarted = RetrievalServer(config, embed)
    assert {d["id"] for d in asyncio.run(restarted.list_documents())} == {"music", "geo"}
