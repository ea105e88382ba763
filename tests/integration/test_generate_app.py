"""The generate pipeline under Serve, on a tiny random causal LM saved to a folder.

``small`` runs the continuous engine, ``large`` the static one (same tiny weights, another
served name), so both modes go through HTTP, streaming and not.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray import serve

from pipelines.generate import build_generate_app

PREFIX = "/it-generate"
# Requests that must be cut short ask for LONG tokens: at ~2 ms a step the tiny model needs
# 30 s or more for them, so a cancel that takes a few seconds on a loaded CI machine still
# lands long before the sequence could end by length (3000 tokens took 6 s and one CI run
# saw the stream finish before its cancel arrived).
LONG = 12_000
CONTEXT = 16_384
PROMPT = "the carpool batch token and the river"


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.factories import save_tiny_lm

    path = Path(tmp_path_factory.mktemp("generate")) / "tiny-lm"
    return save_tiny_lm(path, max_position_embeddings=CONTEXT)


def _generator(path: str, mode: str, name: str) -> dict[str, Any]:
    return {
        "source": {"model": path, "served_model_name": name},
        "mode": mode,
        "replica": {"num_cpus": 0.25, "torch_threads": 1},
        "limits": {"max_seq_len": CONTEXT, "max_tokens_limit": LONG, "default_max_tokens": 16},
        "batching": {"max_num_seqs": 4, "max_step_tokens": 256, "batch_wait_timeout_s": 0.01},
    }


# Both shapes of the app answer every test: a separate ingress in front of the generators,
# and the small generator's replica serving the HTTP itself (direct_streaming).
@pytest.fixture(scope="module", params=["ingress", "direct"])
def app(serve_http: str, tiny_lm: str, request: pytest.FixtureRequest):
    args = {
        "small": _generator(tiny_lm, "continuous", "tiny-small"),
        "large": _generator(tiny_lm, "static", "tiny-large"),
        "ingress": {"num_cpus": 0.1},
        "direct_streaming": request.param == "direct",
    }
    serve.run(build_generate_app(args), name="it-generate", route_prefix=PREFIX)
    yield serve_http + PREFIX
    serve.delete("it-generate")


@pytest.fixture(scope="module")
def reference(tiny_lm: str):
    """Unbatched greedy generate on the same weights, in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm).eval()
    model.generation_config.eos_token_id = None

    def greedy(prompt: str, n: int) -> str:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return greedy


def sse_payloads(lines: list[str]) -> list[Any]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def stream_lines(url: str, body: dict) -> tuple[int, list[str]]:
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", url, json=body) as response,
    ):
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.text]
        return 200, [line async for line in response.aiter_lines()]


@pytest.mark.parametrize("model", ["small", "large"])
def test_completion_is_the_unbatched_greedy_output(app: str, reference, model: str) -> None:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{app}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["model"] == model
    assert data["choices"][0]["text"] == reference(PROMPT, 12)
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 12
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 12


@pytest.mark.parametrize("model", ["small", "tiny-large"])
def test_streamed_completion_arrives_in_chunks_with_usage(app: str, reference, model) -> None:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, lines = asyncio.run(stream_lines(f"{app}/v1/completions", body))
    assert status == 200, lines
    payloads = sse_payloads(lines)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    text_chunks = [c for c in chunks if c["choices"]]
    # The first token alone, then messages of up to stream_interval_tokens (8) tokens.
    assert len(text_chunks) >= 2
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == reference(PROMPT, 10)
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.parametrize("model", ["small", "large"])
def test_chat_completion_streamed_and_not(app: str, model: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{app}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant"
    status, lines = asyncio.run(
        stream_lines(f"{app}/v1/chat/completions", {**body, "stream": True})
    )
    assert status == 200
    chunks = [p for p in sse_payloads(lines) if p != "[DONE]"]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_models_lists_both_sizes(app: str) -> None:
    r = httpx.get(f"{app}/v1/models", timeout=30)
    assert r.status_code == 200
    cards = {c["id"]: c for c in r.json()["data"]}
    assert {"small", "large"} <= set(cards)  # the router adds "auto"
    assert cards["small"]["root"] == "tiny-small" and cards["small"]["max_model_len"] == CONTEXT


BAD: list[tuple[str, str, Any, int, str]] = [
    ("malformed JSON", "completions", b'{"prompt": "a", ', 400, "not valid JSON"),
    ("not an object", "completions", b"[1, 2]", 400, "JSON object"),
    ("missing prompt", "completions", {"max_tokens": 3}, 400, "'prompt' is required"),
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt[0] is empty"),
    ("unknown model", "completions", {"prompt": "a", "model": "gpt-9"}, 404, "not served"),
    ("max_tokens zero", "completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens over limit", "completions", {"prompt": "a", "max_tokens": LONG + 1}, 400, str(LONG)),
    ("max_tokens huge", "completions", {"prompt": "a", "max_tokens": 10**9}, 400, "max_tokens"),
    ("temperature", "completions", {"prompt": "a", "temperature": 9}, 400, "temperature"),
    ("top_p zero", "completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("too many stops", "completions", {"prompt": "a", "stop": list("abcde")}, 400, "at most 4"),
    ("penalty out of range", "completions", {"prompt": "a", "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("unknown field", "completions", {"prompt": "a", "tools": []}, 400, "not supported"),
    ("prompt too long", "completions", {"prompt": "rain " * (CONTEXT + 100)}, 400, "prompt tokens"),
    ("empty messages", "chat/completions", {"messages": []}, 400, "messages is empty"),
    ("bad role", "chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400, "role"),
    ("image part", "chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "type"),
    ("n too big", "chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "n": 99}, 400, "n"),
    ("stream_options without stream", "chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "stream_options": {"include_usage": True}},
     400, "stream: true"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "route", "body", "status", "says"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_that_says_what_to_change(app, what, route, body, status, says):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{app}/v1/{route}", headers=headers, timeout=60, **kwargs)
    assert r.status_code == status, (what, r.text)
    message = r.json()["error"]["message"]
    assert says in message, message


def test_bad_streamed_request_fails_before_the_stream_starts(app: str) -> None:
    body = {"prompt": "a", "max_tokens": LONG + 1, "stream": True}
    status, lines = asyncio.run(stream_lines(f"{app}/v1/completions", body))
    assert status == 400 and str(LONG) in lines[0]


def test_concurrent_requests_share_decode_steps_and_all_complete(app: str) -> None:
    async def many() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{app}/v1/completions",
                        json={"prompt": f"{PROMPT} {i}", "max_tokens": 8 + 4 * i, "seed": i},
                    )
                    for i in range(8)
                )
            )

    before = httpx.get(f"{app}/v1/stats", timeout=30).json()["small"]
    responses = asyncio.run(many())
    assert [r.status_code for r in responses] == [200] * 8
    stats = httpx.get(f"{app}/v1/stats", timeout=30).json()["small"]
    assert stats["max_running"] > 1
    assert stats["sequences_finished"] - before["sequences_finished"] == 8


def test_disconnecting_a_stream_frees_its_slot(app: str) -> None:
    """The client reads a few chunks and goes away; the replica stops generating for it."""

    def small_stats() -> dict:
        return httpx.get(f"{app}/v1/stats", timeout=30).json()["small"]

    before = small_stats()
    body = {
        "model": "small",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }

    async def read_some_then_leave() -> int:
        seen = 0
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream("POST", f"{app}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        return seen

    assert asyncio.run(read_some_then_leave()) == 3
    deadline = time.monotonic() + 60
    stats = small_stats()
    while stats.get("finished_cancelled", 0) <= before.get("finished_cancelled", 0):
        assert time.monotonic() < deadline, {k: v for k, v in stats.items() if "finished" in k}
        time.sleep(0.1)
        stats = small_stats()
    assert stats["running"] == 0
    assert stats["output_tokens"] - before["output_tokens"] < LONG
    # The replica is fine and serves the next request.
    r = httpx.post(f"{app}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def _engine_totals(app: str) -> dict[str, float]:
    stats = httpx.get(f"{app}/v1/stats", timeout=30).json()
    models = [stats[name] for name in ("small", "large") if name in stats]
    keys = ("running", "output_tokens", "tokens_generated", "finished_cancelled")
    return {k: sum(m.get(k, 0) for m in models) for k in keys}


def _wait_idle(app: str, before: dict[str, float]) -> dict[str, float]:
    deadline = time.monotonic() + 30
    stats = _engine_totals(app)
    while stats["running"] > 0:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
        stats = _engine_totals(app)
    return stats


def test_a_deadline_stops_generation_through_the_router_with_504(app: str) -> None:
    before = _engine_totals(app)
    body = {"model": "auto", "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    started = time.monotonic()
    r = httpx.post(
        f"{app}/v1/completions",
        json=body,
        headers={"x-carpool-deadline-ms": "1500"},
        timeout=60,
    )
    took = time.monotonic() - started
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    assert took < 6, f"504 after {took:.1f} s for a 1.5 s deadline"
    after = _wait_idle(app, before)
    assert after["tokens_generated"] - before["tokens_generated"] < LONG


def test_a_client_leaving_a_routed_request_frees_the_generator_slot(app: str) -> None:
    """Ingress -> router -> generator: the disconnect cancels all the way down."""
    before = _engine_totals(app)
    body = {"model": "auto", "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{app}/v1/completions", json=body, timeout=1.5)
    left = time.monotonic()
    # On a busy machine the request may still sit in the router's lane when the client
    # leaves; then the router drops it and no generator ever starts it. Either way nothing
    # may generate for it to the end: a sequence left running would finish by length.
    while True:
        after = _engine_totals(app)
        if after["finished_cancelled"] > before["finished_cancelled"]:
            break
        never_started = after["tokens_generated"] == before["tokens_generated"]
        if never_started and after["running"] == 0 and time.monotonic() - left > 5:
            break
        assert time.monotonic() - left < 30, (before, after)
        time.sleep(0.2)
    after = _wait_idle(app, before)
    assert after["tokens_generated"] - before["tokens_generated"] < LONG
    r = httpx.post(f"{app}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_the_openai_url_reaches_either_shape(app: str, serve_http: str) -> None:
    """The OpenAI app finds the generate app's ingress whichever deployment it is."""
    from pipelines.openai_api import build_openai_app

    args = {"embed_app": None, "rank_app": None, "rag_app": None, "generate_app": "it-generate"}
    serve.run(build_openai_app(args), name="it-generate-openai", route_prefix="/it-generate-v1")
    try:
        body = {
            "model": "small",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
        }
        r = httpx.post(f"{serve_http}/it-generate-v1/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        serve.delete("it-generate-openai")
