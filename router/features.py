"""Request features shared by the routing policies: cheap, deterministic, no model calls.

A ``RequestFeatures`` is computed once per request (the router has the tokenizer's count of
prompt tokens) and fed to the length predictor, the lane policy and the model chooser.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Instruction cues and the direction they push the answer's length. The weights are the
# predictor's prior (log-length offsets); online learning corrects them per deployment.
CUES: dict[str, tuple[re.Pattern[str], float]] = {
    "yes_no": (re.compile(r"\b(yes or no|true or false|answer (only )?(yes|no))\b", re.I), -2.0),
    "one_word": (
        re.compile(r"\b(one word|single word|just the (name|number)|only the)\b", re.I),
        -1.5,
    ),
    "short": (
        re.compile(r"\b(briefly|in short|short answer|one sentence|concise(ly)?|tl;?dr)\b", re.I),
        -1.0,
    ),
    "number": (
        re.compile(r"\b(how many|how much|what is \d|calculate|compute|convert)\b", re.I),
        -0.8,
    ),
    # Factoid questions ("who wrote...", "what is the capital...") get a phrase or a sentence.
    "factoid": (
        re.compile(r"^\s*(who|what|which|when|where|how (many|much|long|old|far))\b", re.I),
        -0.5,
    ),
    "list": (re.compile(r"\b(list|enumerate|bullet|steps|top \d+)\b", re.I), 0.6),
    "explain": (re.compile(r"\b(explain|why|describe|compare|discuss)\b", re.I), 0.7),
    "detail": (
        re.compile(r"\b(in detail|detailed|thorough(ly)?|step by step|comprehensive)\b", re.I),
        1.0,
    ),
    "write": (
        re.compile(
            # A few words may sit between verb and genre ("write a long story", "tell me a
            # story"): the genre decides the length, not the adjective.
            r"\b(write|draft|compose|tell)\b(\W+\w+){0,3}?\W+"
            r"(story|stories|essay|poem|article|letter|report|blog)\b",
            re.I,
        ),
        1.3,
    ),
    "code": (
        re.compile(r"\b(code|function|implement|program|script|class|python|sql)\b", re.I),
        0.8,
    ),
}
CUE_NAMES = tuple(CUES)


@dataclass(frozen=True)
class RequestFeatures:
    """What the policies know about a request before it runs."""

    prompt_tokens: int
    max_tokens: int
    chat_turns: int = 1
    cues: frozenset[str] = field(default_factory=frozenset)
    embedding: tuple[float, ...] | None = None

    def vector(self) -> list[float]:
        """Numeric features for the linear models (bias first)."""
        return [
            1.0,
            math.log1p(self.prompt_tokens),
            math.log1p(self.max_tokens),
            math.log1p(max(self.chat_turns - 1, 0)),
            *(1.0 if name in self.cues else 0.0 for name in CUE_NAMES),
        ]


def find_cues(text: str) -> frozenset[str]:
    return frozenset(name for name, (pattern, _) in CUES.items() if pattern.search(text))


def extract_features(
    prompt_text: str,
    prompt_tokens: int,
    max_tokens: int,
    chat_turns: int = 1,
    embedding: list[float] | None = None,
) -> RequestFeatures:
    if prompt_tokens < 0 or max_tokens < 1:
        raise ValueError(
            f"prompt_tokens must be >= 0 and max_tokens >= 1; got {prompt_tokens}, {max_tokens}"
        )
    return RequestFeatures(
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        chat_turns=max(chat_turns, 1),
        # Only the last user turn says what is asked now.
        cues=find_cues(prompt_text[-2000:]),
        embedding=tuple(embedding) if embedding is not None else None,
    )
