"""The RAG pipeline over HTTP with the packaged models: answers cite the document used."""

from __future__ import annotations

import json

import httpx
import openai

FACT = (
    "The Zorblatt bridge in the town of Quillon was painted bright orange in 1987 by the "
    "local fishermen's guild, who wanted ships to see it through the fog."
)
QUESTION = "What colour is the Zorblatt bridge in Quillon?"


def _ingest(base: str) -> None:
    response = httpx.post(
        f"{base}/rag/v1/documents",
        json={"documents": [{"id": "quillon", "text": FACT}]},
        timeout=120,
    )
    assert response.status_code == 200, response.text


def test_rag_answer_cites_the_document_that_holds_the_answer(default_apps: str) -> None:
    _ingest(default_apps)
    client = openai.OpenAI(base_url=f"{default_apps}/rag/v1", api_key="unused", timeout=180)
    reply = client.chat.completions.create(
        model="rag",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    text = reply.choices[0].message.content
    assert "[quillon]" in text
    assert reply.model_extra["citations"][0] == "quillon"
    assert reply.usage.completion_tokens > 0
    # The search pipeline ranks the same document first.
    hits = httpx.post(
        f"{default_apps}/search/v1/search", json={"query": QUESTION, "top_n": 1}, timeout=120
    ).json()["results"]
    assert hits[0]["doc_id"] == "quillon"


def test_rag_streams_tokens_then_citations(default_apps: str) -> None:
    _ingest(default_apps)
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "stream": True}
    chunks = []
    with httpx.stream(
        "POST", f"{default_apps}/rag/v1/chat/completions", json=body, timeout=180
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-carpool-citations"].split(",")[0] == "quillon"
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert len(chunks) >= 3  # role, some content, the closing chunk
    assert chunks[-1]["citations"][0] == "quillon"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_rag_rejects_bad_input(default_apps: str) -> None:
    url = f"{default_apps}/rag/v1/chat/completions"
    for body in (
        {"messages": []},
        {"messages": [{"role": "assistant", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "  "}]},
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 0},
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 5000},
    ):
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["message"]
