"""Structured output and tools through the generate app under Serve, on a tiny random LM.

``small`` runs the continuous engine and ``large`` the static one. The model writes noise
unless constrained, so JSON that parses and matches its schema, and tool calls whose
arguments match the function's parameters, come from constrained decoding alone.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from ray import serve

from pipelines.generate import build_generate_app
from tests.integration.test_generate_app import sse_payloads, stream_lines

PREFIX = "/it-structured"
MESSAGES = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["paris", "rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.factories import save_tiny_lm

    return save_tiny_lm(Path(tmp_path_factory.mktemp("structured")) / "tiny-lm")


def _generator(path: str, mode: str, name: str) -> dict[str, Any]:
    return {
        "source": {"model": path, "served_model_name": name},
        "mode": mode,
        "replica": {"num_cpus": 0.25, "torch_threads": 1},
        "limits": {"max_seq_len": 512, "max_tokens_limit": 300, "default_max_tokens": 16},
        "batching": {"max_num_seqs": 4, "max_step_tokens": 256, "batch_wait_timeout_s": 0.01},
    }


@pytest.fixture(scope="module")
def app(serve_http: str, tiny_lm: str):
    args = {
        "small": _generator(tiny_lm, "continuous", "tiny-small"),
        "large": _generator(tiny_lm, "static", "tiny-large"),
        "router": None,
        "ingress": {"num_cpus": 0.1},
    }
    serve.run(build_generate_app(args), name="it-structured", route_prefix=PREFIX)
    yield serve_http + PREFIX
    serve.delete("it-structured")


def _chat(app: str, body: dict[str, Any]) -> httpx.Response:
    full = {"messages": MESSAGES, "max_tokens": 200, **body}
    return httpx.post(f"{app}/v1/chat/completions", json=full, timeout=120)


def _error(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


@pytest.mark.parametrize("model", ["small", "large"])
def test_json_schema_output_parses_and_matches(app: str, model: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    r = _chat(app, {"model": model, "response_format": response_format, "n": 2, "seed": 4})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        assert "tool_calls" not in choice["message"]


def test_completions_take_response_format_too(app: str) -> None:
    body = {
        "prompt": "a person:",
        "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    r = httpx.post(f"{app}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)
    r = httpx.post(
        f"{app}/v1/completions",
        json={"prompt": "x", "max_tokens": 8, "response_format": {"type": "json_object"}},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{")


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]


def test_the_openai_clients_parse_helper_gets_its_model(app: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused")
    completion = client.chat.completions.parse(
        model="small", messages=MESSAGES, response_format=Person, max_tokens=200
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.color in ("red", "green", "blue")


def test_streamed_json_is_the_same_json(app: str) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 200,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    whole = _chat(app, body).json()["choices"][0]["message"]["content"]
    status, lines = asyncio.run(
        stream_lines(f"{app}/v1/chat/completions", {**body, "stream": True})
    )
    assert status == 200
    chunks = [p for p in sse_payloads(lines) if p != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole


@pytest.mark.parametrize("model", ["small", "large"])
def test_a_named_tool_choice_returns_a_matching_call(app: str, model: str) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(app, {"model": model, "tools": [WEATHER, TIME], "tool_choice": choice})
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    assert out["message"]["content"] is None
    (call,) = out["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_required_tool_choice_calls_one_of_the_tools(app: str) -> None:
    body = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    r = _chat(app, body)
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    (call,) = out["message"]["tool_calls"]
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(json.loads(call["function"]["arguments"]), tools[call["function"]["name"]])


def test_auto_tool_choice_and_tool_history_answer_in_openai_shape(app: str) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "rome", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = httpx.post(
        f"{app}/v1/chat/completions",
        json={"messages": history, "tools": [WEATHER], "max_tokens": 12},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    # A random model does not write <tool_call> blocks: its answer is plain content.
    assert out["finish_reason"] in ("stop", "length") and isinstance(out["message"]["content"], str)


def test_streamed_tool_calls_arrive_as_openai_deltas(app: str) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 200,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "stream": True,
    }
    status, lines = asyncio.run(stream_lines(f"{app}/v1/chat/completions", body))
    assert status == 200, lines
    chunks = [p for p in sse_payloads(lines) if p != "[DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(
        json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"]
    )
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_openai_client_reads_tool_calls(app: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="large",
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}},
            "response_format",
            'Unsupported type "nope"',
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
        ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "response_format", "stop"),
        ({"tools": [WEATHER], "tool_choice": "maybe"}, "tool_choice", "'maybe'"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "'x'",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "tools"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_gets_a_400_naming_it(
    app: str, body: dict[str, Any], param: str, says: str
) -> None:
    r = _chat(app, body)
    assert r.status_code == 400, r.text
    error = _error(r)
    assert error["param"] == param and says in error["message"], error
