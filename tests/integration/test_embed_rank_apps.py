"""The embed and rank pipelines under Serve, on tiny random models."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import httpx
import numpy as np
import pytest
from ray import serve

from pipelines.embed import build_embed_app
from pipelines.rank import build_rank_app
from tests.bad_inputs import EMBED_BAD, RANK_BAD
from tests.conftest import deploy_declaratively
from tests.factories import random_text

BATCHING = {"max_batch_size": 32, "max_batch_tokens": 2048, "batch_wait_timeout_s": 0.02}
# The embedder replica runs on this one core (replica.cpu_cores), the ranker on all.
EMBED_CORE = max(os.sched_getaffinity(0))


def _embed_args(models: dict[str, str], **batching: object) -> dict:
    return {
        "embedder": {
            "source": {"model": models["encoder"], "max_length": 64},
            # One level below Ray's, on one core: the tests below find both on the
            # replica's process.
            "replica": {"num_cpus": 0.5, "cpu_niceness": 1, "cpu_cores": [EMBED_CORE]},
            "batching": {**BATCHING, **batching},
        }
    }


@pytest.fixture(scope="module")
def apps(serve_http: str, tiny_models: dict[str, str]):
    serve.run(build_embed_app(_embed_args(tiny_models)), name="it-embed", route_prefix="/it-embed")
    serve.run(
        build_rank_app(
            {
                "ranker": {
                    "backend": "cross_encoder",
                    "source": {"model": tiny_models["cross_encoder"], "max_length": 64},
                    "replica": {"num_cpus": 0.5},
                    "batching": BATCHING,
                }
            }
        ),
        name="it-rank",
        route_prefix="/it-rank",
    )
    yield serve_http
    serve.delete("it-embed")
    serve.delete("it-rank")


def _replica_pids(title: str) -> list[int]:
    """Every process whose title (Ray sets ``ray::ServeReplica:<app>:<name>``) holds
    ``title``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if title in cmdline:
            found.append(int(entry.name))
    return found


def _replica_niceness(title: str) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, pid) for pid in _replica_pids(title)]


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_a_replica_runs_at_the_niceness_its_config_asks(apps: str) -> None:
    embedder = _replica_niceness("ServeReplica:it-embed:embedder")
    ranker = _replica_niceness("ServeReplica:it-rank:ranker")  # replica.cpu_niceness unset
    assert len(embedder) == 1 and len(ranker) == 1, (embedder, ranker)
    assert embedder[0] == min(19, ranker[0] + 1)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux CPU affinity")
def test_a_replica_runs_on_the_cores_its_config_asks(apps: str) -> None:
    embedder = _replica_pids("ServeReplica:it-embed:embedder")
    ranker = _replica_pids("ServeReplica:it-rank:ranker")  # replica.cpu_cores unset
    assert len(embedder) == 1 and len(ranker) == 1, (embedder, ranker)
    assert os.sched_getaffinity(embedder[0]) == {EMBED_CORE}
    assert os.sched_getaffinity(ranker[0]) == os.sched_getaffinity(0)


async def _post_many(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(url, json=b) for b in bodies))


def test_concurrent_requests_share_forward_passes(apps: str) -> None:
    rng = random.Random(0)
    bodies = [{"input": [random_text(rng) for _ in range(rng.randint(1, 3))]} for _ in range(48)]
    before = httpx.get(f"{apps}/it-embed/v1/stats").json()
    responses = asyncio.run(_post_many(f"{apps}/it-embed/v1/embeddings", bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies)
    after = httpx.get(f"{apps}/it-embed/v1/stats").json()
    items = after["items"] - before["items"]
    passes = after["forward_passes"] - before["forward_passes"]
    assert items == sum(len(b["input"]) for b in bodies)
    assert items / passes > 1.5, f"{items} items in {passes} passes: no batching happened"
    # Usage counts real tokens and the vectors come back in input order.
    for body, response in zip(bodies, responses, strict=True):
        data = response.json()
        assert [d["index"] for d in data["data"]] == list(range(len(body["input"])))
        assert data["usage"]["prompt_tokens"] >= len(body["input"]) * 3


def test_batched_vectors_match_unbatched(apps: str) -> None:
    rng = random.Random(1)
    texts = [random_text(rng, 1, 40) for _ in range(24)]
    alone = [
        httpx.post(f"{apps}/it-embed/v1/embeddings", json={"input": t}).json()["data"][0][
            "embedding"
        ]
        for t in texts[:6]
    ]
    together = asyncio.run(
        _post_many(f"{apps}/it-embed/v1/embeddings", [{"input": t} for t in texts])
    )
    for a, r in zip(alone, together[:6], strict=True):
        assert np.abs(np.array(a) - np.array(r.json()["data"][0]["embedding"])).max() < 1e-4


def test_base64_encoding_matches_floats(apps: str) -> None:
    import base64

    floats = httpx.post(f"{apps}/it-embed/v1/embeddings", json={"input": "hello"}).json()
    b64 = httpx.post(
        f"{apps}/it-embed/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, floats["data"][0]["embedding"], atol=1e-6)


def test_reconfigure_changes_batch_size_in_place(apps: str, tiny_models: dict[str, str]) -> None:
    def app(max_batch_size: int) -> dict:
        # As in serve.yaml: runtime knobs go in the deployment's user_config override; a
        # change to `args` would be a code change and restart every replica.
        return {
            "name": "it-reconf",
            "route_prefix": "/it-reconf",
            "import_path": "pipelines.embed:build_embed_app",
            "args": _embed_args(tiny_models),
            "deployments": [
                {"name": "embedder", "user_config": {**BATCHING, "max_batch_size": max_batch_size}}
            ],
        }

    def burst() -> dict:
        rng = random.Random(2)
        bodies = [{"input": [random_text(rng) for _ in range(4)]} for _ in range(16)]
        before = httpx.get(f"{apps}/it-reconf/v1/stats").json()
        responses = asyncio.run(_post_many(f"{apps}/it-reconf/v1/embeddings", bodies))
        assert all(r.status_code == 200 for r in responses)
        after = httpx.get(f"{apps}/it-reconf/v1/stats").json()
        return {k: after[k] - before[k] for k in ("items", "forward_passes")} | {
            "pid": after["pid"],
            "max_items_per_pass": after["max_items_per_pass"],
        }

    deploy_declaratively([app(32)])
    try:
        wide = burst()
        deploy_declaratively([app(2)])
        narrow = burst()
        assert narrow["pid"] == wide["pid"], "a user_config change must not restart the replica"
        assert wide["items"] == narrow["items"] == 64
        # With a cap of 2 items per batch every pass holds at most 2 items.
        assert narrow["forward_passes"] >= 32
        assert wide["forward_passes"] < narrow["forward_passes"] / 2
    finally:
        serve.delete("it-reconf")


def test_rerank_sorts_and_trims(apps: str) -> None:
    docs = ["alpha beta", "gamma", "delta epsilon zeta", "eta"]
    body = {"query": "alpha", "documents": docs, "top_n": 2, "return_documents": True}
    data = httpx.post(f"{apps}/it-rank/v1/rerank", json=body).json()
    assert len(data["results"]) == 2
    scores = [r["relevance_score"] for r in data["results"]]
    assert scores == sorted(scores, reverse=True)
    assert data["results"][0]["document"]["text"] == docs[data["results"][0]["index"]]
    full = httpx.post(f"{apps}/it-rank/v1/rerank", json={**body, "top_n": None}).json()
    assert sorted(r["index"] for r in full["results"]) == [0, 1, 2, 3]
    assert data["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(("app", "cases"), [("it-embed", EMBED_BAD), ("it-rank", RANK_BAD)])
def test_bad_input_gets_4xx_and_others_in_flight_still_succeed(
    apps: str, app: str, cases: list
) -> None:
    good_path = "embeddings" if app == "it-embed" else "rerank"
    good = {"input": "fine text"} if app == "it-embed" else {"query": "q", "documents": ["d"]}
    url = f"{apps}/{app}/v1/{good_path}"

    async def main() -> tuple[list, list]:
        async with httpx.AsyncClient(timeout=60) as client:
            bad = [
                client.post(
                    url,
                    content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                    headers={"content-type": "application/json"},
                )
                for _, body, _ in cases
            ]
            fine = [client.post(url, json=good) for _ in range(8)]
            results = await asyncio.gather(*bad, *fine)
        return results[: len(cases)], results[len(cases) :]

    bad, fine = asyncio.run(main())
    for (label, _, expected), response in zip(cases, bad, strict=True):
        assert response.status_code == expected, f"{label}: {response.status_code} {response.text}"
        message = response.json().get("error", {}).get("message", "")
        assert len(message) > 10, f"{label}: error message should say what to change"
    assert [r.status_code for r in fine] == [200] * 8
    assert httpx.get(f"{apps}/{app}/healthz").status_code == 200
