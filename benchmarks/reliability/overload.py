"""``overload``: capacity, then normal load and 3x overload in one run, per app.

For each app (embed; generate with ``--generate``): closed-loop saturation throughput is the
capacity; then Poisson load at ``--normal`` x capacity and at ``--factor`` x capacity for
``--duration`` seconds each. Each phase reports offered/accepted/refused rates, accepted and
refused latency, statuses, Retry-After on refusals and lost requests; the run reports
accepted-p99(overload) / p99(normal) against ``--max-ratio`` (2.0). ``--sweep`` repeats both
phases for other values of a ``user_config`` knob (applied in place, as ``serve deploy``).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any

from benchmarks.loadgen import Endpoint, LoadGenerator
from benchmarks.reliability.analysis import phase_summary, ratio
from benchmarks.reliability.cluster import Cluster, apply_overrides, parse_set, user_config
from benchmarks.reliability.common import CAPACITY_CONCURRENCY, fmt, header_md, statuses_text, table
from benchmarks.reliability.load import capacity, endpoint

# The deployment whose admission knobs matter for each app's overload behaviour.
ADMITTING = {"embed": "embedder", "generate": "small", "rank": "ranker"}


async def settle(gen: LoadGenerator, cluster: Cluster, seconds: float = 3.0) -> None:
    """Lets queues drain between phases."""
    await asyncio.sleep(seconds)


async def phase(
    gen: LoadGenerator, ep: Endpoint, rate: float, duration_s: float, seed: int
) -> dict[str, Any]:
    run = await gen.run_open_mixed([(ep, rate)], duration_s, seed=seed)
    summary = phase_summary(run.records, duration_s)
    summary["rate"] = rate
    summary["loadavg_after"] = os.getloadavg()[0]
    return summary


async def overload_app(
    gen: LoadGenerator,
    cluster: Cluster,
    app: str,
    args: Any,
    sweep: list[tuple[str, str, str, Any]],
) -> dict[str, Any]:
    ep = endpoint(app, max_tokens=args.max_tokens)
    for name, value in parse_headers(args.header).items():
        ep.headers[name] = value
    cap_given = (args.capacity or {}).get(app)
    if cap_given:
        cap = {"endpoint": app, "rps": cap_given, "given": True}
    else:
        conc = args.cap_concurrency or CAPACITY_CONCURRENCY.get(app, 8)
        print(
            f"[{app}] measuring capacity: closed loop, {conc} in flight, {args.cap_duration:g} s",
            flush=True,
        )
        cap = await capacity(gen, ep, conc, args.cap_duration)
    rps = float(cap["rps"])
    print(f"[{app}] capacity {rps:.2f} req/s", flush=True)
    points: list[dict[str, Any]] = []
    variants: list[tuple[str, dict[tuple[str, str], dict[str, Any]]]] = [("serve.yaml", {})]
    variants += [(f"{a}.{d}.{k}={v}", {(a, d): {k: v}}) for a, d, k, v in sweep]
    base = cluster.config
    for label, override in variants:
        if override and not cluster.external:
            print(f"[{app}] redeploying with {label}", flush=True)
            await asyncio.to_thread(cluster.deploy, apply_overrides(base, override))
            await gen.run_closed(
                ep, None, 4, 3.0, refusal_backoff_s=0.5
            )  # refit the replica's cost model
        elif override:
            print(f"[{app}] --url: cannot apply {label}; skipped", flush=True)
            continue
        dep = ADMITTING.get(app, "")
        knobs = effective_knobs(app, user_config(cluster.config, app, dep))
        result: dict[str, Any] = {"variant": label, "knobs": {dep: knobs}}
        for name, mult in (("normal", args.normal), ("overload", args.factor)):
            rate = mult * rps
            print(
                f"[{app}] {label}: {name} at {rate:.1f} req/s for {args.duration:g} s", flush=True
            )
            result[name] = await phase(gen, ep, rate, args.duration, seed=len(points) * 7 + 1)
            await settle(gen, cluster, args.settle)
        p99n = result["normal"]["accepted_latency_ms"]["p99"]
        p99o = result["overload"]["accepted_latency_ms"]["p99"]
        result["p99_ratio"] = ratio(p99o, p99n)
        lost = result["normal"]["lost"] + result["overload"]["lost"]
        result["lost"] = lost
        result["meets_target"] = bool(
            not math.isnan(result["p99_ratio"])
            and result["p99_ratio"] <= args.max_ratio
            and lost == 0
        )
        points.append(result)
        print(render_point(app, result), flush=True)
    if len(variants) > 1 and not cluster.external:
        await asyncio.to_thread(cluster.deploy, base)  # back to serve.yaml's knobs
    return {"app": app, "capacity": cap, "points": points}


def effective_knobs(app: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """serve.yaml's knobs over carpool's defaults: what the replica really runs with."""
    try:
        if app == "generate":
            from deployments.generator import GeneratorBatching

            return GeneratorBatching.model_validate(knobs).model_dump()
        from carpool.config import BatchingConfig

        return BatchingConfig.model_validate(knobs).model_dump()
    except Exception:  # an older or newer carpool: report what serve.yaml says
        return dict(knobs)


def parse_headers(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--header {item!r}: expected name:value")
        out[name.strip().lower()] = value.strip()
    return out


def parse_sweep(items: list[str] | None) -> list[tuple[str, str, str, Any]]:
    """``app.dep.knob=v1,v2`` -> one (app, dep, knob, value) per value."""
    out = []
    for item in items or []:
        key, _, values = item.partition("=")
        for v in values.split(","):
            (((app, dep), knobs),) = parse_set([f"{key}={v}"]).items()
            ((knob, value),) = knobs.items()
            out.append((app, dep, knob, value))
    return out


PHASE_HEADERS = [
    "phase",
    "offered req/s",
    "accepted req/s",
    "refused req/s",
    "acc p50 ms",
    "acc p99 ms",
    "ref p50 ms",
    "ref p99 ms",
    "failed",
    "lost",
    "Retry-After",
    "statuses",
    "load avg",
]


def phase_row(name: str, s: dict[str, Any]) -> list[Any]:
    ra = s["retry_after_share"]
    return [
        name,
        s["offered_rps"],
        s["accepted_rps"],
        s["refused_rps"],
        s["accepted_latency_ms"]["p50"],
        s["accepted_latency_ms"]["p99"],
        s["refused_latency_ms"]["p50"],
        s["refused_latency_ms"]["p99"],
        s["failed"],
        s["lost"],
        "-" if ra is None or math.isnan(ra) else f"{ra:.0%}",
        statuses_text(s["statuses"]),
        s.get("loadavg_after"),
    ]


def render_point(app: str, p: dict[str, Any]) -> str:
    rows = [phase_row(f"{app} {n}", p[n]) for n in ("normal", "overload")]
    verdict = "met" if p["meets_target"] else "MISSED"
    return (
        f"\n{p['variant']}  knobs {p['knobs']}\n"
        + table(PHASE_HEADERS, rows)
        + f"\n\naccepted p99 overload/normal = {fmt(p['p99_ratio'], 2)}, lost = {p['lost']} "
        f"(target <= 2.0 and 0: {verdict})\n"
    )


def render(data: dict[str, Any]) -> str:
    parts = [header_md("Overload: normal load vs 3x capacity", data)]
    for app in data["apps"]:
        cap = app["capacity"]
        how = (
            "given"
            if cap.get("given")
            else f"closed loop, {cap['concurrency']} in flight for {cap['duration_s']:g} s"
        )
        parts.append(f"\n## {app['app']}\n\nCapacity {cap['rps']:.2f} req/s ({how}).\n")
        for p in app["points"]:
            parts.append(render_point(app["app"], p))
    return "\n".join(parts)


async def main(args: Any, cluster: Cluster) -> dict[str, Any]:
    sweep = parse_sweep(args.sweep)
    apps = ["embed"] + (["generate"] if args.generate else [])
    out: dict[str, Any] = {"apps": [], "duration_s": args.duration}
    async with LoadGenerator(cluster.url, timeout_s=args.timeout, progress=False) as gen:
        for app in apps:
            await gen.wait_ready(f"/{app}/healthz")
            app_sweep = [s for s in sweep if s[0] == app]
            out["apps"].append(await overload_app(gen, cluster, app, args, app_sweep))
    out["finished_at"] = time.time()
    return out
