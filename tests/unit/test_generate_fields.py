"""``/generate`` request fields (issue 15): null accepted, the unsupported refused by name,
``logprobs`` / ``top_logprobs`` honoured in OpenAI's shapes, streamed and not.

No Ray: request models, the sampler on hand-made logits, and the plain generator server on
a tiny random Llama, with the ingress's own chunk formatters applied to its stream.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from pydantic import ValidationError

from carpool.generation.hops import GenerationEvent
from carpool.generation.logprobs import chat_logprobs, completion_logprobs
from carpool.generation.sampling import (
    SamplerState,
    SamplingParams,
    apply_penalties,
    top_alternatives,
)
from carpool.generation.schemas import ChatCompletionRequest, CompletionRequest, GenerationCall
from carpool.http import _describe_validation_error

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def _refusal(cls: type, **fields: Any) -> tuple[str, str | None]:
    """The 400's message and param for a body, as the ingress's error handler words them."""
    with pytest.raises(ValidationError) as info:
        cls.model_validate(fields)
    return _describe_validation_error(info.value.errors()[0])


# --- null and neutral values ------------------------------------------------------------

NULLS = {
    "model": None,
    "temperature": None,
    "top_p": None,
    "n": None,
    "stream": None,
    "stream_options": None,
    "stop": None,
    "seed": None,
    "user": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "logit_bias": None,
    "ignore_eos": None,
}


def test_null_optional_fields_mean_openai_defaults() -> None:
    chat = GenerationCall.from_chat(
        _chat(
            **NULLS,
            max_tokens=None,
            max_completion_tokens=None,
            logprobs=None,
            top_logprobs=None,
            tools=None,
            tool_choice=None,
            response_format=None,
            parallel_tool_calls=None,
        )
    )
    completion = GenerationCall.from_completion(
        CompletionRequest.model_validate(
            {"prompt": "a", **NULLS, "logprobs": None, "echo": None, "best_of": None}
        )
    )
    for call in (chat, completion):
        assert call.n == 1
        assert call.temperature == 1.0 and call.top_p == 1.0
        assert call.stop == [] and call.seed is None
        assert call.ignore_eos is False
        assert call.logprobs is None
    assert _chat(stream=None).stream is None  # not streamed
    for call in (chat, completion):
        assert call.presence_penalty == 0.0 and call.frequency_penalty == 0.0


def test_penalties_reach_the_generation_call() -> None:
    call = GenerationCall.from_chat(_chat(presence_penalty=0.5, frequency_penalty=-1.5))
    assert call.presence_penalty == 0.5 and call.frequency_penalty == -1.5
    completion = CompletionRequest.model_validate(
        {"prompt": "a", "presence_penalty": 2, "frequency_penalty": 0.25}
    )
    call = GenerationCall.from_completion(completion)
    assert call.presence_penalty == 2.0 and call.frequency_penalty == 0.25


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 0, "frequency_penalty": 0.0},
        {"tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"logit_bias": {}},
        {"top_k": -1, "min_p": 0, "repetition_penalty": 1, "min_tokens": 0},
        {"store": False, "modalities": ["text"], "service_tier": "auto"},
        {"logprobs": False, "top_logprobs": 0},
    ],
)
def test_neutral_values_of_unsupported_fields_are_accepted(fields: dict[str, Any]) -> None:
    _chat(**fields)


@pytest.mark.parametrize(
    ("fields", "param", "hint"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "-2"),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "remove it"),
        ({"tool_choice": "required"}, "tool_choice", "send tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format", '"schema"'),
        ({"top_k": 40}, "top_k", "send -1"),
        ({"min_p": 0.1}, "min_p", "send 0"),
        ({"repetition_penalty": 1.2}, "repetition_penalty", "send 1"),
        ({"min_tokens": 5}, "min_tokens", "send 0"),
        ({"functions": [{"name": "f"}]}, "functions", "remove"),
        ({"audio": {"voice": "alloy"}}, "audio", "remove"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "remove"),
        ({"top_logprobs": 25, "logprobs": True}, "top_logprobs", "20"),
    ],
)
def test_chat_refuses_what_it_cannot_honour_by_name(
    fields: dict[str, Any], param: str, hint: str
) -> None:
    message, where = _refusal(ChatCompletionRequest, messages=MESSAGES, **fields)
    assert where == param
    assert param in message and hint in message


def test_top_logprobs_needs_logprobs_true() -> None:
    message, _ = _refusal(ChatCompletionRequest, messages=MESSAGES, top_logprobs=2)
    assert "logprobs: true" in message


@pytest.mark.parametrize(
    ("fields", "param", "hint"),
    [
        ({"echo": True}, "echo", "false"),
        ({"best_of": 3}, "best_of", "set it to 1"),
        ({"suffix": "end"}, "suffix", "remove"),
        ({"logprobs": 6}, "logprobs", "5"),
        ({"prompt": [1, 2, 3]}, "prompt", "as text"),
        ({"prompt": [[1, 2]]}, "prompt", "as text"),
        ({"presence_penalty": 9}, "presence_penalty", "2"),
        ({"logit_bias": {"1": 5}}, "logit_bias", "remove"),
    ],
)
def test_completions_refuse_what_they_cannot_honour_by_name(
    fields: dict[str, Any], param: str, hint: str
) -> None:
    message, where = _refusal(CompletionRequest, **{"prompt": "a", **fields})
    assert where == param
    assert param in message and hint in message


def test_unknown_fields_are_still_refused_by_name() -> None:
    message, where = _refusal(ChatCompletionRequest, messages=MESSAGES, temprature=0.2)
    assert where == "temprature" and "remove it" in message


def test_logprobs_reach_the_generation_call() -> None:
    assert GenerationCall.from_chat(_chat(logprobs=True)).logprobs == 0
    assert GenerationCall.from_chat(_chat(logprobs=True, top_logprobs=3)).logprobs == 3
    assert GenerationCall.from_chat(_chat(logprobs=False, top_logprobs=0)).logprobs is None
    completion = CompletionRequest.model_validate({"prompt": "a", "logprobs": 2})
    assert GenerationCall.from_completion(completion).logprobs == 2


# --- the sampler's alternatives ---------------------------------------------------------


def test_top_alternatives_are_the_best_tokens_under_the_sampled_distribution() -> None:
    import torch

    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    states = [
        SamplerState(SamplingParams(temperature=0.0, top_logprobs=4)),
        SamplerState(SamplingParams(temperature=0.5, top_logprobs=2)),
        SamplerState(SamplingParams(temperature=1.0)),
    ]
    tops = top_alternatives(logits, states)
    greedy = torch.log_softmax(logits[0], -1)
    expected0 = torch.topk(greedy, 4)
    assert [t for t, _ in tops[0]] == expected0.indices.tolist()
    assert [lp for _, lp in tops[0]] == pytest.approx(expected0.values.tolist(), abs=1e-6)
    warm = torch.log_softmax(logits[1] / 0.5, -1)
    assert [t for t, _ in tops[1]] == torch.topk(warm, 2).indices.tolist()
    assert tops[1][0][1] == pytest.approx(float(warm.max()), abs=1e-6)
    assert tops[2] == []
    # Nobody asking costs nothing and returns nothing.
    assert top_alternatives(logits, states[2:]) == [[]]


def test_penalties_lower_the_logits_of_generated_tokens() -> None:
    import torch

    logits = torch.zeros(3, 6)
    states = [
        SamplerState(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)),
        SamplerState(SamplingParams(frequency_penalty=-1.0)),
        SamplerState(SamplingParams()),
    ]
    for token in (2, 2, 4):
        for state in states:
            state.observe(token)
    out = apply_penalties(logits, states)
    assert out[0].tolist() == [0, 0, -(0.5 + 2 * 0.25), 0, -(0.5 + 0.25), 0]
    assert out[1].tolist() == [0, 0, 2.0, 0, 1.0, 0]
    assert out[2].tolist() == [0.0] * 6 and states[2].counts == {}  # unpenalized: no counts
    assert logits.abs().sum() == 0  # the caller's logits are left alone
    assert apply_penalties(logits, states[2:]) is logits  # nothing to do: no copy


# --- the generator server, end to end on a tiny model -------------------------------------


@pytest.fixture(scope="module")
def server() -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from deployments.generator import GeneratorServer
    from tests.factories import llama_tokenizer, tiny_llama_config

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, initializer_range=0.5)).eval()
    srv = GeneratorServer(
        {
            "limits": {"max_seq_len": 256},
            "batching": {"max_num_seqs": 4, "batch_wait_timeout_s": 0.0},
        },
        model=model,
        tokenizer=tokenizer,
    )
    yield srv
    srv.close()


def _call(**fields: Any) -> GenerationCall:
    return GenerationCall.model_validate(
        {"messages": MESSAGES, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **fields}
    )


def _reference(server: Any, ids: list[int]) -> list[float]:
    """log_softmax of one unbatched forward at each output token."""
    import torch

    text = server.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    prompt = server.tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = server.model(torch.tensor([prompt + ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(ids)]


def test_generate_returns_each_tokens_logprob_and_alternatives(server: Any) -> None:
    result = asyncio.run(server.generate(_call(logprobs=3)))
    record = result.choices[0].logprobs
    assert record is not None
    assert len(record["tokens"]) == result.completion_tokens == 6
    assert record["token_logprobs"] == pytest.approx(_reference(server, result.token_ids), abs=1e-4)
    decoded = [server.tokenizer.decode([t]) for t in result.token_ids]
    assert record["tokens"] == decoded
    for token, logprob, top in zip(
        record["tokens"], record["token_logprobs"], record["top_logprobs"], strict=True
    ):
        assert len(top) == 3
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the best alternative, with the same logprob.
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob, abs=1e-5)

    chat = chat_logprobs(record)["content"]
    assert [c["token"] for c in chat] == decoded
    assert chat[0]["bytes"] == list(decoded[0].encode("utf-8"))
    assert len(chat[0]["top_logprobs"]) == 3 and chat[0]["top_logprobs"][0]["token"] == decoded[0]

    legacy = completion_logprobs(record)
    assert legacy["tokens"] == decoded
    assert legacy["text_offset"][0] == 0
    assert legacy["text_offset"][-1] == sum(len(t) for t in decoded[:-1])
    assert all(decoded[i] in legacy["top_logprobs"][i] for i in range(6))


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_penalties_steer_greedy_choice_like_a_reference(mode: str) -> None:
    """Each greedy token is the argmax of the penalized logits of an unbatched forward."""
    import torch
    from transformers import LlamaForCausalLM

    from deployments.generator import GeneratorServer
    from tests.factories import llama_tokenizer, tiny_llama_config

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    # At this scale the random model's greedy answer repeats one token (margins ~0.1).
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, initializer_range=0.1)).eval()
    srv = GeneratorServer(
        {"mode": mode, "limits": {"max_seq_len": 256}, "batching": {"max_num_seqs": 2}},
        model=model,
        tokenizer=tokenizer,
    )
    base: dict[str, Any] = {"prompts": ["the the the the"], "max_tokens": 12, "temperature": 0.0}
    try:
        plain = asyncio.run(srv.generate(GenerationCall(**base, ignore_eos=True)))
        steered = asyncio.run(
            srv.generate(
                GenerationCall(**base, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0)
            )
        )
    finally:
        srv.close()
    # Unpenalized the model repeats itself; the penalties push it to other tokens.
    assert len(set(plain.token_ids)) <= 2
    assert len(set(steered.token_ids)) > len(set(plain.token_ids)) + 2

    prompt = tokenizer(base["prompts"][0])["input_ids"]
    tokens = steered.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    counts: dict[int, int] = {}
    for k, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + k].clone()
        for seen, c in counts.items():
            row[seen] -= 1.5 + 1.0 * c
        assert int(torch.argmax(row)) == token, f"step {k}"
        expected = float(torch.log_softmax(row, -1)[token])
        assert steered.token_logprobs[k] == pytest.approx(expected, abs=1e-4)
        counts[token] = counts.get(token, 0) + 1


def test_without_logprobs_the_choices_carry_none(server: Any) -> None:
    result = asyncio.run(server.generate(_call()))
    assert result.choices[0].logprobs is None


def test_logprobs_of_sampled_choices_are_finite_per_choice(server: Any) -> None:
    result = asyncio.run(server.generate(_call(n=2, temperature=0.9, seed=5, logprobs=0)))
    for choice in result.choices:
        record = choice.logprobs
        assert record is not None
        assert len(record["token_logprobs"]) == 6
        assert all(math.isfinite(lp) and lp <= 0 for lp in record["token_logprobs"])
        assert record["top_logprobs"] == [[]] * 6


async def _stream(server: Any, call: GenerationCall) -> list[GenerationEvent]:
    return [event async for event in server.stream(call)]


def _formatters() -> tuple[Any, Any]:
    """The ingress's own chunk formatters (they use nothing of the instance)."""
    from pipelines.generate import GenerateIngress

    return (
        GenerateIngress._chat_chunks(None, "small", 1, False),
        GenerateIngress._completion_chunks(None, "small", False),
    )


def test_streamed_logprobs_match_the_whole_answer(server: Any) -> None:
    whole = asyncio.run(server.generate(_call(logprobs=2))).choices[0].logprobs
    assert whole is not None
    events = asyncio.run(_stream(server, _call(logprobs=2)))
    chat_fmt, completion_fmt = _formatters()

    chat_chunks = [chunk for event in events for chunk in chat_fmt(event)]
    content = [
        entry
        for chunk in chat_chunks
        for choice in chunk["choices"]
        if choice["logprobs"] is not None
        for entry in choice["logprobs"]["content"]
    ]
    assert [c["token"] for c in content] == whole["tokens"]
    assert [c["logprob"] for c in content] == pytest.approx(whole["token_logprobs"], abs=1e-5)
    assert all(len(c["top_logprobs"]) == 2 for c in content)

    legacy = [
        choice["logprobs"]
        for event in events
        for chunk in completion_fmt(event)
        for choice in chunk["choices"]
        if choice["logprobs"] is not None
    ]
    tokens = [t for lp in legacy for t in lp["tokens"]]
    offsets = [o for lp in legacy for o in lp["text_offset"]]
    assert tokens == whole["tokens"]
    assert offsets == completion_logprobs(whole)["text_offset"]  # continues across chunks


def test_streams_without_logprobs_carry_none(server: Any) -> None:
    events = asyncio.run(_stream(server, _call()))
    chat_fmt, _ = _formatters()
    chunks = [chunk for event in events for chunk in chat_fmt(event)]
    assert chunks and all(c["logprobs"] is None for chunk in chunks for c in chunk["choices"])
    assert all(e.logprobs is None for e in events)


def test_static_engine_reports_alternatives_too() -> None:
    import threading

    import torch
    from transformers import LlamaForCausalLM

    from carpool.generation.factory import make_engine
    from carpool.generation.scheduler import SchedulerLimits
    from carpool.generation.sequence import GenSequence, SeqEvent, TokenizerInfo
    from tests.factories import llama_tokenizer, tiny_llama_config

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, initializer_range=0.5)).eval()
    engine = make_engine(
        "static", model, TokenizerInfo.from_tokenizer(tokenizer), SchedulerLimits(2, 256), 256
    )
    events: list[SeqEvent] = []
    done = threading.Event()

    def sink(event: SeqEvent) -> None:
        events.append(event)
        if event.finish_reason:
            done.set()

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, top_logprobs=2)
    try:
        engine.submit([GenSequence(tokenizer("hello there")["input_ids"], params, sink)])
        assert done.wait(60)
    finally:
        engine.close()
    tokens = [t for e in events for t in e.token_ids]
    tops = [top for e in events for top in e.top_logprobs]
    assert len(tops) == len(tokens) == 4
    assert all(len(top) == 2 and top[0][0] == t for top, t in zip(tops, tokens, strict=True))


def test_zero_probability_tokens_report_a_finite_floor() -> None:
    import json

    from carpool.generation.logprobs import LOGPROB_FLOOR, TokenTexts, raw_record

    texts = TokenTexts(lambda ids: f"<{ids[0]}>")
    record = raw_record(texts, [7], [float("-inf")], [[(7, float("-inf")), (3, float("nan"))]])
    assert record["token_logprobs"] == [LOGPROB_FLOOR]
    assert record["top_logprobs"] == [[["<7>", LOGPROB_FLOOR], ["<3>", LOGPROB_FLOOR]]]
    json.dumps(chat_logprobs(record), allow_nan=False)  # what the JSON response does
    json.dumps(completion_logprobs(record), allow_nan=False)
