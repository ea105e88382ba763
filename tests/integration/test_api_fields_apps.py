"""Fields real clients send, over HTTP on tiny models (issue 15): token-id embeddings, OpenAI's
2048-input limit, Cohere's ``/v2/rerank``, ``created`` on model cards, and a RAG chat that
honours ``stop``, ``seed`` and ``stream_options`` and refuses what it cannot do by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from ray import serve

from tests.all_apps import DeployedApps, app_args, deploy_all_apps
from tests.all_apps import error_message as _error
from tests.all_apps import post_json as _post
from tests.factories import bert_tokenizer

QUESTION = [{"role": "user", "content": "What colour is the Zorblatt bridge in Quillon?"}]
RAG_SMALL = "af-rag-small"


@pytest.fixture(scope="module")
def apps(serve_http: str, tiny_models: dict[str, str]) -> Iterator[DeployedApps]:
    from pipelines.rag import build_rag_app

    with deploy_all_apps(tiny_models, serve_http, "af") as deployed:
        # A second RAG ingress answering with the small generator directly (no router
        # cascade), so a greedy answer is one model's and a stop string can be checked.
        args = app_args(tiny_models, deployed.names)["rag"]
        serve.run(
            build_rag_app({**args, "generator_deployment": "small"}),
            name=RAG_SMALL,
            route_prefix=f"/{RAG_SMALL}",
        )
        try:
            yield deployed
        finally:
            serve.delete(RAG_SMALL)


# --- embeddings ------------------------------------------------------------------------------


def test_token_id_inputs_embed_like_their_text(apps: DeployedApps) -> None:
    url = apps.url("embed", "/v1/embeddings")
    texts = ["the river city", "paris is the capital of france"]
    ids = bert_tokenizer()(texts)["input_ids"]
    by_text = _post(url, {"input": texts})
    by_ids = _post(url, {"input": ids})
    one = _post(url, {"input": ids[0]})
    assert by_text.status_code == by_ids.status_code == one.status_code == 200, by_ids.text
    a = np.array([d["embedding"] for d in by_text.json()["data"]])
    b = np.array([d["embedding"] for d in by_ids.json()["data"]])
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(one.json()["data"][0]["embedding"], a[0], atol=1e-5)
    assert by_ids.json()["usage"]["prompt_tokens"] == sum(len(s) for s in ids)


def test_foreign_token_ids_get_a_400_naming_the_langchain_setting(apps: DeployedApps) -> None:
    # What LangChain's OpenAIEmbeddings sends by default: tiktoken ids, past BERT's vocabulary.
    response = _post(apps.url("embed", "/v1/embeddings"), {"input": [[15339, 1917], [100257]]})
    assert response.status_code == 400
    message = _error(response)
    assert "input[1]" in message and "check_embedding_ctx_length=False" in message


def test_embeddings_take_openais_2048_inputs_and_say_the_limit_past_it(
    apps: DeployedApps,
) -> None:
    url = apps.url("embed", "/v1/embeddings")
    ok = _post(url, {"input": ["word"] * 2048})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 2048
    over = _post(url, {"input": ["word"] * 2049})
    assert over.status_code == 400
    assert "2048" in _error(over) and "split" in _error(over)


# --- rerank and model cards ------------------------------------------------------------------


def test_cohere_v2_rerank_answers_in_cohere_shape(apps: DeployedApps) -> None:
    docs = ["the river", "a city", "music and guitar"]
    model = httpx.get(apps.url("rank", "/v1/models"), timeout=60).json()["data"][0]["id"]
    v2 = _post(
        apps.url("rank", "/v2/rerank"),
        {"model": model, "query": "river", "documents": [docs[0], {"text": docs[1]}, docs[2]]},
    )
    assert v2.status_code == 200, v2.text
    body = v2.json()
    v1 = _post(apps.url("rank", "/v1/rerank"), {"query": "river", "documents": docs}).json()
    assert [r["index"] for r in body["results"]] == [r["index"] for r in v1["results"]]
    for mine, theirs in zip(body["results"], v1["results"], strict=True):
        assert mine["relevance_score"] == pytest.approx(theirs["relevance_score"])
        assert set(mine) == {"index", "relevance_score"}
    assert body["meta"]["billed_units"]["search_units"] == 1
    assert body["meta"]["api_version"]["version"] == "2"
    assert isinstance(body["id"], str) and body["id"]
    top = _post(
        apps.url("rank", "/v2/rerank"),
        {"query": "river", "documents": docs, "top_n": 1, "return_documents": True},
    ).json()
    assert len(top["results"]) == 1
    assert top["results"][0]["document"]["text"] == docs[top["results"][0]["index"]]


def test_cohere_v2_rerank_refuses_what_it_cannot_do_by_name(apps: DeployedApps) -> None:
    url = apps.url("rank", "/v2/rerank")
    short = _post(url, {"query": "q", "documents": ["a"], "max_tokens_per_doc": 10})
    assert short.status_code == 400
    assert "max_tokens_per_doc" in _error(short) and "64" in _error(short)
    assert _post(url, {"query": "q", "documents": ["a"], "max_tokens_per_doc": 4096}).is_success
    unknown = _post(url, {"query": "q", "documents": ["a"], "rank_fields": ["t"]})
    assert unknown.status_code == 400 and "rank_fields" in _error(unknown)
    assert _post(url, {"query": "q", "documents": ["a"], "model": "rerank-v3.5"}).status_code == 404


@pytest.mark.parametrize("app", ["embed", "rank", "rag"])
def test_model_cards_carry_created(apps: DeployedApps, app: str) -> None:
    cards = httpx.get(apps.url(app, "/v1/models"), timeout=60).json()["data"]
    assert cards and all(isinstance(c["created"], int) and c["created"] > 0 for c in cards)
    if app == "rag":
        assert [c["id"] for c in cards] == ["rag"]


# --- rag -------------------------------------------------------------------------------------


def _rag(apps: DeployedApps, body: dict, app: str = RAG_SMALL) -> httpx.Response:
    base = apps.base + f"/{app}" if app == RAG_SMALL else apps.url("rag")
    return _post(f"{base}/v1/chat/completions", {"messages": QUESTION, "max_tokens": 12, **body})


def _answer(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"].split("\n\nSources: ")[0]


def test_rag_checks_model_against_what_it_serves(apps: DeployedApps) -> None:
    assert _rag(apps, {"model": "rag"}, app="rag").status_code == 200
    wrong = _rag(apps, {"model": "gpt-4o"}, app="rag")
    assert wrong.status_code == 404 and "'rag'" in _error(wrong)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 2),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("response_format", {"type": "json_object"}),
        ("logprobs", True),
        ("modalities", ["text"]),
    ],
)
def test_rag_refuses_fields_it_cannot_honour(apps: DeployedApps, field: str, value: object) -> None:
    response = _rag(apps, {field: value}, app="rag")
    assert response.status_code == 400
    assert field in _error(response)


def test_rag_seed_makes_sampling_repeatable(apps: DeployedApps) -> None:
    first = _answer(_rag(apps, {"temperature": 1.0, "seed": 11}))
    again = _answer(_rag(apps, {"temperature": 1.0, "seed": 11}))
    other = _answer(_rag(apps, {"temperature": 1.0, "seed": 12}))
    assert first == again
    assert first != other  # a random tiny model over a 49k vocabulary: seeds that differ


def test_rag_stop_ends_the_answer(apps: DeployedApps) -> None:
    # Seeded sampling repeats token for token (the test above), so the same request with a
    # stop string taken from the middle of the answer must end where that string first shows.
    # (The tiny model's greedy answer is only newlines.)
    sampled = {"temperature": 1.0, "seed": 5}
    full = _answer(_rag(apps, sampled))
    assert len(full) >= 4, full
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    stopped = _rag(apps, {**sampled, "stop": [stop]})
    assert _answer(stopped) == full[: full.index(stop)]
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("app", ["rag", RAG_SMALL])
def test_rag_a_conversation_the_generator_cannot_fit_is_a_400_streamed_or_not(
    apps: DeployedApps, app: str
) -> None:
    # The generator refuses a prompt over its context at the stream's first event; /rag
    # answers only once that event is in, as /generate does, so the refusal is a 400 naming
    # the field rather than an error inside a 200 stream. The question itself is short, so
    # retrieval and rerank run as usual.
    earlier = [
        {"role": "user", "content": "Tell me about rivers."},
        {"role": "assistant", "content": " ".join(["river"] * 2000)},
    ]
    for stream in (False, True):
        response = _rag(apps, {"messages": [*earlier, *QUESTION], "stream": stream}, app=app)
        assert response.status_code == 400, (stream, response.text)
        assert response.json()["error"]["param"] == "messages"
        assert "Shorten it" in _error(response)


def test_rag_streams_usage_when_asked(apps: DeployedApps) -> None:
    body = {
        "messages": QUESTION,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with httpx.stream(
        "POST", apps.url("rag", "/v1/chat/completions"), json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert last["usage"]["total_tokens"] == (
        last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    )
    assert all(c["usage"] is None for c in chunks[:-1])
