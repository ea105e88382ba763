"""The evaluation's data and in-process models: prompt files, ``GeneratorServer`` configs per
engine, the small model's cached true lengths, and a router with no model behind it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.router_eval.settings import (
    LENGTH_MAX_TOKENS,
    LENGTHS_PATH,
    PROMPTS_PATH,
    SMALL_MODEL,
    THREADS,
)
from carpool.generation.schemas import GenerationCall

if TYPE_CHECKING:
    from carpool.generation.hops import GenerationEvent, GenerationResult


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chat(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]


def chat_call(
    prompt: str, max_tokens: int, system: str | None = None, judged: bool = False
) -> GenerationCall:
    """A greedy chat call of ``prompt`` (after ``system``), as the parts send it; ``judged``:
    the cascade reads its logprobs (vLLM computes them only then)."""
    return GenerationCall(
        messages=chat(prompt, system), max_tokens=max_tokens, temperature=0.0, judged=judged
    )


ENGINES = ("continuous", "vllm")


def server_config(
    model: str,
    max_num_seqs: int,
    max_step_tokens: int = 512,
    engine: str = "continuous",
    priority: bool = False,
    aging: float = 50.0,
) -> dict[str, Any]:
    """``GeneratorServer`` args for a part's model on ``engine``.

    Both engines get ``THREADS["torch"]`` compute threads: torch's for the continuous engine,
    vLLM's OpenMP threads bound to cores ``0..n-1`` for ``vllm`` (its default binds every
    core, which would hand it twice the continuous engine's CPU here). vLLM otherwise runs
    as docs/vllm.md sets it up for CPU (KV cache ``cpu_kvcache_space_gib`` default, compiled
    graphs); ``priority`` turns on vLLM's priority queue, keyed by the router's prediction
    with the router's aging, so it orders as the lanes do.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: use one of {ENGINES}")
    threads = THREADS["torch"]
    config: dict[str, Any] = {
        "source": {"model": model},
        "mode": engine,
        "replica": {"num_cpus": threads},
        "limits": {"max_seq_len": 512, "max_tokens_limit": 256},
        "batching": {
            "max_num_seqs": max_num_seqs,
            "max_step_tokens": max_step_tokens,
            "max_waiting": 4096,
            "batch_wait_timeout_s": 0.005,
        },
    }
    if engine == "vllm":
        config["vllm"] = {
            "priority_scheduling": priority,
            "aging_tokens_per_s": aging,
            "cpu_omp_threads_bind": "0" if threads == 1 else f"0-{threads - 1}",
        }
    elif priority:
        raise ValueError("priority scheduling inside the engine is vLLM's (engine 'vllm')")
    return config


def make_server(model: str, max_num_seqs: int, max_step_tokens: int = 512, **engine: Any) -> Any:
    from deployments.generator import GeneratorServer

    return GeneratorServer(server_config(model, max_num_seqs, max_step_tokens, **engine))


async def _run_all(server: Any, calls: list[GenerationCall]) -> list[GenerationResult]:
    return list(await asyncio.gather(*(server.generate(c) for c in calls)))


def true_lengths(refresh: bool) -> dict[str, int]:
    """Small model's greedy output tokens per prompt id (cached: a run takes minutes)."""
    prompts = load_jsonl(PROMPTS_PATH)
    if LENGTHS_PATH.exists() and not refresh:
        cached = json.loads(LENGTHS_PATH.read_text())
        if cached.get("model") == SMALL_MODEL and len(cached["lengths"]) == len(prompts):
            return cached["lengths"]
    server = make_server(SMALL_MODEL, max_num_seqs=32, max_step_tokens=1024)
    try:
        start = time.perf_counter()
        calls = [chat_call(p["prompt"], LENGTH_MAX_TOKENS) for p in prompts]
        results = asyncio.run(_run_all(server, calls))
        elapsed = time.perf_counter() - start
    finally:
        server.close()
    lengths = {str(p["id"]): r.completion_tokens for p, r in zip(prompts, results, strict=True)}
    LENGTHS_PATH.write_text(
        json.dumps(
            {
                "model": SMALL_MODEL,
                "max_tokens": LENGTH_MAX_TOKENS,
                "greedy": True,
                "generated_in_s": round(elapsed, 1),
                "lengths": lengths,
            },
            indent=0,
        )
        + "\n"
    )
    print(f"generated {len(prompts)} true lengths in {elapsed:.0f} s -> {LENGTHS_PATH}")
    return lengths


def _features(router: Any, prompt: str, max_tokens: int) -> Any:
    # The router's own feature path (prompt-token estimate, last user turn, cues).
    return router.features(chat_call(prompt, max_tokens))


def _bare_router(config: dict[str, Any] | None = None) -> Any:
    from router.core import RouterServer

    return RouterServer(config or {"policy": "threshold"}, {"small": _NoClient()})


class _NoClient:
    async def generate(self, call: GenerationCall) -> GenerationResult:
        raise RuntimeError("the predictor part runs no model through the router")

    async def stream(self, call: GenerationCall) -> AsyncIterator[GenerationEvent]:
        raise RuntimeError("the predictor part runs no model through the router")
        yield
