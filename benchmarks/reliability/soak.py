"""``soak``: hold a fraction of capacity on a mix of apps for minutes; watch errors, latency, RSS.

Load: Poisson on /embed, /rank, /search and a trickle of /generate, each at ``--load`` x its
share x its measured capacity (or ``--rates``). Every ``--window`` seconds: errors by status
and p50/p99 per app; every ``--sample`` seconds: RSS of each Serve replica, the proxy, the
controller, raylet and GCS (pids from the processes' titles, re-read at every sample so a
restarted replica is seen). Reports drift (last window vs first) and memory growth per process
after ``--warmup`` seconds (MB, MB/min, least-squares slope, flat or not).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from benchmarks.loadgen import LoadGenerator, LoadResult
from benchmarks.reliability.analysis import (
    drift,
    is_lost,
    latency_ms,
    memory_growth,
    status_histogram,
    windows,
)
from benchmarks.reliability.cluster import Cluster, rss_mb
from benchmarks.reliability.common import (
    SOAK_SHARES,
    fmt,
    header_md,
    shares_rates,
    statuses_text,
    table,
)
from benchmarks.reliability.faults import measure_capacities
from benchmarks.reliability.load import endpoint


async def monitor(
    cluster: Cluster,
    run: LoadResult,
    names: list[str],
    duration_s: float,
    window_s: float,
    sample_s: float,
    memory: dict[str, list[tuple[float, float]]],
    pids_seen: dict[str, list[int]],
) -> None:
    """Samples RSS every ``sample_s`` and prints each window once its answers are in."""
    next_window = window_s
    while run.t0 == 0.0:
        await asyncio.sleep(0.05)
    while True:
        now = run.now()
        pids = await asyncio.to_thread(cluster.processes)
        for key, pid in pids.items():
            seen = pids_seen.setdefault(key, [])
            if pid not in seen:
                seen.append(pid)
        for key, mb in (await asyncio.to_thread(rss_mb, pids)).items():
            memory.setdefault(key, []).append((now, mb))
        while now >= next_window + 2.0 and next_window <= duration_s + 1e-6:
            start = next_window - window_s
            line = [f"t={start:5.0f}-{next_window:<5.0f}s"]
            for n in names:
                recs = [r for r in run.records if r.target == n]
                (w,) = windows(recs, window_s, start, next_window)
                line.append(
                    f"{n}: {w.ok}/{w.sent} ok p50 {fmt(w.p50_ms, 0)} p99 {fmt(w.p99_ms, 0)} ms"
                    + (f" [{statuses_text(w.statuses)}]" if w.ok != w.sent else "")
                )
            procs = memory_line(memory)
            print(" | ".join(line) + f" | rss MB {procs}", flush=True)
            next_window += window_s
        if now > duration_s + 5 and next_window > duration_s:
            return
        await asyncio.sleep(max(0.1, sample_s - (run.now() - now)))


def memory_line(memory: dict[str, list[tuple[float, float]]]) -> str:
    keys = ("embed/embedder", "rank/ranker", "search/retriever", "generate/small", "proxy")
    return " ".join(f"{k.split('/')[-1]}={memory[k][-1][1]:.0f}" for k in keys if k in memory)


async def main(args: Any, cluster: Cluster) -> dict[str, Any]:
    deployed = {a["name"] for a in cluster.config.get("applications", [])}
    names = [n for n in SOAK_SHARES if cluster.external or n in deployed]
    eps = {n: endpoint(n, max_tokens=args.max_tokens) for n in names}
    out: dict[str, Any] = {
        "duration_s": args.duration,
        "load": args.load,
        "window_s": args.window,
        "sample_s": args.sample,
        "warmup_s": args.warmup,
    }
    async with LoadGenerator(cluster.url, timeout_s=args.timeout, progress=False) as gen:
        for n in names:
            await gen.wait_ready(f"/{n}/healthz")
        if args.rates:
            rates = {n: float(args.rates.get(n, 0.0)) for n in names}
            caps: dict[str, Any] = {}
        else:
            given = args.capacity or {}
            caps = await measure_capacities(
                gen,
                {n: e for n, e in eps.items() if n not in given},
                args.cap_concurrency,
                args.cap_duration,
            )
            caps.update({n: {"endpoint": n, "rps": v, "given": True} for n, v in given.items()})
            shares = {n: SOAK_SHARES[n] for n in names}
            total = sum(shares.values())
            shares = {n: v / total for n, v in shares.items()}  # the machine is theirs alone
            rates = shares_rates(shares, {n: c["rps"] for n, c in caps.items()}, args.load)
        out.update(capacities=caps, rates=rates)
        print("soak rates: " + ", ".join(f"{k} {v:.2f}/s" for k, v in rates.items()), flush=True)
        run = LoadResult()
        memory: dict[str, list[tuple[float, float]]] = {}
        pids_seen: dict[str, list[int]] = {}
        plan = [(eps[n], rates[n]) for n in names if rates.get(n, 0) > 0]
        watch = asyncio.create_task(
            monitor(cluster, run, names, args.duration, args.window, args.sample, memory, pids_seen)
        )
        await gen.run_open_mixed(plan, args.duration, seed=11, run=run)
        await watch
    out.update(analyse(run, names, args, memory, pids_seen))
    out["finished_at"] = time.time()
    return out


def analyse(
    run: LoadResult,
    names: list[str],
    args: Any,
    memory: dict[str, list[tuple[float, float]]],
    pids_seen: dict[str, list[int]],
) -> dict[str, Any]:
    per_app: dict[str, Any] = {}
    for n in names:
        recs = [r for r in run.records if r.target == n]
        if not recs:
            continue
        wins = windows(recs, args.window, 0.0, args.duration)
        ok = [r for r in recs if r.ok]
        per_app[n] = {
            "sent": len(recs),
            "ok": len(ok),
            "errors": len(recs) - len(ok),
            "lost": sum(1 for r in recs if is_lost(r)),
            "statuses": status_histogram(recs),
            "latency_ms": latency_ms(ok),
            "achieved_rps": len(ok) / args.duration,
            "drift": drift(wins[0], wins[-1]) if len(wins) > 1 else {},
            "drift_after_warmup": drift(*_first_last_after(wins, args.warmup))
            if len(wins) > 2
            else {},
            "windows": [w.to_dict() for w in wins],
        }
    mem = {
        k: {**memory_growth(v, args.warmup), "pids": pids_seen.get(k, [])}
        for k, v in sorted(memory.items())
    }
    return {
        "apps": per_app,
        "memory": mem,
        "memory_samples": {
            k: [(round(t, 1), round(m, 1)) for t, m in v] for k, v in memory.items()
        },
        "lost_total": sum(a["lost"] for a in per_app.values()),
    }


def _first_last_after(wins: list[Any], warmup_s: float) -> tuple[Any, Any]:
    kept = [w for w in wins if w.start >= warmup_s] or wins
    return kept[0], kept[-1]


def render(data: dict[str, Any]) -> str:
    rates = ", ".join(f"{k} {v:.2f} req/s" for k, v in data["rates"].items())
    parts = [
        header_md("Soak: steady mixed load", data),
        f"\nHeld for {data['duration_s']:g} s at {data['load']:.0%} of capacity: {rates}. "
        f"Windows of {data['window_s']:g} s; RSS sampled every {data['sample_s']:g} s, growth "
        f"measured after {data['warmup_s']:g} s of warm-up.\n",
        "### Requests\n",
        table(
            [
                "app",
                "sent",
                "ok",
                "errors",
                "lost",
                "statuses",
                "p50 ms",
                "p99 ms",
                "p50 first->last",
                "p99 first->last",
                "p99 last/first",
            ],
            [
                [
                    n,
                    a["sent"],
                    a["ok"],
                    a["errors"],
                    a["lost"],
                    statuses_text(a["statuses"]),
                    a["latency_ms"]["p50"],
                    a["latency_ms"]["p99"],
                    f"{fmt(a['drift'].get('p50_first_ms'), 0)} -> {fmt(a['drift'].get('p50_last_ms'), 0)}",
                    f"{fmt(a['drift'].get('p99_first_ms'), 0)} -> {fmt(a['drift'].get('p99_last_ms'), 0)}",
                    fmt(a["drift"].get("p99_ratio"), 2),
                ]
                for n, a in data["apps"].items()
            ],
        ),
        "\n### Memory (RSS)\n",
        table(
            [
                "process",
                "first MB",
                "last MB",
                "max MB",
                "growth MB",
                "MB/min",
                "slope MB/min",
                "flat",
                "pids",
            ],
            [
                [
                    k,
                    m.get("first_mb"),
                    m.get("last_mb"),
                    m.get("max_mb"),
                    m.get("growth_mb"),
                    _f2(m.get("growth_mb_per_min")),
                    _f2(m.get("slope_mb_per_min")),
                    m.get("flat"),
                    ",".join(str(p) for p in m["pids"]),
                ]
                for k, m in data["memory"].items()
            ],
        ),
        "\n### Windows\n",
    ]
    names = list(data["apps"])
    count = max(len(a["windows"]) for a in data["apps"].values())
    rows = []
    for i in range(count):
        row: list[Any] = []
        for n in names:
            w = data["apps"][n]["windows"][i]
            if not row:
                row.append(f"{w['start_s']:.0f}-{w['end_s']:.0f}")
            row.append(f"{w['ok']}/{w['sent']} {fmt(w['p50_ms'], 0)}/{fmt(w['p99_ms'], 0)}")
        rows.append(row)
    parts.append(table(["t s", *[f"{n} ok/sent p50/p99 ms" for n in names]], rows))
    return "\n".join(parts) + "\n"


def _f2(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"
