"""The OpenAI app over every pipeline on tiny models (issue 15): one base URL, routed by
``model`` to the per-pipeline apps' own deployments, answering as their prefixes do."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from ray import serve

from tests.all_apps import DeployedApps, deploy_all_apps
from tests.all_apps import error_message as _error
from tests.all_apps import post_json as _post

OPENAI_APP = "oa-openai_api"  # deploy_all_apps runs the OpenAI app with the pipelines
QUESTION = [{"role": "user", "content": "What colour is the Zorblatt bridge in Quillon?"}]


@pytest.fixture(scope="module")
def apps(serve_http: str, tiny_models: dict[str, str]) -> Iterator[tuple[DeployedApps, str]]:
    with deploy_all_apps(tiny_models, serve_http, "oa") as deployed:
        assert deployed.names["openai_api"] == OPENAI_APP
        yield deployed, deployed.url("openai_api")


def test_models_lists_every_pipelines_models_as_their_own_apps_do(
    apps: tuple[DeployedApps, str],
) -> None:
    deployed, base = apps
    cards = httpx.get(f"{base}/v1/models", timeout=60).json()["data"]
    by_id = {card["id"]: card for card in cards}
    assert set(by_id) == {"tiny-encoder", "tiny-cross-encoder", "small", "large", "auto", "rag"}
    for card in cards:
        assert card["object"] == "model" and card["owned_by"] == "carpool"
        assert isinstance(card["created"], int) and card["created"] > 0
    # The cards are the per-pipeline apps' own (same created: their settings, not a copy).
    for app in ("embed", "rank", "rag"):
        own = httpx.get(deployed.url(app, "/v1/models"), timeout=60).json()["data"][0]
        assert by_id[own["id"]] == own
    assert by_id["small"]["root"] == "tiny-small" and by_id["small"]["max_model_len"] == 512


def test_embeddings_reach_the_embed_apps_embedder(apps: tuple[DeployedApps, str]) -> None:
    deployed, base = apps
    texts = ["the river city", "paris is the capital of france", "a third"]
    before = httpx.get(deployed.url("embed", "/v1/stats"), timeout=60).json()["items"]
    here = _post(f"{base}/v1/embeddings", {"model": "tiny-encoder", "input": texts})
    assert here.status_code == 200, here.text
    after = httpx.get(deployed.url("embed", "/v1/stats"), timeout=60).json()["items"]
    assert after - before == len(texts)  # the one embedder replica, shared, did the work
    own = _post(deployed.url("embed", "/v1/embeddings"), {"input": texts}).json()
    np.testing.assert_allclose(
        [d["embedding"] for d in here.json()["data"]],
        [d["embedding"] for d in own["data"]],
        atol=1e-5,
    )
    # The embed app's own limits apply here (no second copy in this app's args).
    over = _post(f"{base}/v1/embeddings", {"input": ["word"] * 2049})
    assert over.status_code == 400 and "2048" in _error(over)


def test_the_openai_app_owns_no_deployment_but_its_ingress(
    apps: tuple[DeployedApps, str],
) -> None:
    deployments = serve.status().applications[OPENAI_APP].deployments
    assert set(deployments) == {"openai_ingress"}


def test_rerank_v1_and_cohere_v2_answer_as_the_rank_app(apps: tuple[DeployedApps, str]) -> None:
    deployed, base = apps
    body = {"query": "river", "documents": ["the river", "a city", "music and guitar"]}
    for path in ("/v1/rerank", "/v2/rerank"):
        here = _post(f"{base}{path}", {**body, "model": "tiny-cross-encoder"})
        own = _post(deployed.url("rank", path), body)
        assert here.status_code == own.status_code == 200, here.text
        assert [r["index"] for r in here.json()["results"]] == [
            r["index"] for r in own.json()["results"]
        ]
    assert "meta" in here.json()  # Cohere's v2 shape


def test_completions_and_chat_route_to_the_named_generator(apps: tuple[DeployedApps, str]) -> None:
    deployed, base = apps
    body = {"prompt": "the river", "max_tokens": 4, "temperature": 0}
    for model in ("small", "tiny-large"):
        here = _post(f"{base}/v1/completions", {**body, "model": model})
        own = _post(deployed.url("generate", "/v1/completions"), {**body, "model": model})
        assert here.status_code == 200, here.text
        assert here.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
        assert here.json()["model"] == model
    # n is the generator's to honour, even though /rag (the other chat pipeline) refuses it.
    two = _post(
        f"{base}/v1/chat/completions",
        {"model": "small", "messages": QUESTION, "max_tokens": 3, "n": 2, "temperature": 0},
    )
    assert two.status_code == 200, two.text
    assert len(two.json()["choices"]) == 2


def test_chat_streams_through_the_official_client(apps: tuple[DeployedApps, str]) -> None:
    _, base = apps
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    assert {m.id for m in client.models.list().data} >= {"small", "rag", "tiny-encoder"}
    chunks = list(
        client.chat.completions.create(
            model="small",
            messages=QUESTION,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4
    vectors = client.embeddings.create(model="tiny-encoder", input=["hello", "world"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) > 0
    with pytest.raises(openai.NotFoundError, match="use one of"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)


def test_model_rag_answers_with_citations_and_rags_own_field_rules(
    apps: tuple[DeployedApps, str],
) -> None:
    _, base = apps
    url = f"{base}/v1/chat/completions"
    answer = _post(url, {"model": "rag", "messages": QUESTION, "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json()["citations"] and "x-carpool-citations" in answer.headers
    refused = _post(url, {"model": "rag", "messages": QUESTION, "n": 2})
    assert refused.status_code == 400 and "n is 2" in _error(refused)
    lines = []
    with httpx.stream(
        "POST",
        url,
        json={"model": "rag", "messages": QUESTION, "max_tokens": 4, "stream": True},
        timeout=120,
    ) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["citations"]


def test_a_model_of_another_endpoint_gets_404_saying_where_it_is(
    apps: tuple[DeployedApps, str],
) -> None:
    _, base = apps
    wrong = _post(f"{base}/v1/embeddings", {"model": "small", "input": "hello"})
    assert wrong.status_code == 404
    message = _error(wrong)
    assert "'tiny-encoder'" in message and "/v1/chat/completions" in message
    assert wrong.json()["error"]["code"] == "model_not_found"
    bad_field = _post(
        f"{base}/v1/chat/completions", {"model": "small", "messages": QUESTION, "x": 1}
    )
    assert bad_field.status_code == 400 and "'x' is not supported" in _error(bad_field)
