"""Streaming generation, measured: an OpenAI stream's chunks timed as they arrive.

An adapter over the suite's ``LoadGenerator`` reads the server-sent events and keeps each
token chunk's arrival time, from which TTFT and TPOT follow.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from benchmarks.loadgen import (
    CANCELLED,
    JSON_HEADERS,
    TIMED_OUT,
    TRANSPORT_ERROR,
    Endpoint,
    LoadGenerator,
)
from benchmarks.peers.settings import SERVED_MODEL
from benchmarks.stats import RequestRecord, percentile, summarize
from benchmarks.targets import Answer, Target
from benchmarks.workloads import GenerateRequest, Request


@dataclass
class StreamRecord(RequestRecord):
    """A request record plus when its token chunks arrived (seconds from the run's start)."""

    first_token: float | None = None
    last_token: float | None = None
    chunks: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from the scheduled arrival (so queueing counts)."""
        return None if self.first_token is None else self.first_token - self.scheduled

    @property
    def tpot(self) -> float | None:
        return tpot(self.first_token, self.last_token, self.tokens)


def tpot(first: float | None, last: float | None, tokens: int) -> float | None:
    """Time per output token after the first: (last - first) / (tokens - 1).

    Token counts come from the usage chunk, not the chunk count: a server may put several
    tokens in one chunk. None when fewer than two tokens came.
    """
    if first is None or last is None or tokens < 2:
        return None
    return (last - first) / (tokens - 1)


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one ``data:`` line of an OpenAI stream; None for others and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def chunk_text(chunk: dict[str, Any]) -> str:
    """Generated text in a completions or chat chunk ('' for role, usage and empty chunks)."""
    text = []
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text.append(choice.get("text") or "")
        else:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def chunk_usage_tokens(chunk: dict[str, Any]) -> int | None:
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return None


class StreamingTarget(Target):
    """OpenAI completions or chat with ``stream: true``, greedy, exact lengths.

    ``ignore_eos`` (a vLLM extension carpool also takes) makes every request cost exactly
    ``max_tokens`` decode steps on both systems, so token rates compare. With
    ``stream=False`` the same requests are answered whole (``--no-stream``): what per-token
    delivery costs a server is the difference.
    """

    kind = "generate"

    def __init__(
        self, name: str, prefix: str, endpoint: str = "completions", stream: bool = True
    ) -> None:
        super().__init__(name, prefix)
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint {endpoint!r}: use 'completions' or 'chat'")
        self.endpoint = endpoint
        self.stream = stream

    @property
    def path(self) -> str:
        tail_ = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.prefix + tail_

    @property
    def stats_path(self) -> str | None:
        return None

    def body(self, request: Request) -> dict[str, Any]:
        assert isinstance(request, GenerateRequest)
        body: dict[str, Any] = {
            "model": SERVED_MODEL,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        return body

    def decode(self, request: Request, content: bytes) -> Answer:
        if not self.stream:
            try:
                return Answer(1, int(json.loads(content)["usage"]["completion_tokens"]))
            except (ValueError, KeyError, TypeError):
                return Answer(1, 0)
        tokens = 0
        for line in content.decode(errors="replace").splitlines():
            chunk = parse_sse_line(line)
            if chunk is not None:
                tokens = chunk_usage_tokens(chunk) or tokens
        return Answer(1, tokens)


class PeersLoadGenerator(LoadGenerator):
    """The suite's load generator, reading streamed answers chunk by chunk when asked to.

    Only ``send`` changes (and only for a ``StreamingTarget``); arrivals, closed loops and
    records are the suite's own.
    """

    async def send(
        self, ep: Endpoint, request: Request, body: bytes, index: int, scheduled: float, t0: float
    ) -> RequestRecord:
        if not (isinstance(ep.target, StreamingTarget) and ep.target.stream):
            return await super().send(ep, request, body, index, scheduled, t0)
        started = time.perf_counter() - t0
        record = StreamRecord(index, scheduled, started, started, TRANSPORT_ERROR, target=ep.name)
        headers = {**JSON_HEADERS, **ep.headers}
        try:
            async with self.http.post(self.url(ep.target.path), data=body, headers=headers) as resp:
                record.status = resp.status
                if not 200 <= resp.status < 300:
                    record.error = (await resp.read()).decode(errors="replace")[:300]
                else:
                    async for raw in resp.content:  # one SSE line at a time, as it arrives
                        chunk = parse_sse_line(raw.decode(errors="replace").rstrip("\r\n"))
                        if chunk is None:
                            continue
                        now = time.perf_counter() - t0
                        if chunk_text(chunk):
                            record.chunks += 1
                            record.last_token = now
                            if record.first_token is None:
                                record.first_token = now
                        usage = chunk_usage_tokens(chunk)
                        if usage is not None:
                            record.tokens = usage
                    record.items = 1
                    if record.tokens == 0:  # no usage chunk: one token per chunk
                        record.tokens = record.chunks
        except TimeoutError:
            record.status, record.error = TIMED_OUT, f"no answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            record.status, record.error = TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}"[:300]
        except asyncio.CancelledError:
            record.status = CANCELLED
            raise
        record.finished = time.perf_counter() - t0
        return record


def stream_summary(records: Sequence[RequestRecord], window_s: float | None) -> dict[str, Any]:
    """The suite's summary plus TTFT and TPOT percentiles (ms) over successful streams."""
    summary = summarize(records, window_s).to_dict()
    ok = [r for r in records if isinstance(r, StreamRecord) and r.ok]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    tpots = [t * 1000 for r in ok if (t := r.tpot) is not None]
    summary["ttft_ms"] = {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)}
    summary["tpot_ms"] = {"p50": percentile(tpots, 50), "p99": percentile(tpots, 99)}
    summary["output_tokens"] = sum(r.tokens for r in ok)
    return summary


def burst_split(records: Sequence[RequestRecord], clients: int) -> dict[str, Any]:
    """TTFT of a closed loop's opening burst (its first ``clients`` requests, sent at once)
    apart from the requests after it, which arrive one at a time as answers end: where a
    TTFT p99 comes from (all the prompts of the burst prefill together, so its last first
    tokens wait for all of them)."""
    ok = [r for r in records if isinstance(r, StreamRecord) and r.ok and r.ttft is not None]
    burst = [r.ttft * 1000 for r in ok if r.index < clients]
    after = [r.ttft * 1000 for r in ok if r.index >= clients]
    return {
        "burst": {"n": len(burst), "p50": percentile(burst, 50), "max": max(burst, default=0.0)},
        "after": {"n": len(after), "p50": percentile(after, 50), "p99": percentile(after, 99)},
    }
