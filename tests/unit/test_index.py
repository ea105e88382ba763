"""The vector index and chunking: correctness and durability, no Ray."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from carpool.errors import RequestError
from carpool.index import Chunk, IndexHome, IndexLost, VectorIndex, check_index_home, chunk_text
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


VOCABULARY = ["river", "mountain", "guitar", "market"]


async def _count_embed(texts: list[str]) -> list[np.ndarray]:
    out = []
    for text in texts:
        v = np.array([text.count(w) for w in VOCABULARY], dtype=np.float32) + 0.01
        out.append(v / np.linalg.norm(v))
    return out


def test_retrieval_server_ingests_and_finds_with_a_fake_embedder(tmp_path) -> None:
    embed = _count_embed

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


def test_an_index_that_held_chunks_and_opens_empty_is_lost() -> None:
    had = IndexHome("node-a", "/idx", 12)
    check_index_home(None, IndexHome("node-b", "/idx", 0))  # never recorded: a fresh index
    check_index_home(IndexHome("node-a", "/idx", 0), IndexHome("node-b", "/idx", 0))
    check_index_home(had, IndexHome("node-b", "/shared", 12))  # moved, storage came along
    with pytest.raises(IndexLost, match="12 chunks on node node-a") as moved:
        check_index_home(had, IndexHome("node-b", "/idx", 0))
    assert "resources" in str(moved.value) and "on_lost_index: start_empty" in str(moved.value)
    with pytest.raises(IndexLost, match="was emptied"):
        check_index_home(had, IndexHome("node-a", "/idx", 0))


class _DictHomeStore:
    """The cluster's key-value store, as one process sees it."""

    def __init__(self) -> None:
        self.home: IndexHome | None = None

    def get(self) -> IndexHome | None:
        return self.home

    def put(self, home: IndexHome) -> None:
        self.home = home


def test_a_retriever_moved_to_an_empty_node_refuses_instead_of_reseeding(tmp_path) -> None:
    store = _DictHomeStore()
    config = {"chunk_chars": 60, "overlap_chars": 10, "seed_default_corpus": True}
    first = RetrievalServer(
        {**config, "index_dir": str(tmp_path / "a")}, _count_embed, "search", store, "node-a"
    )
    doc = {"id": "geo", "text": "a river runs by the mountain " * 6, "metadata": {}}
    asyncio.run(first.add_documents([doc]))
    seeded_and_added = len(asyncio.run(first.index()))
    assert store.home == IndexHome("node-a", str(tmp_path / "a"), seeded_and_added)

    moved = {**config, "index_dir": str(tmp_path / "b")}
    second = RetrievalServer(moved, _count_embed, "search", store, "node-b")
    with pytest.raises(RequestError) as refused:
        asyncio.run(second.search("river", top_k=2))
    assert refused.value.status_code == 503 and refused.value.code == "index_lost"
    assert "node-a" in str(refused.value) and not (tmp_path / "b" / "snapshot.npz").exists()
    assert store.home is not None and store.home.node_id == "node-a"  # the record stands

    # Moved back (or the folder restored): the same server heals without a restart.
    second.config = second.config.model_copy(update={"index_dir": str(tmp_path / "a")})
    assert asyncio.run(second.search("river", top_k=1))[0]["doc_id"] == "geo"

    fresh = RetrievalServer(
        {**moved, "index_dir": str(tmp_path / "c"), "on_lost_index": "start_empty"},
        _count_embed,
        "search",
        store,
        "node-b",
    )
    assert {d["id"] for d in asyncio.run(fresh.list_documents())} != {"geo"}
    assert store.home is not None and store.home.node_id == "node-b"
