"""``python -m benchmarks.prefix_replay``: multi-turn traffic whose prompts share prefixes,
replayed open-loop against the generate app with small on several replicas, one placement
policy after another (``--systems``), each on a fresh deployment of serve-replicas.yaml.

Workloads (``--workload``):

- ``mooncake``: the Mooncake conversation trace (../shared/traces, Qin et al., FAST 2025,
  Apache-2.0), whole conversations: requests that share their second block are one
  conversation, and a deterministic ``--keep`` fraction of conversations is kept (requests
  with one block are conversations of their own). Each 512-token block becomes
  ``--block-words`` words drawn deterministically from its hash id (equal ids, equal text),
  prompts are cut at ``--max-blocks``, outputs are the trace's divided by
  ``--output-divisor`` (at least 1, ``ignore_eos``), and time is scaled so that the kept
  requests arrive at ``--rate`` requests/s on average, keeping the trace's gaps' shape.
- ``shared``: N system prompts x M users x K turns (vLLM's prefix-repetition and
  inference-perf's shared-prefix shape): each user's turn k sends the system prompt, the
  user's earlier turns and a new question; users start at Poisson times, turns follow after
  a think time.

Per system: TTFT p50/p90/p99 and mean, TPOT, E2E, output tokens/s over the replay, and each
replica's prefix-cache hit rate (prompt tokens its engine found cached / prompt tokens, from
the replica's own counters). Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.deploy import ServeCluster, free_port
from benchmarks.stats import percentile
from carpool import local_ray
from carpool_twin.mooncake import TraceRequest as ReplayRequest
from carpool_twin.mooncake import block_text, mooncake

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "serve-replicas.yaml"
SYSTEMS = {"default": "leastconn", "carpool": "cost", "ray-prefix": "ray_prefix"}
# Ray Serve LLM as a user would run it instead (build_openai_app, PrefixCacheAffinityRouter,
# Serve's Python proxy): only from the vLLM venv, which has vLLM and ray.llm's extras.
RAY_SERVE_LLM = "ray-serve-llm"
MODEL_DIR = Path.home() / ".cache" / "carpool" / "models" / "SmolLM2-135M-Instruct"


@dataclass
class Outcome:
    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str | None = None


def shared_prefix(
    systems: int, users: int, turns: int, rate: float, think_s: float, seed: int = 0
) -> tuple[list[ReplayRequest], dict[str, Any]]:
    rng = random.Random(seed)
    prompts = [
        f"System prompt {s}: " + " ".join(block_text(10_000 + s * 50 + b, 16) for b in range(12))
        for s in range(systems)
    ]
    n_users = systems * users
    # Users start as a Poisson process whose rate makes all turns arrive at ~rate on average.
    starts, t = [], 0.0
    for _ in range(n_users):
        t += rng.expovariate(rate / turns)
        starts.append(t)
    requests = []
    for u, start in enumerate(starts):
        history = prompts[u % systems]
        for k in range(turns):
            question = f"\nUser {u} turn {k}: " + block_text(20_000 + u * 100 + k, 24)
            history += question
            requests.append(ReplayRequest(start + k * think_s, history, 32, u, 0))
            history += "Assistant: " + block_text(40_000 + u * 100 + k, 20)
    requests.sort(key=lambda r: r.at)
    facts = {
        "system_prompts": systems,
        "users_per_system_prompt": users,
        "turns": turns,
        "think_s": think_s,
        "requests": len(requests),
        "max_tokens": 32,
    }
    return requests, facts


async def _one(session: aiohttp.ClientSession, url: str, req: ReplayRequest, t0: float) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
    out = Outcome(sent=time.perf_counter())
    body = {
        "model": "small",
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out.error = f"{resp.status}: {(await resp.text())[:200]}"
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                text = "".join(c.get("text", "") for c in chunk.get("choices", []))
                if text:
                    if out.first is None:
                        out.first = time.perf_counter()
                    out.tokens += 1
            out.done = time.perf_counter()
    except Exception as exc:  # a transport error counts against the system, not the run
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def replay(
    base_url: str, requests: list[ReplayRequest], path: str = "/generate/v1/completions"
) -> tuple[list[Outcome], float]:
    url = f"{base_url}{path}"
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter() + 0.5
        outcomes = await asyncio.gather(*(_one(session, url, r, t0) for r in requests))
    return list(outcomes), t0


def summarize(outcomes: list[Outcome], t0: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None and o.first is not None and o.done is not None]
    ttft = [(o.first - o.sent) * 1000 for o in ok]  # type: ignore[operator]
    e2e = [(o.done - o.sent) for o in ok]  # type: ignore[operator]
    tpot = [
        (o.done - o.first) * 1000 / (o.tokens - 1)  # type: ignore[operator]
        for o in ok
        if o.tokens > 1
    ]
    end = max((o.done for o in ok), default=t0)  # type: ignore[type-var]
    tokens = sum(o.tokens for o in ok)
    return {
        "requests": len(outcomes),
        "answered": len(ok),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "ttft_ms": {
            "mean": statistics.fmean(ttft) if ttft else None,
            "p50": percentile(ttft, 50),
            "p90": percentile(ttft, 90),
            "p99": percentile(ttft, 99),
        },
        "tpot_ms_mean": statistics.fmean(tpot) if tpot else None,
        "e2e_s": {"mean": statistics.fmean(e2e) if e2e else None, "p90": percentile(e2e, 90)},
        "output_tokens": tokens,
        "tokens_per_s": tokens / max(1e-9, end - t0),
        "wall_s": end - t0,
    }


def replica_counters(app: str = "generate") -> dict[str, dict[str, float]]:
    """Each small replica's cumulative prompt and cached-prompt tokens (its own report)."""
    import ray

    counters = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = entry["name"], entry["namespace"]
        if f"{app}#small#" not in name:
            continue
        stats = ray.get(ray.get_actor(name, namespace=namespace).record_routing_stats.remote())
        counters[name] = {
            "prompt_tokens": stats.get("prompt_tokens", 0),
            "prompt_cached_tokens": stats.get("prompt_cached_tokens", 0),
        }
    return counters


def router_cpu_s(app: str = "generate") -> float | None:
    """CPU seconds the placement router's replica has used so far (None: no router)."""
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if f"{app}#placement_router#" in entry["name"]:
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def router_idle_cpu_per_s(window_s: float = 20.0, app: str = "generate") -> float | None:
    """The placement router's CPU seconds per second with no request in flight."""
    start = router_cpu_s(app)
    if start is None:
        return None
    time.sleep(window_s)
    return ((router_cpu_s(app) or 0.0) - start) / window_s


def hit_rates(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    rates = {}
    for name, now in after.items():
        was = before.get(name, {"prompt_tokens": 0, "prompt_cached_tokens": 0})
        prompt = now["prompt_tokens"] - was["prompt_tokens"]
        cached = now["prompt_cached_tokens"] - was["prompt_cached_tokens"]
        rates[name.rsplit("#", 1)[-1]] = cached / prompt if prompt else 0.0
    return rates


def app_args(replicas: int, policy: str) -> tuple[dict[str, Any], dict[str, Any]]:
    config = yaml.safe_load(CONFIG.read_text())
    app = next(a for a in config["applications"] if a["name"] == "generate")
    args = dict(app["args"])
    args["placement"] = {**args.get("placement", {}), "policy": policy}
    deployment = dict(app["deployments"][0])
    deployment["num_replicas"] = replicas
    return args, deployment


def deploy(replicas: int, policy: str, name: str = "generate") -> None:
    """serve-replicas.yaml's generate app with ``policy``, as app ``name`` at ``/name``."""
    from ray import serve

    from pipelines.generate import build_generate_app

    args, deployment = app_args(replicas, policy)
    app = build_generate_app(args)
    # The config file's deployment entry, applied as `serve run` would.
    app._bound_deployment = app._bound_deployment.options(
        num_replicas=deployment["num_replicas"],
        max_ongoing_requests=deployment["max_ongoing_requests"],
        max_queued_requests=deployment["max_queued_requests"],
        user_config=deployment["user_config"],
    )
    serve.run(app, name=name, route_prefix=f"/{name}")


def deploy_ray_serve_llm(replicas: int, port: int) -> None:
    """Ray Serve LLM's OpenAI app over the same model, replicas and KV per replica."""
    import ray
    from ray import serve
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )
    from ray.serve.llm import LLMConfig, build_openai_app

    # Its ingress asks for a CPU the engines' bundles already took (../shared/PLATFORM.md).
    ray.init(
        address="local", num_cpus=2 * replicas + 2, include_dashboard=False, log_to_driver=False
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = LLMConfig(
        model_loading_config={"model_id": "small", "model_source": str(MODEL_DIR)},
        accelerator_config={"kind": "cpu"},
        deployment_config={
            "num_replicas": replicas,
            "request_router_config": {"request_router_class": PrefixCacheAffinityRouter},
        },
        engine_kwargs={"dtype": "float32", "max_model_len": 2048, "enforce_eager": True},
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}},
    )
    serve.run(build_openai_app({"llm_configs": [config]}), name="llm", route_prefix="/")


def run_ray_serve_llm(replicas: int, rounds: list[list[ReplayRequest]]) -> list[dict[str, Any]]:
    import ray
    from ray import serve

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    summaries = []
    try:
        started = time.perf_counter()
        deploy_ray_serve_llm(replicas, port)
        warm(base_url, "/v1/completions")
        ready_s = time.perf_counter() - started
        for requests in rounds:
            outcomes, t0 = asyncio.run(replay(base_url, requests, "/v1/completions"))
            summary = summarize(outcomes, t0)
            summary["replica_prefix_hit_rate"] = {}  # vLLM's counters are not read here
            summary["deploy_s"] = ready_s
            summaries.append(summary)
    finally:
        serve.shutdown()
        ray.shutdown()
    return summaries


def run_carpool(
    replicas: int, policy: str, rounds: list[list[ReplayRequest]]
) -> list[dict[str, Any]]:
    """One fresh deployment with ``policy``, then each round's requests in turn."""
    cluster = ServeCluster(port=free_port(), own_session=True, logical_cpus=4)
    summaries = []
    try:
        cluster.start()
        started = time.perf_counter()
        deploy(replicas, policy)
        warm(cluster.base_url)
        ready_s = time.perf_counter() - started
        for requests in rounds:
            before, cpu_before = replica_counters(), router_cpu_s()
            wall_before = time.perf_counter()
            outcomes, t0 = asyncio.run(replay(cluster.base_url, requests))
            summary = summarize(outcomes, t0)
            summary["replica_prefix_hit_rate"] = hit_rates(before, replica_counters())
            if cpu_before is not None:
                # The routing decision's cost: the placement router's CPU per request (its
                # HTTP from HAProxy's Lua, the body's JSON, the policy), with the replica's
                # background work (Serve's stats polls, long polls, metrics) included.
                cpu = (router_cpu_s() or 0.0) - cpu_before
                summary["router_cpu_ms_per_request"] = 1000 * cpu / len(requests)
                summary["router_busy_s"] = time.perf_counter() - wall_before
            summary["deploy_s"] = ready_s
            summaries.append(summary)
        # The same replica idle after the replay, over a fixed window: what it burns with no
        # request in flight. The rest of its CPU during a round is the requests'.
        idle_cpu_per_s = router_idle_cpu_per_s()
        for summary in summaries:
            busy_s = summary.pop("router_busy_s", None)
            if idle_cpu_per_s is not None and busy_s is not None:
                idle_ms = 1000 * idle_cpu_per_s * busy_s
                summary["router_idle_cpu_ms_per_s"] = 1000 * idle_cpu_per_s
                summary["router_decision_cpu_ms_per_request"] = (
                    summary["router_cpu_ms_per_request"] - idle_ms / summary["requests"]
                )
    finally:
        cluster.shutdown()
    return summaries


def warm(base_url: str, path: str = "/generate/v1/completions") -> None:
    """A few requests so that each replica has compiled and served before the clock runs."""
    import urllib.request

    for i in range(8):
        body = json.dumps(
            {"model": "small", "prompt": f"warm up {i} " * 20, "max_tokens": 4}
        ).encode()
        req = urllib.request.Request(
            f"{base_url}{path}",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=300).read()


def arguments(description: str) -> argparse.ArgumentParser:
    """The replay's options (``benchmarks.prefix_paired`` adds its own to them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", choices=["mooncake", "shared"], default="mooncake")
    parser.add_argument("--systems", default="default,carpool,ray-prefix")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rate", type=float, default=0.8, help="mean requests/s offered")
    parser.add_argument("--keep", type=float, default=0.02, help="mooncake: conversations kept")
    parser.add_argument("--block-words", type=int, default=8)
    parser.add_argument("--max-blocks", type=int, default=64)
    parser.add_argument("--output-divisor", type=float, default=8.0)
    parser.add_argument("--shared", default="4,4,5", help="shared: systems,users,turns")
    parser.add_argument("--think-s", type=float, default=10.0)
    parser.add_argument("--limit", type=int, default=0, help="first N requests only (0: all)")
    parser.add_argument("--out", default="benchmarks/results/prefix-replay.json")
    return parser


def build_rounds(
    args: argparse.Namespace, rates: list[float]
) -> tuple[list[list[ReplayRequest]], list[dict[str, Any]]]:
    """One round of requests per rate, each other conversations (a disjoint slice, or other
    users), so that no round finds the cache an earlier round of the same deployment left."""
    rounds, facts_by_round = [], []
    for i, rate in enumerate(rates):
        if args.workload == "mooncake":
            requests, facts = mooncake(
                args.keep,
                rate,
                args.block_words,
                args.max_blocks,
                args.output_divisor,
                offset=i * args.keep,
            )
        else:
            s, u, k = (int(x) for x in args.shared.split(","))
            requests, facts = shared_prefix(s, u, k, rate, args.think_s, seed=i)
        if args.limit:
            requests = requests[: args.limit]
        facts.update(workload=args.workload, rate=rate, replicas=args.replicas)
        print(json.dumps(facts))
        rounds.append(requests)
        facts_by_round.append(facts)
    return rounds, facts_by_round


def command(module: str, args: argparse.Namespace) -> str:
    return f"python -m {module} " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates",
        default="",
        help="a sweep, e.g. 0.6,0.9,1.2: one deployment per system, one round per rate, "
        "each round other conversations (mooncake: the next --keep slice)",
    )
    parser.add_argument("--ttft-p90-target-ms", type=float, default=5000.0)
    args = parser.parse_args()
    # Before Ray is imported: it reads its auth mode then (token auth, loopback only).
    os.environ.update(local_ray.ray_environment())

    rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
    rounds, facts_by_round = build_rounds(args, rates)
    results: dict[str, Any] = {
        "command": command("benchmarks.prefix_replay", args),
        "workload": facts_by_round[0] if len(rates) == 1 else facts_by_round,
        "machine": {"cpus": 2, "python": platform.python_version()},
        "systems": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.systems.split(","):
        if name == RAY_SERVE_LLM:
            summaries = run_ray_serve_llm(args.replicas, rounds)
        else:
            summaries = run_carpool(args.replicas, SYSTEMS[name], rounds)
        for rate, summary in zip(rates, summaries, strict=True):
            key = name if len(rates) == 1 else f"{name}@{rate:g}"
            results["systems"][key] = _report(key, summary)
        out.write_text(json.dumps(results, indent=2))
    if len(rates) > 1:
        results["capacity_rps"] = capacity(results["systems"], args.ttft_p90_target_ms)
        print(
            f"highest rate with TTFT p90 <= {args.ttft_p90_target_ms:g} ms and every request "
            f"answered: {json.dumps(results['capacity_rps'])}"
        )
        out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def capacity(systems: dict[str, Any], ttft_p90_target_ms: float) -> dict[str, float | None]:
    """Per system, the highest rate of the sweep it served within the TTFT p90 target."""
    best: dict[str, float | None] = {}
    for key, summary in systems.items():
        name, _, rate = key.partition("@")
        best.setdefault(name, None)
        ok = (
            summary["answered"] == summary["requests"]
            and summary["ttft_ms"]["p90"] is not None
            and summary["ttft_ms"]["p90"] <= ttft_p90_target_ms
        )
        if ok and (best[name] is None or float(rate) > best[name]):
            best[name] = float(rate)
    return best


def _report(name: str, summary: dict[str, Any]) -> dict[str, Any]:
    t = summary["ttft_ms"]
    hits = ", ".join(f"{v:.2f}" for v in summary["replica_prefix_hit_rate"].values()) or "n/a"
    print(
        f"{name:13s} answered {summary['answered']}/{summary['requests']} "
        f"TTFT mean {t['mean']:.0f} p50 {t['p50']:.0f} p90 {t['p90']:.0f} "
        f"p99 {t['p99']:.0f} ms  E2E {summary['e2e_s']['mean']:.1f} s  "
        f"{summary['tokens_per_s']:.1f} tok/s  replica hit rates {hits}"
        + (
            f"  router CPU {summary['router_decision_cpu_ms_per_request']:.2f} ms/request"
            if "router_decision_cpu_ms_per_request" in summary
            else ""
        ),
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main()
