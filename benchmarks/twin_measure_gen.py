"""Generation's half of ``benchmarks.twin_validate measure``: carpool's continuous engine in
process (as ``benchmarks.generation_compare`` builds it: greedy, ``ignore_eos``, one torch
thread), per configuration and round: a 1-client calibration and an 8-client one (neither
among the validated figures), closed loops at 4, 16 and 64 clients, and on the default a
replay of the Azure conversation trace (time and token counts scaled, both stated)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from benchmarks.twin_common import (
    GEN_CALIB_LOADED_CLIENTS,
    GEN_CALIB_REQUESTS,
    GEN_CONFIGS,
    GEN_MAX_SEQ_LEN,
    SEED,
    cpu_snapshot,
    cpu_used,
    save_json,
)
from benchmarks.twin_gpu_engine import summarise
from carpool.generation.schemas import GenerationCall


async def _first_delta_tokens(server: Any, texts: list[str]) -> list[int]:
    async def one(text: str) -> int:
        call = GenerationCall(prompts=[text], max_tokens=4, temperature=0.0, ignore_eos=True,
                              logprobs=0)  # fmt: skip
        async for event in server.stream(call):
            if event.type == "delta" and event.text:
                return max(1, len((event.logprobs or {}).get("tokens") or [None]))
        return 4

    return list(await asyncio.gather(*(one(t) for t in texts)))


def first_delta_tokens(server: Any, texts: list[str]) -> list[int]:
    """How many tokens each prompt's first visible text delta carries, greedy: the stream
    holds a token whose text may still change, so a first token that decodes to held text
    reaches the client with the next (SmolLM2 on 6 of generation_compare's 8 prompts). With
    ``logprobs`` every delta lists its tokens, which is how they are counted here."""
    return asyncio.run(_first_delta_tokens(server, texts))


def prompt_tokens(model: str) -> list[int]:
    """Tokens of each of generation_compare's prompts, as its server feeds them."""
    from transformers import AutoTokenizer

    from benchmarks.generation_compare import PROMPTS
    from carpool.models import resolve_model_source

    tok = AutoTokenizer.from_pretrained(resolve_model_source(model))
    return [len(tok(p)["input_ids"]) for p in PROMPTS]


def gen_server(model: Any, tokenizer: Any, source: str, knobs: dict[str, Any]) -> Any:
    """carpool's continuous engine in process, as generation_compare builds it, with a
    ``max_seq_len`` that lets 64 slots fit the default KV ceiling (2048 MB): the default
    2048-token slots need 6 GB at 64 sequences, which is what failed at start-up before."""
    from deployments.generator import GeneratorServer

    config = {
        "source": {"model": source},
        "mode": "continuous",
        "batching": {**knobs, "request_timeout_s": 3600},
        "limits": {"max_seq_len": GEN_MAX_SEQ_LEN},
    }
    return GeneratorServer(config, model=model, tokenizer=tokenizer)


async def _gen_calls(
    server: Any, calls: list[dict[str, Any]], clients: int = 0, times: list[float] | None = None
) -> dict[str, Any]:
    """``clients`` closed-loop clients over ``calls``, or each call sent at its time in
    ``times`` (open loop); per request: latency, TTFT (first delta), output tokens."""
    records: list[dict[str, float]] = []

    async def one(call: dict[str, Any]) -> None:
        start = time.perf_counter()
        first, tokens = None, 0
        async for event in server.stream(GenerationCall(**call)):
            if event.type == "delta" and first is None:
                first = time.perf_counter()
            if event.type == "end":
                tokens = event.completion_tokens
        end = time.perf_counter()
        records.append({"sent_s": start - t0, "latency_s": end - start,
                        "ttft_s": (first or end) - start, "tokens": tokens})  # fmt: skip

    queue = list(calls)

    async def client() -> None:
        while queue:
            await one(queue.pop(0))

    async def at(delay: float, call: dict[str, Any]) -> None:
        await asyncio.sleep(max(0.0, delay - (time.perf_counter() - t0)))
        await one(call)

    before = server.stats()
    t0 = time.perf_counter()
    if times is None:
        await asyncio.gather(*(client() for _ in range(clients)))
    else:
        await asyncio.gather(*(at(t, c) for t, c in zip(times, calls, strict=True)))
    wall = time.perf_counter() - t0
    after = server.stats()
    return {**summarise(records, wall, after["steps"] - before["steps"]),
            "loadavg": list(os.getloadavg())}  # fmt: skip


def trace_calls(tokenizer: Any, args: Any) -> tuple[list[float], list[dict[str, Any]], list[int]]:
    """``trace_requests`` requests of the conversation trace from ``trace_start`` seconds in
    (its first minutes are sparse), time compressed or stretched so they arrive at
    ``trace_rate`` requests/s on average, bursts kept; token counts times
    ``trace_token_scale`` (the traces' README asks both factors be stated). Prompts are
    synthesized to their token count, outputs forced with ``ignore_eos``."""
    from carpool_twin.traffic import load_trace

    traffic = load_trace(args.trace)
    assert traffic.trace is not None
    window = [(t, r) for t, r in traffic.trace if t >= args.trace_start][: args.trace_requests]
    t0, span = window[0][0], max(window[-1][0] - window[0][0], 1e-9)
    factor = (len(window) / args.trace_rate) / span
    times, calls, prompts = [], [], []
    words = [
        "the",
        "river",
        "runs",
        "past",
        "the",
        "old",
        "market",
        "where",
        "people",
        "sell",
        "bread",
        "and",
        "fish",
    ]
    for t, req in window:
        out = max(1, round(req.max_tokens * args.trace_token_scale))
        want = max(4, round(req.prompt_tokens * args.trace_token_scale))
        want = min(want, GEN_MAX_SEQ_LEN - out - 8)
        ids = tokenizer(" ".join(words[i % len(words)] for i in range(2 * want)))["input_ids"]
        text = tokenizer.decode(ids[:want])
        times.append((t - t0) * factor)
        prompts.append(len(tokenizer(text)["input_ids"]))  # exact, as the server will see it
        calls.append({"prompts": [text], "max_tokens": out, "temperature": 0.0,
                      "ignore_eos": True})  # fmt: skip
    return times, calls, prompts


def _measure_config(server: Any, name: str, clients_list: tuple[int, ...], tokenizer: Any,
                    args: Any) -> dict[str, Any]:  # fmt: skip
    from benchmarks.generation_compare import workload

    res: dict[str, Any] = {}
    calib = workload(GEN_CALIB_REQUESTS, 32, 32, SEED)
    res["calibrate"] = asyncio.run(_gen_calls(server, calib, 1))
    # Under load (not a validated figure): what a step costs while 8 streams are delivered.
    loaded = workload(2 * GEN_CALIB_LOADED_CLIENTS, 32, 32, SEED)
    res["calibrate_8"] = asyncio.run(_gen_calls(server, loaded, GEN_CALIB_LOADED_CLIENTS))
    for clients in clients_list:
        if clients not in args.gen_clients:
            continue
        # Enough requests that a p99 is not just the slowest of a few (16 at 4 clients
        # until run 2: the p99 was the first wave's burst): at least ``gen_requests``, and
        # one wave of the clients. (Run 3 took two waves, 128 at 64 clients:
        # max_num_seqs_16's queue then passed its 60 s bound on the slower machine, and the
        # refusal ended that configuration.)
        n = max(args.gen_requests, clients)
        print(f"generation {name}: {clients} clients, {n} requests", file=sys.stderr, flush=True)
        before = cpu_snapshot()
        r = asyncio.run(_gen_calls(server, workload(n, 8, 256, SEED), clients))
        res[str(clients)] = {"requests": n, **r, "cpu": cpu_used(before, cpu_snapshot())}
    if name == "default" and args.trace_requests > 0:
        times, calls, prompts = trace_calls(tokenizer, args)
        print(f"generation: trace, {len(calls)} requests", file=sys.stderr, flush=True)
        r = asyncio.run(_gen_calls(server, calls, times=times))
        r["first_delta_tokens"] = first_delta_tokens(server, [c["prompts"][0] for c in calls])
        res["trace"] = {**r, "times": times, "prompt_tokens": prompts,
                        "max_tokens": [c["max_tokens"] for c in calls],
                        "rate": args.trace_rate, "token_scale": args.trace_token_scale,
                        "start_s": args.trace_start, "source": args.trace}  # fmt: skip
    return res


def measure_generation(args: Any) -> list[dict[str, Any]]:
    """carpool's continuous engine in process (no HTTP: generation_compare's setting), per
    round and configuration (configurations interleaved within a round): the calibrations,
    then closed loops at each client count; then the conversation trace, open loop, on the
    default configuration. One dict per round."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.generation_compare import PROMPTS, workload
    from carpool.models import resolve_model_source
    from carpool.threads import size_torch_threads

    size_torch_threads(None, 1)
    path = resolve_model_source(args.gen_model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    shared: dict[str, Any] = {"model": args.gen_model, "prompt_tokens": prompt_tokens(args.gen_model),
                              "max_seq_len": GEN_MAX_SEQ_LEN}  # fmt: skip
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        out = dict(shared)
        rounds.append(out)
        for name in args.gen_configs:
            knobs, clients_list = GEN_CONFIGS[name]
            server = gen_server(model, tokenizer, args.gen_model, knobs)
            started = time.time()
            try:
                asyncio.run(_gen_calls(server, workload(1, 4, 4, SEED), 1))  # warm-up
                if "first_delta_tokens" not in shared:
                    shared["first_delta_tokens"] = first_delta_tokens(server, PROMPTS)
                out["first_delta_tokens"] = shared["first_delta_tokens"]
                res = _measure_config(server, name, clients_list, tokenizer, args)
                out[name] = {"knobs": knobs, **res}
            except Exception as exc:  # one configuration's failure must not lose the others
                out[name] = {"knobs": knobs, "error": repr(exc)}
            finally:
                server.close()
            print(f"generation round {rnd} {name}: {time.time() - started:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            save_json(args.out + ".gen.partial", {"rounds": [{"generation": r} for r in rounds]})
    return rounds
