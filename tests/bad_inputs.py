"""Hostile and malformed requests every pipeline must answer with a 4xx (never a 5xx)."""

from __future__ import annotations

# (description, path suffix, raw body bytes or JSON-able object, expected status)
EMBED_BAD: list[tuple[str, bytes | object, int]] = [
    ("malformed JSON", b'{"input": ["a", ', 400),
    ("not an object", b'["just", "a", "list"]', 400),
    ("non-UTF-8 body", b'{"input": "\xff\xfe\xfa"}', 400),
    ("missing input", {"model": "x"}, 400),
    ("input wrong type", {"input": 42}, 400),
    ("input list of numbers", {"input": [1, 2, 3]}, 400),
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
