"""Open-loop load on several endpoints at once, with every record visible while it runs.

Reuses the harness's pooled client (``benchmarks.loadgen.LoadGenerator``), targets and
workloads; adds what reliability needs: one merged Poisson timeline over several targets,
the target and Retry-After of every answer, optional request headers (priority, deadline),
and a live record list so a soak can report windows as it goes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.arrivals import poisson_arrivals
from benchmarks.loadgen import CANCELLED, JSON_HEADERS, TIMED_OUT, TRANSPORT_ERROR, LoadGenerator
from benchmarks.reliability.analysis import RelRecord
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


@dataclass
class Endpoint:
    """One app under load: its target and requests (cycled)."""

    name: str  # e.g. "embed", "search"
    target: Target
    requests: list[Request]
    headers: dict[str, str] = field(default_factory=dict)


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


@dataclass
class Run:
    """Records of a run in progress (appended as answers arrive)."""

    records: list[RelRecord] = field(default_factory=list)
    t0: float = 0.0  # perf_counter at the start
    wall_t0: float = 0.0  # time.time() at the start
    planned: int = 0
    in_flight: int = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0


class ReliabilityLoad(LoadGenerator):
    """The harness's client, keeping Retry-After, error codes and per-endpoint headers."""

    async def send(
        self, ep: Endpoint, request: Request, body: bytes, index: int, scheduled: float, t0: float
    ) -> RelRecord:
        started = time.perf_counter() - t0
        status, items, tokens, error = TRANSPORT_ERROR, 0, 0, None
        retry_after = code = None
        try:
            resp = await self._client.post(
                ep.target.path, content=body, headers={**JSON_HEADERS, **ep.headers}
            )
            status = resp.status_code
            if 200 <= status < 300:
                answer = ep.target.decode(request, resp.content)
                items, tokens = answer.items, answer.tokens
            else:
                error = resp.text[:300]
                retry_after = resp.headers.get("retry-after")
                code = _error_code(resp.content)
        except httpx.TimeoutException:
            status, error = TIMED_OUT, f"no answer within {self.timeout_s:g} s"
        except httpx.HTTPError as exc:
            status, error = TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}"[:300]
        return RelRecord(
            index=index,
            scheduled=scheduled,
            started=started,
            finished=time.perf_counter() - t0,
            status=status,
            items=items,
            tokens=tokens,
            error=error,
            target=ep.name,
            retry_after=retry_after,
            code=code,
        )

    async def open_loop(
        self,
        plan: Sequence[tuple[Endpoint, float]],
        duration_s: float,
        seed: int = 0,
        run: Run | None = None,
        drain_s: float | None = None,
    ) -> Run:
        """Poisson arrivals at ``rate`` per endpoint for ``duration_s``, merged in one timeline.

        Waits up to ``drain_s`` (default: the client timeout) for the last answers; anything
        still unanswered then is recorded as CANCELLED (lost).
        """
        rng = random.Random(seed)
        timeline: list[tuple[float, int, int]] = []  # (at, endpoint index, request index)
        for e, (ep, rate) in enumerate(plan):
            if rate <= 0:
                continue
            times = poisson_arrivals(rate, duration_s, rng)
            timeline.extend((t, e, i % len(ep.requests)) for i, t in enumerate(times))
        timeline.sort()
        bodies = [
            [ep.target.encode(r) for r in ep.requests] for ep, _ in plan
        ]  # serialised before the clock starts
        run = run or Run()
        run.planned = len(timeline)
        run.t0 = time.perf_counter()
        run.wall_t0 = time.time()
        tasks: dict[int, asyncio.Task[RelRecord]] = {}
        meta: dict[int, tuple[str, float]] = {}

        def done(task: asyncio.Task[RelRecord]) -> None:
            if task.cancelled():
                return
            record = task.result()
            tasks.pop(record.index, None)
            run.in_flight -= 1
            run.records.append(record)

        for index, (at, e, k) in enumerate(timeline):
            delay = run.t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            ep = plan[e][0]
            meta[index] = (ep.name, at)
            task = asyncio.create_task(
                self.send(ep, ep.requests[k], bodies[e][k], index, at, run.t0)
            )
            tasks[index] = task
            run.in_flight += 1
            task.add_done_callback(done)
        deadline = time.perf_counter() + (drain_s if drain_s is not None else self.timeout_s + 5)
        while tasks and time.perf_counter() < deadline:
            await asyncio.wait(list(tasks.values()), timeout=0.5)
        now = run.now()
        for index, task in list(tasks.items()):
            task.cancel()
            name, at = meta[index]
            run.records.append(
                RelRecord(index, at, at, now, CANCELLED, error="no answer by the end", target=name)
            )
        if tasks:
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        run.records.sort(key=lambda r: r.index)
        return run

    async def closed_loop(
        self, ep: Endpoint, concurrency: int, duration_s: float, refusal_backoff_s: float = 0.5
    ) -> list[RelRecord]:
        """``concurrency`` clients back to back for ``duration_s`` (saturation throughput)."""
        bodies = [ep.target.encode(r) for r in ep.requests]
        records: list[RelRecord] = []
        t0 = time.perf_counter()
        counter = 0

        async def client() -> None:
            nonlocal counter
            while time.perf_counter() - t0 < duration_s:
                index = counter
                counter += 1
                k = index % len(ep.requests)
                now = time.perf_counter() - t0
                record = await self.send(ep, ep.requests[k], bodies[k], index, now, t0)
                records.append(record)
                if not record.ok:
                    # A refused client that resent at once would turn saturation into a
                    # refusal storm that burns the CPU it is measuring; back off a little.
                    await asyncio.sleep(refusal_backoff_s)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return records


def _error_code(content: bytes) -> str | None:
    try:
        err = json.loads(content).get("error") or {}
        return str(err.get("code")) if err.get("code") else None
    except (ValueError, AttributeError):
        return None


async def capacity(
    gen: ReliabilityLoad, ep: Endpoint, concurrency: int, duration_s: float
) -> dict[str, Any]:
    """Closed-loop saturation: successful requests per second at ``concurrency`` in flight."""
    await gen.closed_loop(ep, min(concurrency, 4), 3.0)  # warm-up
    t = time.perf_counter()
    records = await gen.closed_loop(ep, concurrency, duration_s)
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
