"""``/generate`` from the default serve config, through the official ``openai`` client.

Real packaged models: SmolLM2-135M-Instruct as ``small`` and Qwen2.5-Coder-0.5B-Instruct as
``large``. Short ``max_tokens`` keep this tier quick on CPU.
"""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(default_apps: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_apps}/generate/v1", api_key="unused", timeout=120)


def test_models_lists_small_and_large(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"small", "large", "auto"}


def test_small_chat_answers_greedily(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="small",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_small_chat_streams(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="small",
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text.strip()
    assert finishes[-1] in ("stop", "length")
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 16


def test_small_completion_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="small", prompt="The sky is", max_tokens=8, temperature=0
    )
    assert whole.choices[0].text.strip()
    assert whole.usage.completion_tokens <= 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="small", prompt="The sky is", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text


def test_large_chat_and_streamed_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="large",
        messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        max_tokens=12,
        temperature=0,
    )
    assert reply.choices[0].message.content.strip()
    assert reply.model == "large"
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="large", prompt="def fibonacci(n):", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces).strip()


def test_bad_requests_raise_client_errors_that_say_what_to_change(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="use one of"):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Lower max_tokens"):
        client.completions.create(model="small", prompt="hi", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model="small", messages=[], max_tokens=2)
