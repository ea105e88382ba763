"""A replica killed under load: idempotent calls are retried elsewhere, nothing is lost."""

from __future__ import annotations

import asyncio
import time

import httpx
import ray
from ray import serve

from tests.conftest import deploy_declaratively


def _replica_names(app: str, deployment: str) -> list[str]:
    names = ray.util.list_named_actors(all_namespaces=True)
    return [
        n["name"]
        for n in names
        if n["namespace"] == "serve" and f"{app}#{deployment}#" in n["name"]
    ]


def test_killing_a_replica_under_load_loses_no_request(serve_http: str, tiny_models: dict) -> None:
    # Two replicas the way a serve config asks for them: Serve's own deployments[] field.
    deploy_declaratively(
        [
            {
                "name": "fault-embed",
                "route_prefix": "/fault-embed",
                "import_path": "pipelines.embed:build_embed_app",
                "args": {
                    "embedder": {
                        "source": {"model": tiny_models["encoder"]},
                        "replica": {"num_cpus": 0.25},
                    }
                },
                "deployments": [{"name": "embedder", "num_replicas": 2}],
            }
        ]
    )
    url = f"{serve_http}/fault-embed/v1/embeddings"
    victims = _replica_names("fault-embed", "embedder")
    assert len(victims) == 2

    async def load() -> list[int]:
        semaphore = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i: int) -> int:
                async with semaphore:
                    r = await client.post(url, json={"input": [f"text number {i} " * 8] * 4})
                    return r.status_code

            async def killer() -> None:
                await asyncio.sleep(1.0)
                ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=False)

            results = await asyncio.gather(*(one(i) for i in range(300)), killer())
            return [r for r in results if r is not None]

    started = time.monotonic()
    statuses = asyncio.run(load())
    assert len(statuses) == 300, "every request got an answer"
    assert all(s == 200 for s in statuses), {s: statuses.count(s) for s in set(statuses)}
    assert time.monotonic() - started < 120

    # Serve replaces the killed replica.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        names = _replica_names("fault-embed", "embedder")
        if len(names) == 2 and victims[0] not in names:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"killed replica not replaced: {names}")
    assert httpx.post(url, json={"input": "after"}).status_code == 200
    serve.delete("fault-embed")
