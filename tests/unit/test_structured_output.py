"""Structured output and tools: the wire rules, the parsers, and constrained decoding (no Ray).

The decoding tests run a tiny *random* causal LM: left alone it writes noise, so output that
parses and matches the schema can only come from the grammar masking its logits.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from carpool.errors import RequestError
from carpool.generation.factory import make_engine
from carpool.generation.sampling import SamplingParams
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.schemas import ChatCompletionRequest, CompletionRequest, GenerationCall
from carpool.generation.sequence import GenSequence, TokenizerInfo
from carpool.generation.structured import (
    MAX_SCHEMA_CHARS,
    ConstraintCompiler,
    OutputConstraint,
)
from carpool.generation.tool_schemas import tool_call_schema
from carpool.generation.tools import (
    ToolParser,
    parse_forced,
    parse_hermes,
    render_tool_messages,
    template_supports_tools,
)
from tests.unit.test_generation_engine import Collect, Steps

MESSAGES = [{"role": "user", "content": "hi"}]
# Bounded on purpose: every value has a bounded length, so a random model must finish it.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "color", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["paris", "rome"]}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def _refusal(**fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        _chat(**fields)
    return str(info.value)


def _json_schema(schema: Any, name: str = "person") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


# --- the wire rules --------------------------------------------------------------------------


def test_response_format_becomes_the_calls_constraint() -> None:
    call = GenerationCall.from_chat(_chat(response_format=_json_schema(PERSON)))
    assert call.constraint == OutputConstraint.json_schema(PERSON).to_dict()
    assert call.constraint_param == "response_format"
    assert OutputConstraint.from_dict(call.constraint).schema_dict() == PERSON
    call = GenerationCall.from_chat(_chat(response_format={"type": "json_object"}))
    assert call.constraint == {"kind": "json_object", "schema": None}
    completion = CompletionRequest.model_validate(
        {"prompt": "a", "response_format": {"type": "json_object"}}
    )
    assert GenerationCall.from_completion(completion).constraint["kind"] == "json_object"
    for text in ({"type": "text"}, None):
        assert GenerationCall.from_chat(_chat(response_format=text)).constraint is None


def test_schemas_keep_their_property_order() -> None:
    a = OutputConstraint.json_schema({"type": "object", "required": ["x"]})
    assert a == OutputConstraint.json_schema({"type": "object", "required": ["x"]})
    assert list(OutputConstraint.json_schema(PERSON).schema_dict()["properties"]) == [
        "name",
        "age",
        "ok",
        "color",
        "tags",
    ]


@pytest.mark.parametrize(
    ("response_format", "words"),
    [
        ({"type": "xml"}, ["'xml'", "json_schema"]),
        ({"type": "json_schema"}, ["json_schema", '"schema"']),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, ["only read"]),
        (_json_schema([1, 2]), ["schema"]),
        (_json_schema({"type": "object"}, name="has space"), ["name"]),
        (_json_schema({"d": "x" * MAX_SCHEMA_CHARS}), ["characters", str(MAX_SCHEMA_CHARS)]),
        (_json_schema(json.loads('{"a":' * 40 + "1" + "}" * 40)), ["nests", "32"]),
        (_json_schema({"type": "string", "maxLength": 10**6}), ["maxLength 1000000", "8192"]),
        (_json_schema({"items": [{"minItems": 9000}]}), ["minItems 9000"]),
        (_json_schema({"type": "string", "pattern": "a{2,5000}"}), ["{2,5000}", "1024"]),
    ],
)
def test_bad_response_formats_are_refused_saying_what_is_wrong(
    response_format: Any, words: list[str]
) -> None:
    message = _refusal(response_format=response_format)
    assert "response_format" in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"stop": ["}"]}, ["stop", "remove stop"]),
        ({"ignore_eos": True}, ["ignore_eos"]),
    ],
)
def test_fields_that_would_break_the_json_are_refused(fields: dict, words: list[str]) -> None:
    for extra in (
        {"response_format": {"type": "json_object"}},
        {"tools": [WEATHER], "tool_choice": "required"},
    ):
        message = _refusal(**extra, **fields)
        for word in words:
            assert word in message


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tool_choice": "auto"}, ["no tools"]),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, ["'sometimes'", "required"]),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            ["'f'", "get_weather"],
        ),
        ({"tools": [WEATHER, WEATHER]}, ["more than once"]),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, ["name"]),
        ({"tools": [{"type": "retrieval"}]}, ["type"]),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            ["response_format", "tool_choice"],
        ),
        ({"functions": [{"name": "f"}]}, ["functions", "tools"]),
        ({"function_call": "auto"}, ["function_call", "tool_choice"]),
    ],
)
def test_bad_tool_fields_are_refused_by_name(fields: dict, words: list[str]) -> None:
    message = _refusal(**fields)
    for word in words:
        assert word in message


def test_tool_messages_and_calls_are_accepted_as_history() -> None:
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    call = GenerationCall.from_chat(
        ChatCompletionRequest.model_validate({"messages": history, "tools": [WEATHER]})
    )
    assert call.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert call.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert call.tools == [WEATHER] and call.constraint is None  # auto: free text
    with pytest.raises(ValidationError, match="only allowed on assistant"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x", "tool_calls": history[1]["tool_calls"]}]}
        )


def test_tool_choice_picks_the_constraint() -> None:
    none = GenerationCall.from_chat(_chat(tools=[WEATHER], tool_choice="none"))
    assert none.tools is None and none.constraint is None
    named = _chat(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    constraint, param = named.constraint()
    assert param == "tools" and constraint.schema_dict() == WEATHER["function"]["parameters"]
    required = _chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    constraint, _ = required.constraint()
    schema = constraint.schema_dict()
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], schema)
    assert "maxItems" not in tool_call_schema(required.tools, parallel=True)


# --- rendering and parsing tools ---------------------------------------------------------------


def test_templates_that_know_tools_are_told_apart() -> None:
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_supports_tools(None)


def test_tools_render_as_hermes_text_when_the_template_cannot() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "rome"}'},
                }
            ],
        },
        {"role": "tool", "content": "rain", "tool_call_id": "c"},
    ]
    out, tools = render_tool_messages(messages, [WEATHER], native=False)
    assert tools is None
    assert (
        out[0]["content"].startswith("Be brief.\n\n# Tools")
        and '"get_weather"' in out[0]["content"]
    )
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}
    native, tools = render_tool_messages(messages, [WEATHER], native=True)
    assert tools == [WEATHER]
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "rome"}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "rome"}'  # a copy


def test_hermes_answers_parse_into_tool_calls() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(text, ["get_weather", "get_time"])
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    # Unclosed at the end (the model stopped): still a call.
    _, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}', ["get_time"])
    assert len(calls) == 1
    # Not JSON, or an unknown function: the whole answer stays text.
    for bad in ("<tool_call>{oops</tool_call>", '<tool_call>{"name": "rm", "arguments": {}}'):
        assert parse_hermes(bad, ["get_time"]) == (bad, [])
    assert parse_hermes("plain answer", ["get_time"]) == ("plain answer", [])


def test_forced_answers_parse_and_cut_ones_do_not() -> None:
    calls = parse_forced('{"city": "rome"}', "named", "get_weather")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "rome"}'}
    calls = parse_forced('[{"name": "get_time", "parameters": {}}]', "required", None)
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert parse_forced('{"city": "ro', "named", "get_weather") == []
    answer = ToolParser("named", ["get_weather"], "get_weather").answer('{"city": "ro', "length")
    assert answer.content == '{"city": "ro' and answer.finish_reason == "length"
    answer = ToolParser("named", ["get_weather"], "get_weather").answer("{}", "stop")
    assert answer.content is None and answer.finish_reason == "tool_calls"


def test_streamed_auto_answers_hold_back_only_what_may_open_a_call() -> None:
    parser = ToolParser("auto", ["get_time"])
    pieces = [
        "Sure",
        ", one <",
        "tool",
        "_call>",
        '{"name": "get_time",',
        ' "arguments": {}}',
        "</tool_call>",
    ]
    sent = "".join(parser.feed(p) for p in pieces)
    assert sent == "Sure, one "
    answer = parser.finish("stop")
    assert answer.finish_reason == "tool_calls" and answer.content is None
    assert answer.tool_calls[0]["function"]["name"] == "get_time"
    # A '<' that does not open a call is released once it clearly does not.
    parser = ToolParser("auto", ["get_time"])
    assert parser.feed("a <") == "a " and parser.feed("b") == "<b"
    assert parser.finish("stop").content is None


# --- constrained decoding on a tiny random model ---------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    import torch
    from transformers import LlamaForCausalLM

    from tests.factories import llama_tokenizer, tiny_llama_config

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, initializer_range=0.5)).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def compiler(tiny) -> ConstraintCompiler:
    model, tokenizer = tiny
    tok = TokenizerInfo.from_tokenizer(tokenizer, model.generation_config)
    compiler = ConstraintCompiler(tokenizer, model.config.vocab_size, tok.eos_ids)
    yield compiler
    compiler.close()


PROMPTS = ["the carpool batch token", "hello", "rain rain rain", "paris is the capital"]


def _engine(tiny, mode: str, max_num_seqs: int = 8):
    model, tokenizer = tiny
    tok = TokenizerInfo.from_tokenizer(tokenizer, model.generation_config)
    return make_engine(mode, model, tok, SchedulerLimits(max_num_seqs, 512), 512, 16)


def _seq(tiny, i: int, collect: Collect, grammar: Any = None, **params: Any) -> GenSequence:
    _, tokenizer = tiny
    p = {"max_tokens": 24, "temperature": 0.0, **params}
    ids = tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"]
    return GenSequence(ids, SamplingParams(**p), collect.sink(i), index=i, grammar=grammar)


def _run(engine, seqs: list[GenSequence], collect: Collect) -> None:
    try:
        engine.submit(seqs)
        collect.wait(len(seqs))
    finally:
        engine.close()


def _accepts(compiler: ConstraintCompiler, tokenizer: Any, schema: dict, prefix: str) -> bool:
    state = compiler.state(compiler.compile(OutputConstraint.json_schema(schema)))
    return all(state.accept(t) for t in tokenizer.encode(prefix, add_special_tokens=False))


@pytest.mark.parametrize("bounds", [{"maxLength": 6}, {"minLength": 1}, {}])
def test_strings_never_take_control_characters(tiny, compiler, bounds) -> None:
    """JSON forbids U+0000-U+001F unescaped; a length bound must not let them in (CI saw
    ``{"name": " lack\x17"}`` from xgrammar's own rule for bounded strings)."""
    _, tokenizer = tiny
    schema = {"type": "object", "properties": {"name": {"type": "string", **bounds}}}
    assert _accepts(compiler, tokenizer, schema, '{"name": "ab')
    for control in ["\x17", "\x00", "\t", "\n"]:
        assert not _accepts(compiler, tokenizer, schema, '{"name": "ab' + control), repr(control)


def test_string_length_bounds_still_hold(tiny, compiler) -> None:
    _, tokenizer = tiny
    bounded = {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 6}},
    }
    assert _accepts(compiler, tokenizer, bounded, '{"name": "abcdef"')
    assert not _accepts(compiler, tokenizer, bounded, '{"name": "abcdefg')
    assert not _accepts(compiler, tokenizer, bounded, '{"name": "a"')
    assert _accepts(compiler, tokenizer, bounded, '{"name": "\u00e9t\u00e9"')


@pytest.mark.parametrize("mode", ["continuous", "static"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}])
def test_a_random_model_writes_json_that_matches_the_schema(tiny, compiler, mode, sampling):
    compiled = compiler.compile(OutputConstraint.json_schema(PERSON))
    collect = Collect()
    seqs = [
        _seq(tiny, i, collect, compiler.state(compiled), max_tokens=200, **sampling)
        for i in range(3)
    ]
    _run(_engine(tiny, mode), seqs, collect)
    for i in range(3):
        assert collect.reason(i) == "stop", collect.text(i)
        value = json.loads(collect.text(i))
        jsonschema.validate(value, PERSON)
        assert list(value) == list(PERSON["properties"])  # in the schema's order


def test_json_object_output_follows_the_json_grammar(tiny, compiler):
    constraint = OutputConstraint.json_object()
    compiled = compiler.compile(constraint)
    collect = Collect()
    seqs = [_seq(tiny, i, collect, compiler.state(compiled), max_tokens=40) for i in range(2)]
    _run(_engine(tiny, "continuous"), seqs, collect)
    for i in range(2):
        text = collect.text(i)
        assert text.startswith("{")
        # Whole or cut by max_tokens, it is a prefix the JSON grammar accepts.
        check = compiler.state(compiled)
        for token in collect.tokens(i):
            assert check.accept(token)
        if collect.reason(i) == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_unconstrained_rows_are_byte_identical_beside_constrained_ones(tiny, compiler, mode):
    free = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "seed": 1}]

    def run(with_constrained: bool) -> tuple[Collect, Steps]:
        collect, steps = Collect(), Steps()
        engine = _engine(tiny, mode)
        engine.listeners.append(steps)
        seqs = [_seq(tiny, i, collect, ignore_eos=True, **p) for i, p in enumerate(free)]
        if with_constrained:
            compiled = compiler.compile(OutputConstraint.json_schema(PERSON))
            seqs += [
                _seq(tiny, 10 + j, collect, compiler.state(compiled), max_tokens=200)
                for j in range(2)
            ]
        _run(engine, seqs, collect)
        return collect, steps

    alone, _ = run(False)
    mixed, steps = run(True)
    assert any(r.decode_seqs == 5 for r in steps.records)  # all five decoded in one step
    for i in range(len(free)):
        assert mixed.tokens(i) == alone.tokens(i)
        assert mixed.text(i) == alone.text(i)
    for j in range(2):
        jsonschema.validate(json.loads(mixed.text(10 + j)), PERSON)


def test_compiles_are_cached_and_bad_schemas_refused(tiny, compiler):
    before = compiler.compiles
    schema = {"type": "object", "properties": {"q": {"type": "boolean"}}}
    first = compiler.compile(OutputConstraint.json_schema(schema))
    assert compiler.compile(OutputConstraint.json_schema(dict(schema))) is first
    assert compiler.compiles == before + 1
    with pytest.raises(ValueError, match='Unsupported type "nope"'):
        compiler.compile(OutputConstraint.json_schema({"type": "nope"}))


def _server(tiny, **overrides: Any):
    from deployments.generator import GeneratorServer

    model, tokenizer = tiny
    config = {
        "source": {"model": "tiny", "max_length": 512},
        "limits": {"max_tokens_limit": 256, "default_max_tokens": 16},
        "batching": {"max_num_seqs": 4, "max_step_tokens": 256},
        **overrides,
    }
    return GeneratorServer(config, model=model, tokenizer=tokenizer)


def test_the_server_constrains_calls_and_refuses_bad_schemas(tiny):
    server = _server(tiny)
    try:
        constraint = OutputConstraint.json_schema(PERSON).to_dict()
        call = GenerationCall(prompts=["hello"], max_tokens=200, n=2, temperature=1.0, seed=5)
        result = asyncio.run(server.generate(call.model_copy(update={"constraint": constraint})))
        for choice in result.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), PERSON)
        bad = {"kind": "json_schema", "schema": '{"type": "nope"}'}
        with pytest.raises(RequestError) as info:
            wrong = {"constraint": bad, "constraint_param": "response_format"}
            asyncio.run(server.generate(call.model_copy(update=wrong)))
        assert info.value.status_code == 400 and info.value.param == "response_format"
        assert 'Unsupported type "nope"' in info.value.message
    finally:
        server.close()


def test_the_server_renders_tools_into_a_template_without_them(tiny):
    server = _server(tiny)
    try:
        call = GenerationCall.from_chat(_chat(tools=[WEATHER]))
        ids = server.prompts.encode(call)[0]
        prompt = server.tokenizer.decode(ids)
        assert "<tools>" in prompt and '"get_weather"' in prompt
        plain = server.tokenizer.decode(server.prompts.encode(GenerationCall.from_chat(_chat()))[0])
        assert "<tools>" not in plain
    finally:
        server.close()


def test_vllm_gets_the_schema_as_its_structured_outputs() -> None:
    from carpool.generation.vllm_options import structured_outputs_kwargs

    assert structured_outputs_kwargs(None) is None
    sent = structured_outputs_kwargs(OutputConstraint.json_schema(PERSON))
    assert sent["disable_any_whitespace"] is True
    name = sent["json"]["properties"]["name"]
    assert name == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{0,6}$'}
    assert {k: v for k, v in sent["json"]["properties"].items() if k != "name"} == {
        k: v for k, v in PERSON["properties"].items() if k != "name"
    }
    assert structured_outputs_kwargs(OutputConstraint.json_object())["json"] == {"type": "object"}


def test_an_untagged_json_call_counts_in_auto_mode() -> None:
    # What Qwen2.5-Coder-0.5B answered to a tool prompt (the tags left out).
    text = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    content, calls = parse_hermes(text, ["get_weather"])
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    for other in ('{"city": "Paris"}', '{"name": "rm", "arguments": {}}', '{"name": "x"} tail'):
        assert parse_hermes(other, ["get_weather"]) == (other, [])
    parser = ToolParser("auto", ["get_weather"])
    assert parser.feed(" ") == "" and parser.feed(text[:10]) == "" and parser.feed(text[10:]) == ""
    answer = parser.finish("stop")
    assert answer.finish_reason == "tool_calls" and answer.content is None
    parser = ToolParser("auto", ["get_weather"])
    assert parser.feed('{"a": 1}') == ""
    assert parser.finish("stop").content == '{"a": 1}'  # not a call: released whole


def test_a_row_whose_grammar_allows_nothing_ends_alone() -> None:
    import torch

    from carpool.generation.structured import apply_grammars

    class NothingAllowed:
        stop_token_ids = frozenset({2})
        dead = False

        def fill(self, bitmask: Any, row: int) -> None:
            bitmask[row].zero_()

    logits = torch.randn(3, 100)
    free = logits[1].clone()
    state = NothingAllowed()
    out = apply_grammars(logits, [state, None, None])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [2]
    assert state.dead and torch.equal(out[1], free)
