"""OpenAI/Cohere fields real clients send: honoured or refused by name (issue 15).

No Ray: request models, the call a pipeline hands its generator, pooling read from a model
folder, and token-id inputs on a tiny real encoder.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipelines.rag import RagChatRequest, generation_call

Q = [{"role": "user", "content": "What colour is the bridge?"}]


class _Controls:
    deadline = None
    priority = "interactive"


def _rag(**fields: object) -> RagChatRequest:
    return RagChatRequest.model_validate({"messages": Q, **fields})


def _rag_error(**fields: object) -> str:
    with pytest.raises(ValidationError) as info:
        _rag(**fields)
    return str(info.value)


def test_rag_passes_sampling_fields_to_the_generator() -> None:
    body = _rag(stop=["\n\n", "END"], seed=7, temperature=0.3, top_p=0.9, n=1, max_tokens=5)
    call = generation_call(body, "SYS", 5, _Controls())
    assert call["stop"] == ["\n\n", "END"]
    assert call["seed"] == 7
    assert call["temperature"] == 0.3 and call["top_p"] == 0.9
    assert call["n"] == 1 and call["max_tokens"] == 5
    assert call["messages"][0] == {"role": "system", "content": "SYS"}
    assert call["messages"][-1]["content"] == Q[0]["content"]


def test_rag_uses_openai_defaults_for_absent_or_null_fields() -> None:
    for body in (_rag(), _rag(temperature=None, top_p=None, n=None, stop=None, seed=None)):
        call = generation_call(body, "SYS", 5, _Controls())
        assert call["temperature"] == 1.0  # OpenAI's default, not greedy
        assert call["top_p"] == 1.0
        assert call["stop"] == [] and call["seed"] is None
    assert generation_call(_rag(stop="X"), "S", 5, _Controls())["stop"] == ["X"]


def test_rag_keeps_client_system_messages_after_its_own() -> None:
    body = RagChatRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Answer in French."},
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Où est "},
                        {"type": "text", "text": "Paris?"},
                    ],
                },
            ]
        }
    )
    call = generation_call(body, "SOURCES", 5, _Controls())
    system = call["messages"][0]["content"]
    assert system.startswith("SOURCES") and "Answer in French." in system and "Be brief." in system
    assert [m["role"] for m in call["messages"]] == ["system", "user"]
    assert call["messages"][1]["content"] == "Où est Paris?"


def test_rag_streams_usage_only_when_asked() -> None:
    assert _rag(stream=True, stream_options={"include_usage": True}).include_usage()
    assert not _rag(stream=True).include_usage()
    assert "stream_options" in _rag_error(stream_options={"include_usage": True})


@pytest.mark.parametrize(
    ("fields", "named", "advice"),
    [
        ({"n": 2}, "n", "set it to 1"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "remove tools"),
        ({"tool_choice": "auto"}, "tool_choice", "remove tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format", "remove"),
        ({"logit_bias": {"5": 1}}, "logit_bias", "remove"),
        ({"logprobs": True}, "logprobs", "remove"),
        ({"top_logprobs": 2}, "top_logprobs", "remove"),
        ({"presence_penalty": 0.5}, "presence_penalty", "set it to 0"),
        ({"frequency_penalty": 1}, "frequency_penalty", "set it to 0"),
        ({"reasoning_effort": "low"}, "reasoning_effort", None),
        ({"temprature": 0.5}, "temprature", None),
        ({"stop": ["a"] * 5}, "stop", "at most"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "only one"),
    ],
)
def test_rag_refuses_what_it_cannot_honour_by_name(
    fields: dict, named: str, advice: str | None
) -> None:
    message = _rag_error(**fields)
    assert named in message
    if advice:
        assert advice in message


def test_rag_refuses_unknown_fields_in_messages_and_tool_roles() -> None:
    with pytest.raises(ValidationError, match="tool_calls"):
        RagChatRequest.model_validate(
            {"messages": [*Q, {"role": "assistant", "content": "x", "tool_calls": []}]}
        )
    with pytest.raises(ValidationError, match="role"):
        RagChatRequest.model_validate({"messages": [*Q, {"role": "tool", "content": "x"}]})


def test_rag_accepts_values_that_ask_for_what_it_does() -> None:
    # Neutral values clients send by default are not refusals.
    body = _rag(
        n=1,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        presence_penalty=0,
        frequency_penalty=None,
        logprobs=False,
        parallel_tool_calls=None,
        user="me",
    )
    assert body.question() == Q[0]["content"]
