"""A request id sent to a pipeline comes back and shows up in every stage's logs."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from pipelines.embed import build_embed_app
from pipelines.rank import build_rank_app
from pipelines.search import build_search_app


@pytest.fixture(scope="module")
def search_stack(serve_http: str, tiny_models: dict, tmp_path_factory: pytest.TempPathFactory):
    replica = {"num_cpus": 0.25}
    serve.run(
        build_embed_app(
            {"embedder": {"source": {"model": tiny_models["encoder"]}, "replica": replica}}
        ),
        name="rid-embed",
        route_prefix="/rid-embed",
    )
    serve.run(
        build_rank_app(
            {
                "ranker": {
                    "backend": "cross_encoder",
                    "source": {"model": tiny_models["cross_encoder"]},
                    "replica": replica,
                }
            }
        ),
        name="rid-rank",
        route_prefix="/rid-rank",
    )
    index = tmp_path_factory.mktemp("rid-index")
    serve.run(
        build_search_app(
            {
                "app_name": "rid-search",
                "retriever": {
                    "index_dir": str(index),
                    "embed_app": "rid-embed",
                    "seed_default_corpus": False,
                },
                "rank_app": "rid-rank",
            }
        ),
        name="rid-search",
        route_prefix="/rid-search",
    )
    yield serve_http
    for name in ("rid-search", "rid-rank", "rid-embed"):
        serve.delete(name)


def _log_files_mentioning(text: str) -> list[str]:
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    found = subprocess.run(["grep", "-l", "-r", text, str(logs)], capture_output=True, text=True)
    return [Path(p).name for p in found.stdout.split()]


def test_request_id_crosses_every_stage_of_the_search_dag(search_stack: str) -> None:
    base = f"{search_stack}/rid-search/v1"
    docs = {
        "documents": [
            {"id": "river", "text": "the river runs past the mountain"},
            {"id": "music", "text": "a guitar and some music"},
        ]
    }
    assert httpx.post(f"{base}/documents", json=docs, timeout=120).status_code == 200
    request_id = f"trace-{uuid.uuid4()}"
    response = httpx.post(
        f"{base}/search",
        json={"query": "river mountain", "top_n": 1},
        headers={"x-request-id": request_id},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == request_id
    expected = (
        "rid-search_search_ingress",
        "rid-search_retriever",
        "rid-embed_embedder",
        "rid-rank_ranker",
    )
    files: list[str] = []
    for _ in range(20):  # log lines are flushed asynchronously
        files = _log_files_mentioning(request_id)
        if all(any(stage in f for f in files) for stage in expected):
            break
        time.sleep(0.5)
    for stage in expected:
        assert any(stage in f for f in files), f"{request_id} not in {stage} logs: {files}"


def test_a_request_id_is_created_when_the_client_sends_none(search_stack: str) -> None:
    response = httpx.post(f"{search_stack}/rid-embed/v1/embeddings", json={"input": "hi"})
    assert len(response.headers.get("x-request-id", "")) >= 8
    bad = httpx.post(f"{search_stack}/rid-embed/v1/embeddings", json={"input": []})
    assert bad.status_code == 400 and bad.headers.get("x-request-id")
