"""serve.yaml's one OpenAI base URL (the ``openai`` app at ``/``), through the official
``openai`` client: every packaged model at ``/v1``, routed by ``model``; Cohere's rerank at
``/v2/rerank``. The per-pipeline prefixes keep answering beside it (longest prefix wins)."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

FACT = (
    "The Zorblatt bridge in the town of Quillon was painted bright orange in 1987 by the "
    "local fishermen's guild, who wanted ships to see it through the fog."
)
SERVED = {
    "all-MiniLM-L6-v2",  # the embed app's embedder
    "SmolLM2-135M-Instruct",  # the rank app's ranker
    "small",
    "large",
    "auto",
    "rag",
}


@pytest.fixture(scope="module")
def client(default_apps: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_apps}/v1", api_key="unused", timeout=300)


def test_models_lists_every_served_model(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == SERVED
    assert all(m.owned_by == "carpool" and m.created > 0 for m in models.values())


def test_embeddings_match_the_embed_prefix(client: openai.OpenAI, default_apps: str) -> None:
    texts = ["A man plays guitar.", "Someone is playing an instrument."]
    here = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # base64 on the wire
    own = httpx.post(
        f"{default_apps}/embed/v1/embeddings", json={"input": texts}, timeout=120
    ).json()
    assert [len(d.embedding) for d in here.data] == [384, 384]
    np.testing.assert_allclose(
        [d.embedding for d in here.data], [d["embedding"] for d in own["data"]], atol=1e-5
    )


def test_chat_and_completions_reach_the_named_generator(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="small",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.model == "small"
    whole = client.completions.create(
        model="small", prompt="The sky is", max_tokens=6, temperature=0
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="small", prompt="The sky is", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text and streamed.strip()


def test_rerank_v1_and_cohere_v2_at_the_root(default_apps: str) -> None:
    body = {
        "query": "What is the capital of France?",
        "documents": ["Paris is the capital of France.", "Bananas are yellow."],
    }
    v1 = httpx.post(f"{default_apps}/v1/rerank", json=body, timeout=120)
    assert v1.status_code == 200, v1.text
    assert v1.json()["results"][0]["index"] == 0
    v2 = httpx.post(
        f"{default_apps}/v2/rerank",
        json={**body, "model": "SmolLM2-135M-Instruct", "top_n": 1},
        timeout=120,
    )
    assert v2.status_code == 200, v2.text
    assert [r["index"] for r in v2.json()["results"]] == [0]
    assert v2.json()["meta"]["api_version"]["version"] == "2"


def test_model_rag_answers_with_citations(client: openai.OpenAI, default_apps: str) -> None:
    ingest = httpx.post(
        f"{default_apps}/rag/v1/documents",
        json={"documents": [{"id": "quillon", "text": FACT}]},
        timeout=120,
    )
    assert ingest.status_code == 200, ingest.text
    reply = client.chat.completions.create(
        model="rag",
        messages=[{"role": "user", "content": "What colour is the Zorblatt bridge in Quillon?"}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.model_extra["citations"][0] == "quillon"


def test_unknown_models_and_paths_say_what_exists(client: openai.OpenAI, default_apps: str) -> None:
    with pytest.raises(openai.NotFoundError, match="use one of") as info:
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "'rag'" in str(info.value) and "'small'" in str(info.value)
    missing = httpx.get(f"{default_apps}/v1/nothing-here", timeout=30)
    assert missing.status_code == 404 and "no such route" in missing.json()["error"]["message"]


def test_the_per_pipeline_prefixes_still_answer_beside_the_root(default_apps: str) -> None:
    for prefix, name in [("embed", "all-MiniLM-L6-v2"), ("rag", "rag"), ("search", "search")]:
        models = httpx.get(f"{default_apps}/{prefix}/v1/models", timeout=60)
        assert models.status_code == 200, (prefix, models.text)
        assert [m["id"] for m in models.json()["data"]] == [name]
    assert httpx.get(f"{default_apps}/healthz", timeout=30).json() == {"status": "ok"}
