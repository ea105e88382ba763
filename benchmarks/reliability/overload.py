"""``overload``: capacity, then normal load and 3x overload in one run, per app.

For each app (embed; generate with ``--generate``): closed-loop saturation throughput is the
capacity; then Poisson load at ``--normal`` x capacity and at ``--factor`` x capacity for
``--duration`` seconds each. Each phase reports offered/accepted/refused rates, accepted and
refused latency, statuses, Retry-After on refusals and lost requests. The verdict is goodput:
accepted items/s under overload over the capacity's items/s, against ``--min-goodput``
(0.9), with nothing lost; accepted-p99(overload) / p99(normal) is reported beside it (with
``--header x-carpool-deadline-ms:...`` it shows what a client's deadline buys). ``--sweep``
repeats both phases for other values of a ``user_config`` knob (applied in place). Last,
the CPU one refusal costs end to end (``refusal_cpu``).
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
from carpool.admission import DEADLINE_HEADER


def busy_cpu_s() -> float:
    """CPU seconds every process on the machine has used since boot (/proc/stat)."""
    with open("/proc/stat") as fh:
        ticks = [int(v) for v in fh.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


async def refusal_cpu(
    gen: LoadGenerator, requests: int = 600, concurrency: int = 8
) -> dict[str, Any]:
    """CPU milliseconds one refusal costs, summed over every process but the load generator.

    Two paths, each with ``requests`` refusals at ``concurrency`` in flight, against /embed:
    - ``model_replica``: a deadline of 20 ms on 8 long texts, which the replica's cost model
      says it cannot meet, so the replica's admission refuses it (504) in the same step, and
      before tokenizing, as it refuses overload: proxy, ingress, the hop, the replica.
    - ``ingress``: a spent budget (0 ms), refused by the ingress before it reads the body, the
      cheapest answer Serve's proxy allows; a refusal the ingress remembers (RefusalMemory)
      costs between the two.
    The machine's idle CPU rate, measured just before for as long, is subtracted.
    """
    import random

    from benchmarks.targets import EmbeddingsTarget
    from benchmarks.workloads import EmbedRequest, synth_text

    rng = random.Random(5)
    long = EmbedRequest(tuple(synth_text(250, rng) for _ in range(8)), 8 * 250)
    target = EmbeddingsTarget("embed", "/embed")
    out: dict[str, Any] = {"requests": requests, "concurrency": concurrency}
    for path, budget_ms in (("model_replica", "20"), ("ingress", "0")):
        ep = Endpoint("embed", target, [long], {DEADLINE_HEADER: budget_ms})
        t, base = time.monotonic(), busy_cpu_s()
        await asyncio.sleep(5.0)
        idle_rate = (busy_cpu_s() - base) / (time.monotonic() - t)
        own, t, base = time.process_time(), time.monotonic(), busy_cpu_s()
        run = await gen.run_closed(ep, None, concurrency, 600.0, max_requests=requests)
        wall = time.monotonic() - t
        used = busy_cpu_s() - base - idle_rate * wall - (time.process_time() - own)
        refused = [r for r in run.records if r.status == 504]
        out[path] = {
            "refused": len(refused),
            "statuses": sorted({r.status for r in run.records}),
            "codes": sorted({r.code or "-" for r in run.records}),
            "refusals_per_s": len(refused) / wall,
            "cpu_ms_per_refusal": 1000 * used / max(len(refused), 1),
            "latency_p50_ms": 1000 * sorted(r.latency for r in refused)[len(refused) // 2]
            if refused
            else math.nan,
        }
        print(f"[refusal cost] {path}: {out[path]}", flush=True)
    return out


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
        result["goodput"] = ratio(
            result["overload"]["accepted_items_per_s"], float(cap.get("items_per_s", math.nan))
        )
        lost = result["normal"]["lost"] + result["overload"]["lost"]
        result["lost"] = lost
        result["meets_target"] = bool(
            not math.isnan(result["goodput"])
            and result["goodput"] >= args.min_goodput
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
            from carpool.generation.config import GeneratorBatching

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
        + f"\n\ngoodput (accepted items/s overloaded / capacity) = {fmt(p.get('goodput'), 2)}, "
        f"lost = {p['lost']} (target >= 0.9 and 0: {verdict}); accepted p99 overload/normal "
        f"= {fmt(p['p99_ratio'], 2)}\n"
    )


def render(data: dict[str, Any]) -> str:
    parts = [header_md("Overload: normal load vs 3x capacity", data)]
    cost = data.get("refusal_cpu")
    if cost:
        rows = [
            [path, c["refused"], c["refusals_per_s"], c["cpu_ms_per_refusal"], c["latency_p50_ms"]]
            for path, c in cost.items()
            if isinstance(c, dict)
        ]
        parts.append(
            "\n## CPU per refusal (all processes but the load generator, idle CPU subtracted)\n\n"
            + table(["refused at", "refused", "refusals/s", "CPU ms each", "p50 ms"], rows)
        )
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
        if not args.no_refusal_cost:
            out["refusal_cpu"] = await refusal_cpu(gen)
    out["finished_at"] = time.time()
    return out
