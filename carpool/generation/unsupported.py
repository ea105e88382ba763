"""OpenAI (and vLLM) request fields carpool cannot honour, each with what to change.

They are declared on the request models (not left to ``extra="forbid"``) so the 400 says why
and what to do; ``null`` or a neutral value (``tool_choice: "none"``, ``response_format:
{"type": "text"}``...) passes, as OpenAI and vLLM accept them. The request models in
``carpool.generation.schemas`` consult these tables.
"""

from __future__ import annotations

from typing import Any


def neutral(name: str, value: Any) -> bool:
    """True when a refused field's value asks for what carpool does anyway."""
    if value is None or value == [] or value == {}:
        return True
    return {
        "tool_choice": value == "none",
        "response_format": value == {"type": "text"},
        "modalities": value == ["text"],
        "store": value is False,
        "service_tier": value in ("auto", "default"),
        "top_k": value in (-1, 0),
        "min_p": value == 0,
        "repetition_penalty": value == 1,
        "min_tokens": value == 0,
        "suffix": value == "",
        "best_of": value == 1,
        "echo": value is False,
    }.get(name, False)


UNSUPPORTED_SHARED = {
    "logit_bias": "logit_bias is not supported; remove it",
    "top_k": "top_k is not supported (sampling is temperature and top_p only); remove it or "
    "send -1",
    "min_p": "min_p is not supported (sampling is temperature and top_p only); remove it or send 0",
    "repetition_penalty": "repetition_penalty is not supported; remove it or send 1 "
    "(presence_penalty and frequency_penalty are supported)",
    "min_tokens": "min_tokens is not supported; remove it or send 0 (ignore_eos: true with "
    "max_tokens gives an exact length)",
    "service_tier": "service_tier is not supported; remove it",
    "store": "stored completions are not supported; remove store or send false",
    "metadata": "metadata is only kept with stored completions, which are not supported; remove it",
}
UNSUPPORTED_CHAT = {
    "functions": "functions (the legacy form of tools) is not supported; remove it and send "
    'the same definitions as tools ([{"type": "function", "function": {...}}])',
    "function_call": "function_call (the legacy form of tool_choice) is not supported; remove "
    "it and send tool_choice (none, auto, required or a named function)",
    "audio": "audio output is not supported; remove audio",
    "modalities": 'only text output is supported; remove modalities or send ["text"]',
    "prediction": "predicted outputs are not supported; remove prediction",
    "reasoning_effort": "these models do not reason in hidden steps; remove reasoning_effort",
    "web_search_options": "web search is not supported; remove web_search_options",
}
UNSUPPORTED_COMPLETION = {
    "echo": "echo is not supported; remove it or set it to false",
    "best_of": "best_of is not supported; remove it or set it to 1 (use n for several choices)",
    "suffix": "suffix (fill-in-the-middle) is not supported; remove it",
}
