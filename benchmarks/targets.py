"""Targets: where a request goes over HTTP and how its answer is read.

A target is a route prefix on a Serve HTTP server plus the wire format of one endpoint
family. The load generator only calls ``encode`` (before the run, so serialisation costs
nothing while measuring) and ``decode`` (to count items and tokens). Streaming generation
(TTFT/TPOT) will need a target that reads chunks; ``decode`` then gets a timing record.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from benchmarks.workloads import EmbedRequest, RankRequest, Request, request_body


@dataclass
class Answer:
    """What a successful response tells the client."""

    items: int
    tokens: int


class Target(ABC):
    """One endpoint family under one route prefix."""

    kind: str  # the request kind it serves

    def __init__(self, name: str, prefix: str) -> None:
        self.name = name
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""

    @property
    @abstractmethod
    def path(self) -> str:
        """Request path (below the server's base URL)."""

    @property
    def stats_path(self) -> str | None:
        """``GET`` path of the replica's cumulative batching stats, if it has one."""
        return f"{self.prefix}/v1/stats"

    @property
    def ready_path(self) -> str:
        return f"{self.prefix}/v1/models"

    def accepts(self, request: Request) -> bool:
        return request.kind == self.kind

    def encode(self, request: Request) -> bytes:
        if not self.accepts(request):
            raise ValueError(
                f"target {self.name!r} serves {self.kind!r} requests, not {request.kind!r}; "
                "pick a workload of the matching kind"
            )
        return json.dumps(self.body(request), separators=(",", ":")).encode()

    def body(self, request: Request) -> dict[str, Any]:
        return request_body(request)

    @abstractmethod
    def decode(self, request: Request, content: bytes) -> Answer:
        """Items and tokens of a 2xx answer (falls back to the client's estimates)."""


class EmbeddingsTarget(Target):
    """OpenAI ``POST /v1/embeddings``; asks for base64 vectors as the OpenAI SDK does.

    base64 is also 5-10x less JSON for the server to write and the client to parse, which
    matters when client, proxy and model share two cores.
    """

    kind = "embed"

    @property
    def path(self) -> str:
        return f"{self.prefix}/v1/embeddings"

    def body(self, request: Request) -> dict[str, Any]:
        return {**request_body(request), "encoding_format": "base64"}

    def decode(self, request: Request, content: bytes) -> Answer:
        assert isinstance(request, EmbedRequest)
        tokens = request.est_tokens
        items = request.items
        try:
            data = json.loads(content)
            tokens = int(data["usage"]["prompt_tokens"])
            items = len(data["data"])
        except (ValueError, KeyError, TypeError):
            pass  # keep the estimates; a malformed answer still counts as served
        return Answer(items, tokens)


class RerankTarget(Target):
    """``POST /v1/rerank`` (Cohere/Jina/TEI shape)."""

    kind = "rank"

    @property
    def path(self) -> str:
        return f"{self.prefix}/v1/rerank"

    def decode(self, request: Request, content: bytes) -> Answer:
        assert isinstance(request, RankRequest)
        tokens = request.est_tokens
        items = request.items
        try:
            data = json.loads(content)
            tokens = int(data["usage"]["total_tokens"])
            items = len(data["results"])
        except (ValueError, KeyError, TypeError):
            pass
        return Answer(items, tokens)


# kind -> target class; generation (completions, streaming) joins here in a later issue.
TARGET_KINDS: dict[str, type[Target]] = {"embed": EmbeddingsTarget, "rank": RerankTarget}


def make_target(kind: str, name: str, prefix: str) -> Target:
    if kind == "generate":
        raise NotImplementedError(
            "carpool has no generation endpoint yet, so there is no generation target; "
            "benchmark 'embed' or 'rank' workloads for now"
        )
    if kind not in TARGET_KINDS:
        raise ValueError(
            f"no target for request kind {kind!r}; choose one of {sorted(TARGET_KINDS)}"
        )
    return TARGET_KINDS[kind](name, prefix)
