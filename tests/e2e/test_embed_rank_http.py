"""HTTP against the default serve config with the packaged models."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import numpy as np

from tests.bad_inputs import EMBED_BAD, RANK_BAD
from tests.factories import WORDS


def _embed(base: str, texts: list[str] | str) -> list[np.ndarray]:
    response = httpx.post(f"{base}/embed/v1/embeddings", json={"input": texts}, timeout=60)
    assert response.status_code == 200, response.text
    return [np.array(d["embedding"]) for d in response.json()["data"]]


def test_embeddings_rank_a_paraphrase_above_an_unrelated_sentence(default_apps: str) -> None:
    anchor, paraphrase, unrelated = _embed(
        default_apps,
        [
            "A man is playing a guitar on stage.",
            "Someone performs music with a guitar in front of an audience.",
            "The central bank raised interest rates again.",
        ],
    )
    assert anchor.shape == (384,)
    assert float(anchor @ paraphrase) > float(anchor @ unrelated) + 0.3


def test_openai_client_gets_embeddings(default_apps: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_apps}/embed/v1", api_key="unused")
    result = client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello world", "carpool"])
    assert len(result.data) == 2
    assert len(result.data[0].embedding) == 384
    assert result.usage.prompt_tokens > 0
    # The client asks for base64 by default and decodes it; compare with the float path.
    floats = _embed(default_apps, "hello world")[0]
    assert np.abs(np.array(result.data[0].embedding) - floats).max() < 1e-4


def test_rerank_puts_the_relevant_document_first(default_apps: str) -> None:
    docs = [
        "Bananas are a good source of potassium.",
        "Berlin is the capital of Germany.",
        "Paris is the capital and largest city of France.",
        "The mitochondria is the powerhouse of the cell.",
    ]
    response = httpx.post(
        f"{default_apps}/rank/v1/rerank",
        json={"query": "What is the capital of France?", "documents": docs, "top_n": 2},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert results[0]["index"] == 2
    assert len(results) == 2


def _mixed_text(rng: random.Random) -> str:
    # Long-tailed lengths from a handful of words to past the model's 256-token limit.
    words = min(int(rng.paretovariate(1.0) * 6), 400)
    return " ".join(rng.choice(WORDS) for _ in range(max(words, 2)))


def embedder_totals(base: str) -> dict[str, float]:
    """Batching counters summed over the embed app's replicas. /embed/v1/stats answers for
    the replica a call reaches (by pid), so it is read until every running replica answered."""
    from ray import serve

    status = serve.status().applications["embed"].deployments["embedder"]
    running = status.replica_states.get("RUNNING", 0)
    seen: dict[int, dict] = {}
    for _ in range(200):
        stats = httpx.get(f"{base}/embed/v1/stats", timeout=60).json()
        seen[stats["pid"]] = stats
        if len(seen) >= running:
            break
    assert len(seen) == running, f"{len(seen)} of {running} embedder replicas answered /stats"
    keys = ("items", "forward_passes", "real_tokens", "padded_tokens")
    return {k: sum(stats[k] for stats in seen.values()) for k in keys}


def test_concurrent_mixed_lengths_batch_well_without_changing_vectors(default_apps: str) -> None:
    rng = random.Random(7)
    bodies = [{"input": [_mixed_text(rng) for _ in range(rng.randint(1, 4))]} for _ in range(64)]
    url = f"{default_apps}/embed/v1/embeddings"
    before = embedder_totals(default_apps)

    async def burst() -> list[httpx.Response]:
        # All at once, and no retries: a burst of a few seconds of work is served whole
        # (the default admission refuses only past 30 s of queued work).
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(url, json=b) for b in bodies))

    responses = asyncio.run(burst())
    after = embedder_totals(default_apps)
    assert [r.status_code for r in responses] == [200] * 64, [
        r.text[:200] for r in responses if r.status_code != 200
    ]
    items = after["items"] - before["items"]
    passes = after["forward_passes"] - before["forward_passes"]
    waste = 1 - (after["real_tokens"] - before["real_tokens"]) / (
        after["padded_tokens"] - before["padded_tokens"]
    )
    assert items == sum(len(b["input"]) for b in bodies)
    # The executor plans everything waiting into length-sorted passes and runs the most
    # urgent one, then plans again: under a burst the passes must stay large all the same.
    assert items / passes > 5, f"{items} items in {passes} forward passes"
    assert waste < 0.25, f"padding waste {waste:.2%}"
    # The same vectors as when each text runs alone.
    for body, response in list(zip(bodies, responses, strict=True))[:8]:
        batched = [np.array(d["embedding"]) for d in response.json()["data"]]
        for text, vector in zip(body["input"], batched, strict=True):
            assert np.abs(_embed(default_apps, text)[0] - vector).max() < 1e-4


def test_two_bulk_clients_are_served_without_refusals(default_apps: str) -> None:
    # Each request alone is seconds of work on this CPU (16 texts near the 256-token limit);
    # while one runs, the other client's request must wait, not be refused.
    rng = random.Random(11)
    url = f"{default_apps}/embed/v1/embeddings"

    def long_text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(200))

    async def client(http: httpx.AsyncClient) -> list[int]:
        statuses = []
        for _ in range(3):
            r = await http.post(url, json={"input": [long_text() for _ in range(16)]})
            statuses.append(r.status_code)
        return statuses

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(client(http), client(http))

    assert asyncio.run(main()) == [[200] * 3, [200] * 3]


def test_bad_inputs_get_4xx_and_the_server_keeps_serving(default_apps: str) -> None:
    for prefix, path, cases in (("embed", "embeddings", EMBED_BAD), ("rank", "rerank", RANK_BAD)):
        url = f"{default_apps}/{prefix}/v1/{path}"
        for label, body, expected in cases:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = httpx.post(
                url, content=raw, headers={"content-type": "application/json"}, timeout=60
            )
            assert response.status_code == expected, f"{prefix} {label}: {response.text}"
            assert response.json()["error"]["message"], f"{prefix} {label}: no message"
    assert len(_embed(default_apps, "still alive")) == 1
    ok = httpx.post(
        f"{default_apps}/rank/v1/rerank", json={"query": "q", "documents": ["d"]}, timeout=60
    )
    assert ok.status_code == 200
