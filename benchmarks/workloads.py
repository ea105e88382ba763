"""What to send: typed requests from long-tailed generators or JSONL files.

A request type knows its kind (which endpoint family serves it), its item count (texts,
documents, sequences: the unit of batching) and an estimate of its tokens. Targets turn it
into HTTP; the load generator never looks inside. Adding a workload type (generation is
defined here already, its endpoint comes later) means one dataclass and one target.

Synthetic texts are drawn from common English words that the BERT/MiniLM WordPiece vocabulary
keeps whole, so a text of ``n`` tokens is ``n - 2`` words (plus [CLS] and [SEP]). For other
tokenizers the estimate is approximate; the servers report real token counts, which is what
the results use.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Each is a single WordPiece token in bert-base-uncased / all-MiniLM-L6-v2 (checked in tests
# when the packaged tokenizer is installed).
WORDS: tuple[str, ...] = tuple(
    [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "with",
        "as",
        "by",
        "at",
        "from",
        "that",
        "this",
        "it",
        "be",
        "are",
        "or",
        "an",
        "have",
        "has",
        "had",
        "not",
        "but",
        "were",
        "which",
        "one",
        "all",
        "their",
        "more",
        "can",
        "other",
        "its",
        "also",
        "new",
        "time",
        "first",
        "two",
        "would",
        "up",
        "been",
        "after",
        "most",
        "some",
        "year",
        "years",
        "may",
        "such",
        "only",
        "into",
        "over",
        "three",
        "these",
        "many",
        "used",
        "when",
        "state",
        "city",
        "world",
        "people",
        "school",
        "part",
        "where",
        "later",
        "during",
        "about",
        "found",
        "known",
        "him",
        "well",
        "high",
        "then",
        "being",
        "under",
        "between",
        "both",
        "since",
        "made",
        "through",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "each",
        "same",
        "while",
        "until",
        "very",
        "long",
        "water",
        "river",
        "house",
        "music",
        "light",
        "power",
        "field",
        "market",
        "money",
        "land",
        "day",
        "night",
        "week",
        "month",
        "name",
        "home",
        "game",
        "team",
        "life",
        "book",
        "song",
        "film",
        "party",
        "story",
        "group",
        "place",
        "point",
        "line",
        "number",
        "order",
        "paper",
        "plan",
        "model",
        "system",
        "table",
        "chair",
        "door",
        "road",
        "street",
        "car",
        "train",
        "ship",
        "plane",
        "bird",
        "fish",
        "tree",
        "flower",
        "green",
        "blue",
        "red",
        "black",
        "white",
        "small",
        "large",
        "great",
        "early",
        "late",
        "old",
        "young",
        "good",
        "best",
        "north",
        "south",
        "east",
        "west",
        "summer",
        "winter",
        "spring",
        "rain",
        "snow",
        "wind",
        "cloud",
        "sun",
        "moon",
        "star",
        "stone",
        "gold",
        "iron",
        "wood",
        "glass",
        "fire",
        "earth",
        "air",
        "sea",
        "lake",
        "hill",
        "valley",
        "island",
        "forest",
        "garden",
        "bridge",
        "tower",
        "castle",
        "church",
        "village",
        "town",
        "country",
        "nation",
        "army",
        "war",
        "peace",
        "law",
        "court",
        "king",
        "queen",
        "prince",
        "lord",
        "lady",
        "father",
        "mother",
        "son",
        "daughter",
        "brother",
        "sister",
        "friend",
        "child",
        "children",
        "man",
        "woman",
        "men",
        "women",
    ]
)

# Tokens a BERT-style tokenizer adds around every text ([CLS] ... [SEP]).
SPECIAL_TOKENS = 2


def synth_text(tokens: int, rng: random.Random) -> str:
    """A text of about ``tokens`` model tokens (exact for WordPiece-uncased models)."""
    words = max(1, tokens - SPECIAL_TOKENS)
    return " ".join(rng.choice(WORDS) for _ in range(words))


# --- request types -----------------------------------------------------------------------

Kind = Literal["embed", "rank", "generate"]


@dataclass(frozen=True)
class EmbedRequest:
    """Texts to embed (OpenAI embeddings ``input``)."""

    texts: tuple[str, ...]
    est_tokens: int
    kind: ClassVar[str] = "embed"

    @property
    def items(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class RankRequest:
    """A query and documents to rerank; every document is one query-document pair."""

    query: str
    documents: tuple[str, ...]
    est_tokens: int
    kind: ClassVar[str] = "rank"

    @property
    def items(self) -> int:
        return len(self.documents)


@dataclass(frozen=True)
class GenerateRequest:
    """A prompt and how many tokens to generate (no endpoint yet: a later issue adds it)."""

    prompt: str
    max_tokens: int
    est_tokens: int  # prompt tokens + max_tokens
    stream: bool = False
    kind: ClassVar[str] = "generate"

    @property
    def items(self) -> int:
        return 1


Request = EmbedRequest | RankRequest | GenerateRequest


@dataclass
class Workload:
    """Requests in the order they are sent, optionally with their own arrival times."""

    name: str
    requests: list[Request]
    arrivals: list[float] | None = None  # seconds from start; None: the arrival process decides
    description: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"workload {self.name!r} has no requests")
        if self.arrivals is not None and len(self.arrivals) != len(self.requests):
            raise ValueError(
                f"workload {self.name!r}: {len(self.arrivals)} arrival times for "
                f"{len(self.requests)} requests; give one per request or none"
            )

    @property
    def kind(self) -> str:
        kinds = {r.kind for r in self.requests}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def take(self, n: int) -> list[Request]:
        """``n`` requests, cycling through the list when more are needed than it holds."""
        return [self.requests[i % len(self.requests)] for i in range(n)]

    def mean_items(self) -> float:
        return sum(r.items for r in self.requests) / len(self.requests)

    def mean_tokens(self) -> float:
        return sum(r.est_tokens for r in self.requests) / len(self.requests)


# --- length mixes ------------------------------------------------------------------------


class LengthMix(BaseModel):
    """A long-tailed (log-normal) token-length mix, clipped to [low, high]."""

    model_config = ConfigDict(extra="forbid")

    low: int = Field(default=4, ge=1, description="Shortest length.")
    high: int = Field(default=512, ge=1, description="Longest length.")
    median: float = Field(default=32, gt=0, description="Median before clipping.")
    sigma: float = Field(
        default=1.0, ge=0, le=5, description="Log-normal shape; 1.0 puts p99 near 10x the median."
    )

    @model_validator(mode="after")
    def _ordered(self) -> LengthMix:
        if self.low > self.high:
            raise ValueError(f"low={self.low} is above high={self.high}; swap them")
        return self

    def draw(self, rng: random.Random) -> int:
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return int(min(self.high, max(self.low, round(value))))


def log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] with log-uniform density: small values common, a long tail."""
    if low == high:
        return low
    return int(min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high)))))))


class EmbedMix(BaseModel):
    """Built-in embedding workload: 1-8 texts per request, texts of 4-512 tokens."""

    model_config = ConfigDict(extra="forbid")

    texts_min: int = Field(default=1, ge=1, description="Fewest texts per request.")
    texts_max: int = Field(
        default=8,
        ge=1,
        description="Most texts per request; several per request keep the HTTP proxy "
        "(about 250 req/s here) from being what is measured.",
    )
    lengths: LengthMix = Field(default_factory=LengthMix)


class RankMix(BaseModel):
    """Built-in rerank workload: a short query and 5-50 documents of long-tailed length."""

    model_config = ConfigDict(extra="forbid")

    docs_min: int = Field(default=5, ge=1)
    docs_max: int = Field(default=50, ge=1)
    query: LengthMix = Field(default_factory=lambda: LengthMix(low=4, high=32, median=10))
    documents: LengthMix = Field(default_factory=lambda: LengthMix(low=8, high=512, median=48))


class GenerateMix(BaseModel):
    """Built-in generation workload: prompts of long-tailed length, max_tokens 8-256."""

    model_config = ConfigDict(extra="forbid")

    prompt: LengthMix = Field(default_factory=lambda: LengthMix(low=4, high=512, median=64))
    max_tokens_min: int = Field(default=8, ge=1)
    max_tokens_max: int = Field(default=256, ge=1)


def embed_workload(n: int, seed: int = 0, mix: EmbedMix | None = None) -> Workload:
    mix = mix or EmbedMix()
    rng = random.Random(seed)
    requests: list[Request] = []
    for _ in range(n):
        lengths = [mix.lengths.draw(rng) for _ in range(rng.randint(mix.texts_min, mix.texts_max))]
        texts = tuple(synth_text(t, rng) for t in lengths)
        requests.append(EmbedRequest(texts, sum(lengths)))
    return Workload(
        "embed-mixed",
        requests,
        description={"generator": "embed-mixed", "seed": seed, **mix.model_dump()},
    )


def rank_workload(n: int, seed: int = 0, mix: RankMix | None = None) -> Workload:
    mix = mix or RankMix()
    rng = random.Random(seed)
    requests: list[Request] = []
    for _ in range(n):
        q = mix.query.draw(rng)
        docs = [
            mix.documents.draw(rng) for _ in range(log_uniform_int(rng, mix.docs_min, mix.docs_max))
        ]
        requests.append(
            RankRequest(
                synth_text(q, rng),
                tuple(synth_text(d, rng) for d in docs),
                sum(q + d for d in docs),
            )
        )
    return Workload(
        "rank-mixed",
        requests,
        description={"generator": "rank-mixed", "seed": seed, **mix.model_dump()},
    )


def generate_workload(n: int, seed: int = 0, mix: GenerateMix | None = None) -> Workload:
    mix = mix or GenerateMix()
    rng = random.Random(seed)
    requests: list[Request] = []
    for _ in range(n):
        p = mix.prompt.draw(rng)
        m = log_uniform_int(rng, mix.max_tokens_min, mix.max_tokens_max)
        requests.append(GenerateRequest(synth_text(p, rng), m, p + m))
    return Workload(
        "generate-mixed",
        requests,
        description={"generator": "generate-mixed", "seed": seed, **mix.model_dump()},
    )


GENERATORS = {
    "embed-mixed": embed_workload,
    "rank-mixed": rank_workload,
    "generate-mixed": generate_workload,
}


# --- JSONL -------------------------------------------------------------------------------


class JsonlError(ValueError):
    """A JSONL line that is not a request; the message names the file and line."""


def estimate_tokens(text: str) -> int:
    """Rough token count of a text whose real count is unknown: words + specials."""
    return len(text.split()) + SPECIAL_TOKENS


def request_from_json(obj: Any) -> tuple[Request, float | None]:
    """One request from a request body, plus its ``arrival_s`` if the line carries one.

    Lines are the bodies as sent: ``{"input": ...}`` (embeddings), ``{"query", "documents"}``
    (rerank), ``{"prompt", "max_tokens"}`` (generation). ``kind`` may say which explicitly.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    arrival = obj.get("arrival_s")
    if arrival is not None and (not isinstance(arrival, (int, float)) or arrival < 0):
        raise ValueError(f"arrival_s must be a number >= 0 (seconds from start), got {arrival!r}")
    kind = obj.get("kind") or (
        "embed"
        if "input" in obj
        else "rank"
        if "documents" in obj
        else "generate"
        if "prompt" in obj
        else None
    )
    if kind == "embed":
        raw = obj.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("'input' must be a string or a non-empty list of strings")
        return EmbedRequest(tuple(texts), sum(estimate_tokens(t) for t in texts)), arrival
    if kind == "rank":
        query, docs = obj.get("query"), obj.get("documents")
        if not isinstance(query, str) or not query:
            raise ValueError("'query' must be a non-empty string")
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise ValueError("'documents' must be a non-empty list of strings")
        est = sum(estimate_tokens(query) + estimate_tokens(d) for d in docs)
        return RankRequest(query, tuple(docs), est), arrival
    if kind == "generate":
        prompt, max_tokens = obj.get("prompt"), obj.get("max_tokens", 16)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("'prompt' must be a non-empty string")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
        est = estimate_tokens(prompt) + max_tokens
        return GenerateRequest(prompt, max_tokens, est, bool(obj.get("stream", False))), arrival
    raise ValueError(
        "cannot tell the request kind: give 'input' (embed), 'query'+'documents' (rank), "
        "'prompt' (generate), or set 'kind'"
    )


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise JsonlError(f"{path}:{number}: not valid JSON ({exc.msg})") from None


def load_jsonl(path: str | Path, name: str | None = None) -> Workload:
    """A workload from a JSONL file, one request body per line.

    Arrival times are used only if every line has ``arrival_s`` (a partial set is an error:
    mixing timed and untimed requests has no sensible replay).
    """
    requests: list[Request] = []
    arrivals: list[float | None] = []
    for number, obj in iter_jsonl(path):
        try:
            request, arrival = request_from_json(obj)
        except ValueError as exc:
            raise JsonlError(f"{path}:{number}: {exc}") from None
        requests.append(request)
        arrivals.append(arrival)
    if not requests:
        raise JsonlError(f"{path}: no requests (the file is empty)")
    timed = [a for a in arrivals if a is not None]
    if timed and len(timed) != len(arrivals):
        raise JsonlError(
            f"{path}: {len(timed)} of {len(arrivals)} lines have arrival_s; give it on every "
            "line or on none"
        )
    times: list[float] | None = None
    if timed:
        # Sort by arrival so the replay sends in time order whatever the file order was.
        order = sorted(range(len(requests)), key=lambda i: timed[i])
        requests = [requests[i] for i in order]
        times = [timed[i] - timed[order[0]] for i in order]
    return Workload(name or Path(path).stem, requests, times, description={"jsonl": str(path)})


def write_jsonl(path: str | Path, requests: Sequence[Request]) -> None:
    """Writes requests as request bodies (the inverse of ``load_jsonl``)."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(json.dumps(request_body(r)) + "\n")


def request_body(request: Request) -> dict[str, Any]:
    """The canonical JSON body of a request (targets may add endpoint options)."""
    if isinstance(request, EmbedRequest):
        return {"input": list(request.texts)}
    if isinstance(request, RankRequest):
        return {"query": request.query, "documents": list(request.documents)}
    return {"prompt": request.prompt, "max_tokens": request.max_tokens, "stream": request.stream}
