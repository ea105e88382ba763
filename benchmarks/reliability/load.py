"""Open-loop load on several endpoints at once, with every record visible while it runs.

The load itself is the harness's one generator (``benchmarks.loadgen.LoadGenerator``: one
merged Poisson timeline over several endpoints, the target, Retry-After and error code of
every answer, per-endpoint headers, a live record list a soak reads as it goes); this module
adds the endpoints reliability drives (search, completions) and a capacity measurement.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from benchmarks.loadgen import Endpoint, LoadGenerator
from benchmarks.targets import Answer, EmbeddingsTarget, RerankTarget, Target
from benchmarks.workloads import (
    EmbedMix,
    GenerateRequest,
    LengthMix,
    RankMix,
    RankRequest,
    Request,
    embed_workload,
    rank_workload,
    synth_text,
)


class SearchTarget(Target):
    """``POST /search/v1/search``: a RankRequest's query (its documents are ignored)."""

    kind = "rank"

    def __init__(self, name: str, prefix: str, top_k: int = 4, top_n: int = 2) -> None:
        super().__init__(name, prefix)
        self.top_k, self.top_n = top_k, top_n

    @property
    def path(self) -> str:
        return f"{self.prefix}/v1/search"

    @property
    def stats_path(self) -> str | None:
        return None

    @property
    def ready_path(self) -> str:
        return f"{self.prefix}/healthz"

    def body(self, request: Request) -> dict[str, Any]:
        assert isinstance(request, RankRequest)
        return {"query": request.query, "top_k": self.top_k, "top_n": self.top_n}

    def decode(self, request: Request, content: bytes) -> Answer:
        try:
            return Answer(len(json.loads(content)["results"]), 0)
        except (ValueError, KeyError, TypeError):
            return Answer(1, 0)


class CompletionsTarget(Target):
    """``POST /generate/v1/completions`` on one model tier, greedy, ``ignore_eos``."""

    kind = "generate"

    def __init__(self, name: str, prefix: str, model: str = "small") -> None:
        super().__init__(name, prefix)
        self.model = model

    @property
    def path(self) -> str:
        return f"{self.prefix}/v1/completions"

    def body(self, request: Request) -> dict[str, Any]:
        assert isinstance(request, GenerateRequest)
        return {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # every request costs exactly max_tokens decode steps
        }

    def decode(self, request: Request, content: bytes) -> Answer:
        try:
            return Answer(1, int(json.loads(content)["usage"]["completion_tokens"]))
        except (ValueError, KeyError, TypeError):
            return Answer(1, 0)


def short_generate_requests(
    n: int, max_tokens: int = 16, seed: int = 0, prompt: LengthMix | None = None
) -> list[Request]:
    """Short prompts (8-64 words) with a fixed, small ``max_tokens``."""
    rng = random.Random(seed)
    mix = prompt or LengthMix(low=8, high=64, median=16)
    out: list[Request] = []
    for _ in range(n):
        p = mix.draw(rng)
        out.append(GenerateRequest(synth_text(p, rng), max_tokens, p + max_tokens))
    return out


# Rerank/search requests small enough that the SmolLM2 judge answers in well under a second.
LIGHT_RANK = RankMix(docs_min=2, docs_max=8, documents=LengthMix(low=8, high=128, median=32))


def endpoint(name: str, prefix: str | None = None, seed: int = 0, max_tokens: int = 16) -> Endpoint:
    """The standard endpoint for an app name: embed, rank, search, generate (small)."""
    prefix = prefix or f"/{name}"
    if name == "embed":
        return Endpoint(
            name, EmbeddingsTarget(name, prefix), embed_workload(400, seed, EmbedMix()).requests
        )
    if name == "rank":
        return Endpoint(
            name, RerankTarget(name, prefix), rank_workload(200, seed, LIGHT_RANK).requests
        )
    if name == "search":
        return Endpoint(
            name, SearchTarget(name, prefix), rank_workload(200, seed, LIGHT_RANK).requests
        )
    if name == "generate":
        return Endpoint(
            name, CompletionsTarget(name, prefix), short_generate_requests(200, max_tokens, seed)
        )
    raise ValueError(f"no endpoint named {name!r}; use embed, rank, search or generate")


async def capacity(
    gen: LoadGenerator, ep: Endpoint, concurrency: int, duration_s: float
) -> dict[str, Any]:
    """Closed-loop saturation: successful requests per second at ``concurrency`` in flight.

    Clients honour Retry-After (0.5 s when none is sent), as a well-behaved client would.
    """
    await gen.run_closed(ep, None, min(concurrency, 4), 3.0, refusal_backoff_s=0.5)  # warm-up
    t = time.perf_counter()
    records = (
        await gen.run_closed(ep, None, concurrency, duration_s, refusal_backoff_s=0.5)
    ).records
    span = max(time.perf_counter() - t, duration_s)
    ok = [r for r in records if r.ok]
    return {
        "endpoint": ep.name,
        "concurrency": concurrency,
        "duration_s": duration_s,
        "sent": len(records),
        "ok": len(ok),
        "rps": len(ok) / span,
        "items_per_s": sum(r.items for r in ok) / span,
        "statuses": sorted({r.status for r in records}),
    }
