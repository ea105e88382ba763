"""``faults``: kill one Serve replica at a time under steady mixed load and watch what happens.

Load: Poisson on /embed, /search and /generate together at ``--load`` of the machine (each
endpoint's share of its own measured capacity). After ``--pre`` seconds the scenario's
replica is killed with ``ray.kill`` (no restart: Serve's controller must replace it); the
load runs ``--post`` seconds more. Per endpoint: requests lost (no answer), failed (status,
how fast), and from the kill: time until the replacement replica RUNS, until the success
rate is back to the pre-kill level, and until latency is back (window p99 <= 2x pre-kill).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.loadgen import Endpoint, LoadGenerator, LoadResult
from benchmarks.reliability.analysis import (
    RelRecord,
    is_failed,
    is_lost,
    latency_ms,
    recovery_time,
    status_histogram,
    windows,
)
from benchmarks.reliability.cluster import Cluster
from benchmarks.reliability.common import (
    CAPACITY_CONCURRENCY,
    FAULT_SHARES,
    fmt,
    header_md,
    shares_rates,
    statuses_text,
    table,
)
from benchmarks.reliability.load import capacity, endpoint

# scenario -> (app, deployment) of the replica to kill
SCENARIOS: dict[str, tuple[str, str]] = {
    "embedder": ("embed", "embedder"),
    "ranker": ("rank", "ranker"),
    "retriever": ("search", "retriever"),
    "small": ("generate", "small"),
    "embed_ingress": ("embed", "embed_ingress"),
    "search_ingress": ("search", "search_ingress"),
    "generate_ingress": ("generate", "generate_ingress"),
}


async def measure_capacities(
    gen: LoadGenerator, eps: dict[str, Endpoint], concurrency: int | None, duration_s: float
) -> dict[str, dict[str, Any]]:
    out = {}
    for name, ep in eps.items():
        c = concurrency or CAPACITY_CONCURRENCY.get(name, 8)
        print(f"capacity of {name}: closed loop {c} in flight, {duration_s:g} s", flush=True)
        out[name] = await capacity(gen, ep, c, duration_s)
        print(f"  {out[name]['rps']:.2f} req/s", flush=True)
    return out


async def scenario(
    gen: LoadGenerator,
    cluster: Cluster,
    name: str,
    eps: dict[str, Endpoint],
    rates: dict[str, float],
    args: Any,
    seed: int,
) -> dict[str, Any]:
    app, dep = SCENARIOS[name]
    victims = cluster.replicas_of(app, dep)
    if not victims:
        return {"scenario": name, "skipped": f"no replica of {app}/{dep}"}
    victim = victims[0]
    target_count = len(victims)
    run = LoadResult()
    plan = [(eps[n], rates[n]) for n in eps if rates[n] > 0]
    load = asyncio.create_task(
        gen.run_open_mixed(plan, args.pre + args.post, seed=seed, run=run, drain_s=args.timeout + 5)
    )
    await asyncio.sleep(args.pre)
    kill_at = run.now()
    await asyncio.to_thread(cluster.kill, victim)
    print(f"[{name}] killed {victim.name} at t={kill_at:.1f} s", flush=True)
    replaced_at: float | None = None
    deadline = time.monotonic() + args.replace_timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(cluster.replacement_running, victim, target_count):
            replaced_at = run.now()
            break
        await asyncio.sleep(0.25)
    print(
        f"[{name}] replacement RUNNING after "
        f"{'-' if replaced_at is None else f'{replaced_at - kill_at:.1f}'} s",
        flush=True,
    )
    await load
    result: dict[str, Any] = {
        "scenario": name,
        "killed": victim.name,
        "kill_at_s": kill_at,
        "replacement_running_s": None if replaced_at is None else replaced_at - kill_at,
        "endpoints": {},
    }
    for ep_name in eps:
        recs = [r for r in run.records if r.target == ep_name]
        result["endpoints"][ep_name] = endpoint_outcome(recs, kill_at, args.window)
    print(render_scenario(result), flush=True)
    # The next scenario starts from a healthy deployment.
    if replaced_at is None:
        await asyncio.sleep(10)
    await asyncio.sleep(args.settle)
    return result


def endpoint_outcome(recs: list[RelRecord], kill_at: float, window_s: float) -> dict[str, Any]:
    before = [r for r in recs if r.scheduled < kill_at]
    after = [r for r in recs if r.scheduled >= kill_at]
    # Requests in flight at the kill are the ones most at risk: scheduled before, done after.
    around = [r for r in recs if r.scheduled < kill_at <= r.finished]
    base_ok = [r for r in before if r.ok]
    base_success = len(base_ok) / len(before) if before else 1.0
    base_p99 = latency_ms(base_ok)["p99"]
    wins = windows(recs, window_s)
    failed = [r for r in recs if is_failed(r) or r.rejected]
    fail_times = [r.finished - kill_at for r in failed if r.finished >= kill_at]
    return {
        "sent": len(recs),
        "ok": sum(1 for r in recs if r.ok),
        "lost": sum(1 for r in recs if is_lost(r)),
        "failed": len(failed),
        "statuses": status_histogram(recs),
        "statuses_after_kill": status_histogram(after + around),
        "error_codes": sorted({r.code for r in failed if r.code}),
        "failed_latency_ms": latency_ms(failed),
        "last_failure_after_kill_s": max(fail_times) if fail_times else None,
        "in_flight_at_kill": len(around),
        "in_flight_at_kill_ok": sum(1 for r in around if r.ok),
        "baseline_success": base_success,
        "baseline_p99_ms": base_p99,
        "success_recovered_s": recovery_time(wins, kill_at, base_success),
        "latency_recovered_s": recovery_time(wins, kill_at, base_success, base_p99, 2.0),
        "error_samples": sorted(
            {(r.error or "")[:160] for r in failed + [r for r in recs if is_lost(r)]}
        )[:4],
        "windows": [w.to_dict() for w in wins],
    }


HEADERS = [
    "killed",
    "endpoint",
    "sent",
    "ok",
    "failed",
    "lost",
    "statuses",
    "failed p50/max ms",
    "error codes",
    "replacement RUNNING s",
    "success back s",
    "latency back s",
]


def rows_of(result: dict[str, Any]) -> list[list[Any]]:
    if "skipped" in result:
        return [
            [result["scenario"], "-", "-", "-", "-", "-", result["skipped"], "-", "-", "-", "-"]
        ]
    rows = []
    for ep, o in result["endpoints"].items():
        fl = o["failed_latency_ms"]
        rows.append(
            [
                result["scenario"],
                ep,
                o["sent"],
                o["ok"],
                o["failed"],
                o["lost"],
                statuses_text(o["statuses"]),
                f"{fmt(fl['p50'], 0)}/{fmt(fl['max'], 0)}" if fl["n"] else "-",
                ",".join(o["error_codes"]) or "-",
                result["replacement_running_s"],
                _back(o, "success_recovered_s"),
                _back(o, "latency_recovered_s"),
            ]
        )
    return rows


def _back(outcome: dict[str, Any], key: str) -> Any:
    if not outcome["sent"]:
        return "-"
    return "never" if outcome[key] is None else outcome[key]


def render_scenario(result: dict[str, Any]) -> str:
    return "\n" + table(HEADERS, rows_of(result)) + "\n"


def render(data: dict[str, Any]) -> str:
    rates = ", ".join(f"{k} {v:.2f} req/s" for k, v in data["rates"].items())
    caps = (
        ", ".join(f"{k} {v['rps']:.2f}" for k, v in data["capacities"].items())
        or "not measured: rates given"
    )
    lost = sum(o["lost"] for s in data["scenarios"] for o in s.get("endpoints", {}).values())
    parts = [
        header_md("Faults: a replica killed under steady load", data),
        f"\nLoad {data['load']:.0%} of the machine: {rates} (capacities, req/s: {caps}). "
        f"Each scenario: {data['pre_s']:g} s of load, `ray.kill` of one replica, "
        f"{data['post_s']:g} s more; windows of {data['window_s']:g} s by scheduled time. "
        "'back' = from the kill until every later window is normal again (success rate "
        "within 1 point of the pre-kill rate; latency: window p99 <= 2x pre-kill p99).\n",
        table(HEADERS, [row for s in data["scenarios"] for row in rows_of(s)]),
        f"\n\nRequests lost (no answer) over all scenarios: **{lost}**.\n",
    ]
    for s in data["scenarios"]:
        for ep, o in s.get("endpoints", {}).items():
            if o["error_samples"]:
                parts.append(
                    f"- {s['scenario']} / {ep}: " + "; ".join(f"`{e}`" for e in o["error_samples"])
                )
    return "\n".join(parts) + "\n"


async def main(args: Any, cluster: Cluster) -> dict[str, Any]:
    if not cluster.connected:
        raise SystemExit("faults needs Ray: start the deployment here, or pass --ray-address")
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    deployed = {a["name"] for a in cluster.config.get("applications", [])}
    eps = {
        n: endpoint(n, max_tokens=args.max_tokens)
        for n in FAULT_SHARES
        if cluster.external or n in deployed
    }
    out: dict[str, Any] = {"load": args.load, "pre_s": args.pre, "post_s": args.post}
    out["window_s"] = args.window
    async with LoadGenerator(cluster.url, timeout_s=args.timeout, progress=False) as gen:
        for n in eps:
            await gen.wait_ready(f"/{n}/healthz")
        given = args.capacity or {}
        caps: dict[str, Any] = {}
        if not args.rates:
            caps = await measure_capacities(
                gen,
                {n: e for n, e in eps.items() if n not in given},
                args.cap_concurrency,
                args.cap_duration,
            )
            caps.update(
                {n: {"endpoint": n, "rps": v, "given": True} for n, v in given.items() if n in eps}
            )
        rates = args.rates or shares_rates(
            FAULT_SHARES, {n: c["rps"] for n, c in caps.items()}, args.load
        )
        rates = {n: float(rates.get(n, 0.0)) for n in eps}
        out.update(capacities=caps, rates=rates, scenarios=[])
        print("rates: " + ", ".join(f"{k} {v:.2f}/s" for k, v in rates.items()), flush=True)
        for i, name in enumerate(names):
            out["scenarios"].append(
                await scenario(gen, cluster, name, eps, rates, args, seed=i + 1)
            )
    out["lost_total"] = sum(
        o["lost"] for s in out["scenarios"] for o in s.get("endpoints", {}).values()
    )
    out["finished_at"] = time.time()
    return out
