"""Token log-probabilities on the wire: what a replica sends, and OpenAI's two shapes of it.

The replica (which owns the tokenizer) turns the engine's ids into text and sends one plain
record per choice or stream delta, ``{"tokens", "token_logprobs", "top_logprobs"}``, where
``top_logprobs`` holds ``[token, logprob]`` pairs, best first. The ingress shapes it for its
endpoint: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` or the legacy
completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``. Keeping the record
endpoint-neutral lets the router pass it through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Most alternatives per token: OpenAI's limits (chat 20, legacy completions 5).
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# What a token of zero probability (a -inf logit, e.g. a masked vocabulary slot) reports:
# OpenAI's own floor. JSON has no -Infinity, and the response could not be written.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenTexts:
    """Decodes single token ids, remembering them (a vocabulary is small; requests repeat ids).

    Special tokens are kept (an end-of-turn token reads ``<|im_end|>``, not an empty string)
    so every sampled token has a visible entry. A token holding part of a multi-byte
    character decodes to U+FFFD, as in vLLM's output.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._decode([token])
            self._cache[token] = text
        return text


def raw_record(
    texts: TokenTexts,
    token_ids: Sequence[int],
    token_logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]],
) -> dict[str, Any]:
    """The endpoint-neutral record of some sampled tokens (see the module docstring)."""
    return {
        "tokens": [texts(t) for t in token_ids],
        "token_logprobs": [_finite(lp) for lp in token_logprobs],
        "top_logprobs": [[[texts(t), _finite(lp)] for t, lp in row] for row in top]
        if top
        else [[] for _ in token_ids],
    }


def merge_records(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One record for a whole choice from the records of its deltas, in order."""
    merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for record in records:
        for key in merged:
            merged[key].extend(record[key])
    return merged


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(record: dict[str, Any]) -> dict[str, Any]:
    """OpenAI chat's ``choice.logprobs``: one entry per token, alternatives inside."""
    content = [
        {
            "token": token,
            "logprob": logprob,
            "bytes": _utf8(token),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": _utf8(t)} for t, lp in top],
        }
        for token, logprob, top in zip(
            record["tokens"], record["token_logprobs"], record["top_logprobs"], strict=True
        )
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(record: dict[str, Any], offset: int = 0) -> dict[str, Any]:
    """OpenAI completions' ``choice.logprobs``, tokens starting at character ``offset``.

    Each ``top_logprobs`` entry maps the most likely tokens to their logprobs and always holds
    the sampled token too (OpenAI: "up to logprobs+1 elements"). ``text_offset`` counts the
    decoded token texts, so past a stop string it can run beyond the returned text.
    """
    offsets: list[int] = []
    tops: list[dict[str, float]] = []
    for token, logprob, top in zip(
        record["tokens"], record["token_logprobs"], record["top_logprobs"], strict=True
    ):
        offsets.append(offset)
        offset += len(token)
        entry = {t: lp for t, lp in top}
        entry.setdefault(token, logprob)
        tops.append(entry)
    return {
        "tokens": list(record["tokens"]),
        "token_logprobs": list(record["token_logprobs"]),
        "top_logprobs": tops,
        "text_offset": offsets,
    }
