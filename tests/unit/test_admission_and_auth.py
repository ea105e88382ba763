"""Admission control and API keys, without Ray."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from carpool.errors import RequestError
from carpool.http import make_api
from deployments.embedder import EmbedderConfig, EmbeddingServer


class _SlowModel:
    name = "slow"
    max_length = 64
    dimension = 2

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[1] * 4 for _ in texts]

    def truncate(self, text: str) -> list[int]:
        return [1] * 4

    def embed_ids(self, batch: list[list[int]]) -> list[np.ndarray]:
        time.sleep(0.2)
        return [np.ones(2, dtype=np.float32) for _ in batch]


def test_a_full_replica_refuses_fast_with_retry_after_and_serves_the_rest() -> None:
    config = EmbedderConfig.model_validate({"batching": {"max_queued_items": 6}})
    server = EmbeddingServer(config, _SlowModel())

    async def main() -> list:
        calls = [server.embed(["x", "y"]) for _ in range(6)]  # 12 items against a bound of 6
        return await asyncio.gather(*calls, return_exceptions=True)

    started = time.monotonic()
    outcomes = asyncio.run(main())
    refused = [o for o in outcomes if isinstance(o, RequestError)]
    served = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(served) == 3 and len(refused) == 3
    assert all(r.status_code == 503 and r.retry_after_s for r in refused)
    assert time.monotonic() - started < 2
    # Once the queue drains, the replica admits again.
    assert len(asyncio.run(server.embed(["z"])).vectors) == 1


@pytest.fixture()
def api_client(monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setenv("CARPOOL_API_KEYS", "key-one, key-two")
    api = make_api("t", "t", 1024)

    @api.get("/v1/thing")
    async def thing() -> dict:
        return {"ok": True}

    @api.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return TestClient(api)


def test_api_keys_are_required_when_configured(api_client: TestClient) -> None:
    assert api_client.get("/v1/thing").status_code == 401
    wrong = api_client.get("/v1/thing", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "CARPOOL_API_KEYS" in wrong.json()["error"]["message"]
    assert api_client.get("/v1/thing", headers={"Authorization": "Bearer key-two"}).json() == {
        "ok": True
    }
    assert api_client.get("/healthz").status_code == 200  # health checks stay open


def test_no_keys_means_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CARPOOL_API_KEYS", raising=False)
    monkeypatch.delenv("CARPOOL_API_KEYS_FILE", raising=False)
    api = make_api("t", "t", 1024)

    @api.get("/v1/thing")
    async def thing() -> dict:
        return {"ok": True}

    assert TestClient(api).get("/v1/thing").status_code == 200


def test_retry_after_header_on_overload() -> None:
    api = make_api("t", "t", 1024)

    @api.get("/v1/busy")
    async def busy() -> dict:
        raise RequestError(503, "busy", code="overloaded", retry_after_s=2.2)

    response = TestClient(api).get("/v1/busy")
    assert response.status_code == 503 and response.headers["retry-after"] == "3"
