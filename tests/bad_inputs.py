"""Hostile and malformed requests every pipeline must answer with a 4xx (never a 5xx)."""

from __future__ import annotations

# (description, path suffix, raw body bytes or JSON-able object, expected status)
EMBED_BAD: list[tuple[str, bytes | object, int]] = [
    ("malformed JSON", b'{"input": ["a", ', 400),
    ("not an object", b'["just", "a", "list"]', 400),
    ("non-UTF-8 body", b'{"input": "\xff\xfe\xfa"}', 400),
    ("missing input", {"model": "x"}, 400),
    ("input wrong type", {"input": 42}, 400),
    ("input mixing token ids and text", {"input": [1, "a", 3]}, 400),
    ("token ids outside the vocabulary", {"input": [[101, 102], [15339, 100257]]}, 400),
    ("negative token id", {"input": [101, -1, 102]}, 400),
    ("empty string", {"input": ""}, 400),
    ("whitespace string", {"input": "   "}, 400),
    ("empty list", {"input": []}, 400),
    ("empty item in list", {"input": ["ok", ""]}, 400),
    ("too many inputs", {"input": ["x"] * 5000}, 400),
    ("dimensions", {"input": "hi", "dimensions": 64}, 400),
    ("bad encoding_format", {"input": "hi", "encoding_format": "hex"}, 400),
    ("unknown field", {"input": "hi", "temperature": 1}, 400),
    ("unknown model", {"input": "hi", "model": "gpt-9"}, 404),
    ("too long, truncate false", {"input": "word " * 3000, "truncate": False}, 413),
    ("oversized body", b'{"input": "' + b"a" * (17 * 1024 * 1024) + b'"}', 413),
]

RANK_BAD: list[tuple[str, bytes | object, int]] = [
    ("malformed JSON", b'{"query": "q", "documents": [', 400),
    ("non-UTF-8 body", b'{"query": "\xc3\x28", "documents": ["a"]}', 400),
    ("missing query", {"documents": ["a"]}, 400),
    ("missing documents", {"query": "q"}, 400),
    ("empty query", {"query": "", "documents": ["a"]}, 400),
    ("blank query", {"query": "  ", "documents": ["a"]}, 400),
    ("empty documents", {"query": "q", "documents": []}, 400),
    ("empty document", {"query": "q", "documents": ["a", ""]}, 400),
    ("documents wrong type", {"query": "q", "documents": "abc"}, 400),
    ("top_n zero", {"query": "q", "documents": ["a"], "top_n": 0}, 400),
    ("top_n string", {"query": "q", "documents": ["a"], "top_n": "two"}, 400),
    ("too many documents", {"query": "q", "documents": ["d"] * 5000}, 400),
    ("unknown model", {"query": "q", "documents": ["a"], "model": "nope"}, 404),
    (
        "too long, truncate false",
        {"query": "q", "documents": ["word " * 3000], "truncate": False},
        413,
    ),
]


# --- hostile input at scale, for every app (tests/integration/test_hostile_inputs.py) -------
#
# (label, path, body, extra headers, expected status or statuses). A body that is bytes is sent
# as is (content-type application/json unless the headers say otherwise); anything else is
# JSON-encoded. Lone surrogates, NaN and Infinity are written as raw JSON text, since Python's
# encoder would refuse or escape them.

Hostile = tuple[str, str, object, dict[str, str | bytes], int | frozenset[int]]
MIB = 1024 * 1024
ANY_4XX = frozenset(range(400, 500))
OK_OR_400 = frozenset({200, 400})  # lax coercion (e.g. "3" for 3) may be accepted
NOT_5XX = frozenset(range(200, 500))  # whatever the route makes of it, never a server error


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def hostile_common(path: str, field: str) -> list[Hostile]:
    """What every JSON route must refuse with a 4xx, whatever its schema."""
    return [
        ("body over 16 MiB", path, b'{"x": "' + b"a" * (17 * MIB) + b'"}', {}, 413),
        ("100k nested arrays", path, _deep(100_000), {}, 400),
        ("100k nested objects", path, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, {}, 400),
        (
            "nested 900 deep in a field",
            path,
            f'{{"{field}": '.encode() + _deep(900) + b"}",
            {},
            400,
        ),
        ("invalid UTF-8", path, f'{{"{field}": "'.encode() + b'\xff\xfe\xc3\x28"}', {}, 400),
        ("empty body", path, b"", {}, 400),
        ("null body", path, b"null", {}, 400),
        ("string body", path, b'"just a string"', {}, 400),
        ("1e309 body", path, b"1e309", {}, 400),
        ("NaN body", path, b"NaN", {}, 400),
        ("text/plain", path, b"{}", {"content-type": "text/plain"}, 400),
        ("form encoded", path, b"a=b", {"content-type": "application/x-www-form-urlencoded"}, 400),
        ("no content-type", path, b"{}", {"content-type": ""}, 400),
        ("null field", path, {field: None}, {}, 400),
        ("unknown field", path, {field: "x", "\u0000evil": 1}, {}, 400),
        ("deadline garbage", path, {field: "x"}, {"x-carpool-deadline-ms": "1e999"}, 400),
        ("deadline NaN", path, {field: "x"}, {"x-carpool-deadline-ms": "NaN"}, 400),
        ("deadline negative", path, {field: "x"}, {"x-carpool-deadline-ms": "-5"}, 400),
        ("priority latin-1 junk", path, {field: "x"}, {"x-carpool-priority": b"\xff" * 4000}, 400),
        ("priority huge", path, {field: "x"}, {"x-carpool-priority": "urgent" * 1000}, 400),
        ("60 KB junk header", path, {field: "x"}, {"x-carpool-junk": "z" * 60_000}, NOT_5XX),
        (
            "200 junk headers",
            path,
            {field: "x"},
            {f"x-carpool-{i}": "z" for i in range(200)},
            NOT_5XX,
        ),
    ]


def _lone(field_json: str) -> bytes:
    return field_json.encode()


EMBED_HOSTILE: list[Hostile] = [
    ("lone surrogate", "/v1/embeddings", _lone('{"input": "a\\ud800b"}'), {}, 400),
    (
        "lone low surrogate in list",
        "/v1/embeddings",
        _lone('{"input": ["ok", "\\udfff"]}'),
        {},
        400,
    ),
    ("surrogate pair is fine", "/v1/embeddings", _lone('{"input": "\\ud83d\\ude00"}'), {}, 200),
    ("NUL inside text", "/v1/embeddings", {"input": "a\u0000b"}, {}, 200),
    ("dimensions NaN", "/v1/embeddings", b'{"input": "a", "dimensions": NaN}', {}, 400),
    ("dimensions Infinity", "/v1/embeddings", b'{"input": "a", "dimensions": Infinity}', {}, 400),
    ("dimensions -Infinity", "/v1/embeddings", b'{"input": "a", "dimensions": -Infinity}', {}, 400),
    ("dimensions 1e309", "/v1/embeddings", b'{"input": "a", "dimensions": 1e309}', {}, 400),
    ("dimensions 2**63", "/v1/embeddings", {"input": "a", "dimensions": 2**63}, {}, 400),
    ("4000 inputs", "/v1/embeddings", {"input": ["some words here"] * 4000}, {}, 400),
    ("2049 inputs", "/v1/embeddings", {"input": ["x"] * 2049}, {}, 400),
    ("2048 inputs", "/v1/embeddings", {"input": ["x"] * 2048}, {}, 200),
    ("256 long inputs", "/v1/embeddings", {"input": ["word " * 2000] * 256}, {}, 200),
    ("1M-character input", "/v1/embeddings", {"input": "w" * 1_000_000}, {}, 413),
    ("1M+1-character input", "/v1/embeddings", {"input": "w" * 1_000_001}, {}, 400),
    ("null everywhere", "/v1/embeddings", {"input": None, "model": None, "user": None}, {}, 400),
    ("duplicate keys", "/v1/embeddings", b'{"input": "a", "input": "b"}', {}, 200),
    ("truncate as string", "/v1/embeddings", {"input": "a", "truncate": "yes"}, {}, OK_OR_400),
    ("input as number", "/v1/embeddings", {"input": 1e308}, {}, 400),
]

RANK_HOSTILE: list[Hostile] = [
    (
        "lone surrogate query",
        "/v1/rerank",
        _lone('{"query": "\\ud800", "documents": ["a"]}'),
        {},
        400,
    ),
    (
        "lone surrogate doc",
        "/v1/rerank",
        _lone('{"query": "q", "documents": ["\\udc00"]}'),
        {},
        400,
    ),
    ("top_n NaN", "/v1/rerank", b'{"query": "q", "documents": ["a"], "top_n": NaN}', {}, 400),
    ("top_n 1e309", "/v1/rerank", b'{"query": "q", "documents": ["a"], "top_n": 1e309}', {}, 400),
    ("top_n 2**63", "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 2**63}, {}, 200),
    ("top_n -1", "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, {}, 400),
    (
        "top_n as string",
        "/v1/rerank",
        {"query": "q", "documents": ["a"], "top_n": "1"},
        {},
        OK_OR_400,
    ),
    ("4000 documents", "/v1/rerank", {"query": "q", "documents": ["doc"] * 4000}, {}, 400),
    ("256 long documents", "/v1/rerank", {"query": "q", "documents": ["w " * 5000] * 256}, {}, 200),
    ("1M-character query", "/v1/rerank", {"query": "q" * 1_000_000, "documents": ["a"]}, {}, 413),
    ("null everywhere", "/v1/rerank", {"query": None, "documents": None, "top_n": None}, {}, 400),
    ("documents of nulls", "/v1/rerank", {"query": "q", "documents": [None] * 100}, {}, 400),
]

SEARCH_HOSTILE: list[Hostile] = [
    ("lone surrogate query", "/v1/search", _lone('{"query": "\\udbff"}'), {}, 400),
    ("top_k NaN", "/v1/search", b'{"query": "q", "top_k": NaN}', {}, 400),
    ("top_k 1e309", "/v1/search", b'{"query": "q", "top_k": 1e309}', {}, 400),
    ("top_k 2**63", "/v1/search", {"query": "q", "top_k": 2**63}, {}, 400),
    ("top_n 0", "/v1/search", {"query": "q", "top_n": 0}, {}, 400),
    ("top_k as string", "/v1/search", {"query": "q", "top_k": "3"}, {}, OK_OR_400),
    ("query 8001 chars", "/v1/search", {"query": "q" * 8001}, {}, 400),
    (
        "1024 documents",
        "/v1/documents",
        {"documents": [{"id": f"bulk-{i}", "text": "some words " * 30} for i in range(1024)]},
        {},
        200,
    ),
    (
        "1025 documents",
        "/v1/documents",
        {"documents": [{"id": f"over-{i}", "text": "x"} for i in range(1025)]},
        {},
        400,
    ),
    (
        "1M-character document",
        "/v1/documents",
        {"documents": [{"id": "huge", "text": "word " * 200_000}]},
        {},
        200,
    ),
    (
        "metadata NaN",
        "/v1/documents",
        b'{"documents": [{"id": "m", "text": "x", "metadata": {"a": NaN}}]}',
        {},
        400,
    ),
    (
        "metadata -Infinity",
        "/v1/documents",
        b'{"documents": [{"id": "m", "text": "x", "metadata": {"a": -Infinity}}]}',
        {},
        400,
    ),
    (
        "metadata 1e309",
        "/v1/documents",
        b'{"documents": [{"id": "m", "text": "x", "metadata": {"a": 1e309}}]}',
        {},
        400,
    ),
    (
        "metadata nested",
        "/v1/documents",
        {"documents": [{"id": "m", "text": "x", "metadata": {"a": {"b": 1}}}]},
        {},
        400,
    ),
    (
        "lone surrogate id",
        "/v1/documents",
        _lone('{"documents": [{"id": "\\ud800", "text": "x"}]}'),
        {},
        400,
    ),
    (
        "lone surrogate metadata key",
        "/v1/documents",
        _lone('{"documents": [{"id": "k", "text": "x", "metadata": {"\\ud800": 1}}]}'),
        {},
        400,
    ),
    # Ids outside latin-1, with commas and newlines: they must not break rag's citation header.
    (
        "exotic ids",
        "/v1/documents",
        {
            "documents": [
                {
                    "id": "\U00025244 bridge, \r\nQuillon",
                    "text": "The Zorblatt bridge in Quillon is orange.",
                }
            ]
        },
        {},
        200,
    ),
    ("repeated ids", "/v1/documents", {"documents": [{"id": "d", "text": "x"}] * 2}, {}, 400),
]

RAG_HOSTILE: list[Hostile] = [
    (
        "lone surrogate",
        "/v1/chat/completions",
        _lone('{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        {},
        400,
    ),
    (
        "max_tokens 1e12",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 10**12},
        {},
        400,
    ),
    (
        "max_tokens 2**63",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2**63},
        {},
        400,
    ),
    (
        "max_tokens 1e309",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "q"}], "max_tokens": 1e309}',
        {},
        400,
    ),
    (
        "max_tokens 0",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 0},
        {},
        400,
    ),
    (
        "max_tokens over limit",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 17},
        {},
        400,
    ),
    (
        "temperature NaN",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "q"}], "temperature": NaN}',
        {},
        400,
    ),
    (
        "top_p Infinity",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "q"}], "top_p": Infinity}',
        {},
        400,
    ),
    (
        "top_k 2**63",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "top_k": 2**63},
        {},
        400,
    ),
    (
        "no user message",
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "q"}]},
        {},
        400,
    ),
    (
        "65 messages",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}] * 65},
        {},
        400,
    ),
    (
        "stream with NaN",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "q"}], "stream": true, "temperature": NaN}',
        {},
        400,
    ),
    ("null everywhere", "/v1/chat/completions", {"messages": None, "max_tokens": None}, {}, 400),
    (
        "cites exotic ids",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Zorblatt bridge Quillon"}], "max_tokens": 2},
        {},
        200,
    ),
]

_PROMPT = {"model": "small", "prompt": "the river", "max_tokens": 2}
_CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _gen(
    label: str, patch: dict | bytes, expected: int | frozenset[int] = 400, chat: bool = False
) -> Hostile:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: object = patch if isinstance(patch, bytes) else {**(_CHAT if chat else _PROMPT), **patch}
    return (label, path, body, {}, expected)


GENERATE_HOSTILE: list[Hostile] = [
    _gen("max_tokens 1e12", {"max_tokens": 10**12}),
    _gen("max_tokens 2**63", {"max_tokens": 2**63}),
    _gen("max_tokens 1e309", b'{"model": "small", "prompt": "a", "max_tokens": 1e309}'),
    _gen("max_tokens -1", {"max_tokens": -1}),
    _gen("max_tokens 0", {"max_tokens": 0}),
    _gen("max_tokens over the model's limit", {"max_tokens": 17}),
    _gen("max_tokens 2**63, auto", {"model": "auto", "max_tokens": 2**63}),
    _gen("max_tokens 1e12, streamed", {"max_tokens": 10**12, "stream": True}),
    _gen(
        "max_completion_tokens 2**63",
        {"max_completion_tokens": 2**63, "max_tokens": None},
        chat=True,
    ),
    _gen("n 2**63", {"n": 2**63}),
    _gen("n 0", {"n": 0}),
    _gen("64 prompts x n 16", {"prompt": ["a"] * 64, "n": 16}),
    _gen("65 prompts", {"prompt": ["a"] * 65}),
    _gen("10000 stop strings", {"stop": ["x"] * 10000}),
    _gen("huge stop string", {"stop": ["x" * 100_000]}),
    _gen("empty stop string", {"stop": [""]}),
    _gen("temperature NaN", b'{"model": "small", "prompt": "a", "temperature": NaN}'),
    _gen("temperature Infinity", b'{"model": "small", "prompt": "a", "temperature": Infinity}'),
    _gen("temperature -Infinity", b'{"model": "small", "prompt": "a", "temperature": -Infinity}'),
    _gen("top_p NaN", b'{"model": "auto", "prompt": "a", "top_p": NaN}'),
    _gen("top_p 5e-324", {"top_p": 5e-324, "temperature": 1.0}, 200),
    _gen("temperature 1e-300", {"temperature": 1e-300}, 200),
    _gen("seed 2**64", {"seed": 2**64}),
    _gen("seed 1e309", b'{"model": "small", "prompt": "a", "seed": 1e309}'),
    _gen(
        "logit_bias Infinity", b'{"model": "small", "prompt": "a", "logit_bias": {"1": Infinity}}'
    ),
    _gen("presence_penalty NaN", b'{"model": "small", "prompt": "a", "presence_penalty": NaN}'),
    _gen(
        "lone surrogate prompt", _lone('{"model": "small", "prompt": "\\ud800", "max_tokens": 2}')
    ),
    _gen(
        "lone surrogate, auto, streamed",
        _lone('{"model": "auto", "prompt": "\\ud800", "stream": true}'),
    ),
    _gen("lone surrogate stop", _lone('{"model": "small", "prompt": "a", "stop": ["\\udfff"]}')),
    _gen(
        "lone surrogate chat",
        _lone('{"model": "large", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        chat=True,
    ),
    _gen("prompt past the context", {"prompt": "word " * 80_000}),
    _gen("513 messages", {"messages": [{"role": "user", "content": "hi"}] * 513}, chat=True),
    _gen(
        "messages over the context",
        {"messages": [{"role": "user", "content": "hi"}] * 512},
        chat=True,
    ),
    _gen("null everywhere", {"model": None, "prompt": None, "max_tokens": None}),
    _gen("unknown model", {"model": "gpt-9"}, 404),
    _gen("model name of 500 characters", {"model": "gpt-9" * 100}),
    _gen("stream_options without stream", {"stream_options": {"include_usage": True}}),
    _gen(
        "tool role only",
        {"messages": [{"role": "tool", "content": "x"}]},
        frozenset({200, 400}),
        chat=True,
    ),
]

HOSTILE: dict[str, list[Hostile]] = {
    "embed": hostile_common("/v1/embeddings", "input") + EMBED_HOSTILE,
    "rank": hostile_common("/v1/rerank", "query") + RANK_HOSTILE,
    "search": hostile_common("/v1/search", "query")
    + hostile_common("/v1/documents", "documents")
    + SEARCH_HOSTILE,
    "rag": hostile_common("/v1/chat/completions", "messages") + RAG_HOSTILE,
    "generate": hostile_common("/v1/completions", "prompt")
    + hostile_common("/v1/chat/completions", "messages")
    + GENERATE_HOSTILE,
    # The one base URL routes by model to the apps above: the same refusals must come back.
    "openai_api": hostile_common("/v1/embeddings", "input")
    + hostile_common("/v1/chat/completions", "messages")
    + hostile_common("/v2/rerank", "query")
    + GENERATE_HOSTILE,
}
