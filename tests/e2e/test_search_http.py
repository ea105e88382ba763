"""The search pipeline over HTTP: ingest, search, delete, and the index surviving a restart."""

from __future__ import annotations

from pathlib import Path

import httpx
from ray import serve

from tests.conftest import deploy_declaratively
from tests.e2e.conftest import default_applications

FACT = (
    "The Zorblatt bridge in the town of Quillon was painted bright orange in 1987 by the "
    "local fishermen's guild, who wanted ships to see it through the fog."
)


def test_default_corpus_is_searchable(default_apps: str) -> None:
    docs = httpx.get(f"{default_apps}/search/v1/documents", timeout=120).json()["documents"]
    assert any(d["id"].startswith("carpool:") for d in docs)


def test_ingested_document_ranks_first_and_survives_a_restart(
    default_apps: str, e2e_index_dir: Path
) -> None:
    base = f"{default_apps}/search/v1"
    added = httpx.post(
        f"{base}/documents",
        json={"documents": [{"id": "quillon", "text": FACT, "metadata": {"topic": "bridges"}}]},
        timeout=120,
    )
    assert added.status_code == 200, added.text
    assert added.json() == {"ids": ["quillon"], "chunks": 1}
    query = {"query": "What colour is the bridge in Quillon?", "top_k": 8, "top_n": 3}
    hits = httpx.post(f"{base}/search", json=query, timeout=120).json()["results"]
    assert hits[0]["doc_id"] == "quillon"
    assert hits[0]["metadata"] == {"topic": "bridges"}

    # Restart the search app (its replicas and in-memory index go away) and ask again.
    serve.delete("search")
    deploy_declaratively(default_applications(e2e_index_dir))
    ids = [d["id"] for d in httpx.get(f"{base}/documents", timeout=120).json()["documents"]]
    assert "quillon" in ids
    hits = httpx.post(f"{base}/search", json=query, timeout=120).json()["results"]
    assert hits[0]["doc_id"] == "quillon"

    assert httpx.delete(f"{base}/documents/quillon", timeout=60).status_code == 200
    assert httpx.delete(f"{base}/documents/quillon", timeout=60).status_code == 404


def test_search_rejects_bad_input(default_apps: str) -> None:
    base = f"{default_apps}/search/v1"
    cases = [
        ("search", {"query": ""}),
        ("search", {"query": "x", "top_k": 0}),
        ("documents", {"documents": []}),
        ("documents", {"documents": [{"id": "a", "text": "  "}]}),
        ("documents", {"documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}),
    ]
    for path, body in cases:
        response = httpx.post(f"{base}/{path}", json=body, timeout=60)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"]["message"]
