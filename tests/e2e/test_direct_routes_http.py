"""HAProxy's direct routes on serve.yaml's apps (pipelines/direct_routes.py): a ``/v1``
request naming a pipeline's model is sent to that app by HAProxy, not through the OpenAI
app's ingress; anything else still goes through ``/v1``. Read from HAProxy's own request
counters per backend (its Prometheus exporter), so the test sees where requests went."""

from __future__ import annotations

import os
import re

import httpx
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "0",
    reason="RAY_SERVE_ENABLE_HA_PROXY=0: Serve's Python proxy has no direct routes",
)

EMBEDDER = "all-MiniLM-L6-v2"  # serve.yaml's embed app's served name
_COUNTER = re.compile(r'^haproxy_backend_http_requests_total\{proxy="([^"]+)"\} (\S+)$', re.M)


def requests_per_backend() -> dict[str, float]:
    port = os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {name: float(value) for name, value in _COUNTER.findall(text)}


def backend(counts: dict[str, float], app: str) -> str:
    # Ray names an HTTP app's backend "http-<app>"
    names = [name for name in counts if re.fullmatch(rf"(.*[-_])?{re.escape(app)}", name)]
    assert len(names) == 1, (app, sorted(counts))
    return names[0]


def sent(before: dict[str, float], after: dict[str, float], app: str) -> float:
    name = backend(after, app)
    return after[name] - before.get(name, 0.0)


def test_v1_embeddings_naming_the_embedder_skip_the_openai_ingress(default_apps: str) -> None:
    texts = ["A man plays guitar.", "Someone is playing an instrument."]
    before = requests_per_backend()
    direct = [
        httpx.post(
            f"{default_apps}/v1/embeddings", json={"model": EMBEDDER, "input": texts}, timeout=120
        )
        for _ in range(5)
    ]
    after = requests_per_backend()
    assert [r.status_code for r in direct] == [200] * 5, direct[0].text
    assert direct[0].json()["model"] == EMBEDDER
    assert sent(before, after, "embed") == 5
    assert sent(before, after, "openai") == 0
    # The same answer as through /v1's ingress (no model: its default, so not routed)
    through_v1 = httpx.post(f"{default_apps}/v1/embeddings", json={"input": texts}, timeout=120)
    last = requests_per_backend()
    assert sent(after, last, "openai") == 1 and sent(after, last, "embed") == 0
    assert through_v1.json()["data"] == direct[0].json()["data"]


def test_a_wrong_model_still_gets_v1s_answer_saying_where_it_is(default_apps: str) -> None:
    wrong = httpx.post(
        f"{default_apps}/v1/embeddings", json={"model": "small", "input": "x"}, timeout=60
    )
    assert wrong.status_code == 404
    assert "/v1/chat/completions" in wrong.json()["error"]["message"]


def test_chat_naming_a_tier_goes_to_the_generate_app(default_apps: str) -> None:
    before = requests_per_backend()
    reply = httpx.post(
        f"{default_apps}/v1/chat/completions",
        json={"model": "small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=300,
    )
    after = requests_per_backend()
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "small"
    assert sent(before, after, "generate") == 1
    assert sent(before, after, "openai") == 0
