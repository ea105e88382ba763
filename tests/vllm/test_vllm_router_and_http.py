"""``mode: vllm`` under the router and behind ``/generate`` with ``model: auto``.

The cascade runs in-process (``RouterServer`` over the session's vLLM server as ``small`` and
carpool's continuous engine as ``large``); streaming and cancellation go over HTTP through
Serve: ingress -> router -> a generator replica running vLLM.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from carpool.generation.hops import RouteDecision
from carpool.generation.schemas import GenerationCall
from router.core import RouterServer
from tests.vllm.conftest import generator_config
from tests.vllm.loop import run

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm")

PREFIX = "/vllm-generate"
APP = "vllm-generate"
PROMPT = "Once upon a time, in a small village,"


def test_cascade_escalates_on_vllm_logprobs(vllm_server: Any, own_server: Any) -> None:
    call = GenerationCall(prompts=["The capital of France is"], max_tokens=16, temperature=0)
    small = run(vllm_server.generate(call.model_copy(update={"judged": True})))
    lps = small.token_logprobs
    assert lps, "vLLM returned no logprobs for the cascade"
    mean = sum(lps) / len(lps)

    def route(threshold: float) -> RouteDecision:
        config = {
            "policy": "cascade",
            "min_mean_logprob": min(threshold, 0.0),
            "escalate_on_length": False,
            "max_repetition": 1.0,
        }
        router = RouterServer(config, {"small": vllm_server, "large": own_server})
        decision = run(router.generate(call)).decision
        assert decision is not None
        return decision

    strict = route(mean + 0.05)
    assert strict.escalated and strict.model == "large", strict
    assert "mean logprob" in strict.reason
    lenient = route(mean - 0.05)
    assert not lenient.escalated and lenient.model == "small", lenient


@pytest.fixture(scope="module")
def app(serve_http: str, smollm2: str) -> Any:
    from ray import serve

    from pipelines.generate import build_generate_app

    small = generator_config(smollm2, "vllm")
    small["source"]["served_model_name"] = "small"
    small["replica"] = {"num_cpus": 0.25, "torch_threads": 1}
    # One queue order: the router's lanes order `auto`, vLLM takes arrival order (serve.yaml).
    small["vllm"] = {**small["vllm"], "priority_scheduling": False}
    args = {
        "small": small,
        "large": None,  # model auto then routes everything to small (no cascade to wait on)
        "default_model": "auto",
        "ingress": {"num_cpus": 0.1},
    }
    serve.run(build_generate_app(args), name=APP, route_prefix=PREFIX)
    yield serve_http + PREFIX
    serve.delete(APP)


def _small_stats() -> dict[str, Any]:
    from ray import serve

    return serve.get_deployment_handle("small", app_name=APP).stats.remote().result()


def test_http_auto_streams_from_vllm(app: str) -> None:
    body = {
        "model": "auto",
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def read() -> tuple[dict[str, str], list[Any]]:
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{app}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200, await response.aread()
            lines = [line async for line in response.aiter_lines()]
            return dict(response.headers), lines

    headers, lines = run(read())
    payloads = [line[6:] for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text_chunks = [c for c in chunks if c["choices"]]
    assert len(text_chunks) > 5, "vLLM's tokens must stream, not arrive at the end"
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    assert headers.get("x-carpool-model") == "small"

    whole = httpx.post(
        f"{app}/v1/completions", json={**body, "stream": False, "stream_options": None}, timeout=120
    )
    assert whole.status_code == 200, whole.text
    streamed = "".join(c["choices"][0]["text"] for c in text_chunks)
    assert streamed == whole.json()["choices"][0]["text"]
    assert _small_stats()["mode"] == "vllm"


def test_http_disconnect_aborts_in_vllm(app: str) -> None:
    first = _small_stats()
    before, tokens_before = first.get("finished_cancelled", 0), first["tokens_generated"]
    body = {
        "model": "auto",
        "prompt": PROMPT,
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    async def read_some_then_hang_up() -> None:
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{app}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leaving the context closes the connection mid-stream

    run(read_some_then_hang_up())
    left = time.monotonic()
    while time.monotonic() - left < 15:
        stats = _small_stats()
        if stats.get("finished_cancelled", 0) > before and stats["running"] == 0:
            break
        time.sleep(0.2)
    stats = _small_stats()
    assert stats.get("finished_cancelled", 0) == before + 1, stats
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    # 1500 tokens at SmolLM2's CPU speed take over a minute: the abort stopped it early.
    assert stats["tokens_generated"] - tokens_before < 1000, stats
