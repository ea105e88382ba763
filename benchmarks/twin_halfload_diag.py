"""Where does embed latency go under moderate load? A diagnostic for the twin (issue 26).

Deploys the embed app exactly as ``benchmarks.twin_validate measure`` does (one private Ray +
Serve, serve.yaml's embed app, one torch thread), then runs: 1 closed-loop client, 32
closed-loop clients (capacity), and Poisson arrivals at fractions of that capacity. For every
phase it keeps each request's client-side times, the replica's batching stats (passes, items,
mean forward wall time, mean queue wait per item: ``/v1/stats``), the CPU by process, and
Serve's own access logs per hop (proxy, ingress, embedder: each logs its latency per
request). ``compare`` runs the twin on the same arrivals and prints both side by side.

    flock /tmp/carpool-bench.lock .venv/bin/python -m benchmarks.twin_halfload_diag measure \\
        --out benchmarks/results/twin-halfload-diag.json
    .venv/bin/python -m benchmarks.twin_halfload_diag compare \\
        benchmarks/results/twin-halfload-diag.json --profile <profile>

Not part of the validation: nothing here is a validated figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from carpool import local_ray

os.environ.update(local_ray.ray_environment())
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.arrivals import ArrivalSpec
from benchmarks.twin_common import SEED, cpu_snapshot, cpu_used, embed_requests
from benchmarks.workloads import embed_workload
from deployments.embedder import EmbeddingDeployment


class DiagEmbedding(EmbeddingDeployment):
    """The embedder deployment, recording what happens inside the replica (diagnosis only).

    Per pass: its wall time, the CPU time of the thread that ran it, and the whole process's
    CPU time meanwhile; per request: when ``embed`` was entered and left, and the CPU its
    tokenizing took; the event loop's lag, sampled every 10 ms. ``diag_dump`` hands them over
    and starts afresh; ``diag_switch`` sets the interpreter's GIL switch interval.
    """

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self._passes: list[tuple] = []
        self._requests: list[tuple] = []
        self._lags: list[tuple] = []
        self._lag_task: Any = None
        inner = self.executor._forward
        tokenize = self.model.tokenize

        def timed_forward(payloads: list) -> list:
            t0, c0, p0 = time.monotonic(), time.thread_time(), time.process_time()
            out = inner(payloads)
            t1, c1, p1 = time.monotonic(), time.thread_time(), time.process_time()
            lengths = [len(x) for x in payloads]
            self._passes.append(
                (t0, t1, c1 - c0, p1 - p0, len(lengths), max(lengths), sum(lengths))
            )
            return out

        def timed_tokenize(texts: list[str]) -> list[list[int]]:
            t0, c0 = time.monotonic(), time.thread_time()
            out = tokenize(texts)
            self._toks.append((t0, time.monotonic(), time.thread_time() - c0, len(texts)))
            return out

        self.executor._forward = timed_forward
        self.model.tokenize = timed_tokenize  # type: ignore[method-assign]
        self._toks: list[tuple] = []

    async def _lag_loop(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            self._lags.append((t, time.monotonic() - t - 0.01))

    async def embed(self, texts: list[str], truncate: bool = True, controls: Any = None) -> Any:
        if self._lag_task is None:
            self._lag_task = asyncio.get_running_loop().create_task(self._lag_loop())
        t0, p0 = time.monotonic(), time.process_time()
        out = await super().embed(texts, truncate, controls)
        self._requests.append((t0, time.monotonic(), len(texts), time.process_time() - p0))
        return out

    async def diag_dump(self) -> dict[str, Any]:
        out = {
            "passes": self._passes,  # (start, end, thread cpu s, process cpu s, rows, longest, real)
            "requests": self._requests,  # (entered, left, texts, process cpu s meanwhile)
            "lags": self._lags,  # (when, how late a 10 ms sleep woke)
            "toks": self._toks,  # (start, end, thread cpu s, texts)
            "now": time.monotonic(),
            "switch": sys.getswitchinterval(),
        }
        self._passes, self._requests, self._lags, self._toks = [], [], [], []
        return out

    async def diag_switch(self, interval: float) -> float:
        sys.setswitchinterval(interval)
        return sys.getswitchinterval()


# A Serve access log line: "... <request_id> <METHOD|CALL> <route|method> <status> <ms>ms".
ACCESS = re.compile(
    r"^\w+ (\S+ \S+) (\S+) (\S+) (\S+) (?:\S+ )*?(POST|GET|CALL) (\S+) (\S+) ([\d.]+)ms$"
)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def access_logs(session_dir: str) -> list[dict[str, Any]]:
    """Every access log line of Serve's proxy and replicas: component, request id, latency,
    and the wall-clock time the line was written (when the hop answered)."""
    out = []
    for path in sorted(Path(session_dir, "logs", "serve").glob("*.log")):
        name = path.name
        component = (
            "proxy"
            if name.startswith("proxy")
            else "embedder"
            if "embedder" in name
            else "ingress"
            if "ingress" in name
            else None
        )
        if component is None:
            continue
        for line in path.read_text(errors="replace").splitlines():
            m = ACCESS.match(line.strip())
            if not m:
                continue
            stamp, _, _, req_id, _, route, status, ms = m.groups()
            t = time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S"))
            t += int(stamp.split(",")[1]) / 1000
            if component == "proxy" and "/embed" not in route:
                continue
            out.append(
                {
                    "c": component,
                    "id": req_id,
                    "route": route,
                    "status": status,
                    "ms": float(ms),
                    "t": t,
                }
            )
    return out


async def _phase(bench: Any, gen: Any, system: Any, workload: Any, spec: ArrivalSpec) -> dict:
    from benchmarks.runner import replica_delta

    before_stats = await bench.replica_snapshot(system)
    cpu0 = cpu_snapshot()
    wall0 = time.time()
    if spec.kind == "closed":
        result = await gen.run_closed(
            system.target, workload.requests, spec.concurrency, spec.duration_s, "diag"
        )
        times = None
    else:
        times = spec.schedule()
        result = await gen.run_open(system.target, workload.take(len(times)), times, "diag")
    wall1 = time.time()
    cpu = cpu_used(cpu0, cpu_snapshot())
    await bench.quiesce(system)
    after_stats = await bench.replica_snapshot(system)
    recs = [
        {
            "i": r.index,
            "sched": round(r.scheduled, 4),
            "start": round(r.started, 4),
            "end": round(r.finished, 4),
            "status": r.status,
        }
        for r in result.records
    ]
    lat = [1000 * (r["end"] - r["sched"]) for r in recs if r["status"] == 200]
    return {
        "spec": spec.model_dump(),
        "wall": [wall0, wall1],
        "t0_wall": result.started_at,
        "records": recs,
        "arrivals": times,
        "p50_ms": _pct(lat, 50),
        "p99_ms": _pct(lat, 99),
        "mean_ms": statistics.fmean(lat) if lat else float("nan"),
        "ok": len(lat),
        "replica": replica_delta(before_stats, after_stats),
        "stats_before": {k: v for k, v in before_stats.items() if not k.startswith("_")},
        "stats_after": {k: v for k, v in after_stats.items() if not k.startswith("_")},
        "cpu": cpu,
    }


async def _phases(base_url: str, system: Any, workload: Any, args: Any) -> dict:
    from ray import serve

    from benchmarks.loadgen import LoadGenerator
    from benchmarks.runner import Bench

    handle = serve.get_deployment_handle("embedder", app_name="bench-carpool")
    out: dict[str, Any] = {}
    async with LoadGenerator(base_url, 256, 120.0, False) as gen:
        bench = Bench(gen)
        await gen.wait_ready(system.target.ready_path, timeout_s=300)
        await bench.run(system, workload, ArrivalSpec(kind="closed", concurrency=4, duration_s=5))
        await handle.diag_dump.remote()

        async def phase(name: str, spec: ArrivalSpec, switch: float = 0.005) -> None:
            await handle.diag_switch.remote(switch)
            print(f"phase {name} (switch {switch})", file=sys.stderr, flush=True)
            out[name] = await _phase(bench, gen, system, workload, spec)
            out[name]["switch"] = switch
            out[name]["inside"] = await handle.diag_dump.remote()

        await phase(
            "closed_1", ArrivalSpec(kind="closed", concurrency=1, duration_s=args.calibrate_s)
        )
        await phase(
            "closed_32", ArrivalSpec(kind="closed", concurrency=32, duration_s=args.closed_s)
        )
        ok = [r for r in out["closed_32"]["records"] if r["status"] == 200]
        capacity = len(ok) / max(r["end"] for r in ok)
        out["capacity_rps"] = capacity
        rate = args.rate or 0.5 * capacity
        half = ArrivalSpec(kind="poisson", rate=rate, duration_s=args.duration, seed=SEED)
        await phase("open_0.5", half)
        for sw in args.switches:
            await phase(f"open_0.5_switch_{sw:g}", half, sw)
        for factor in args.factors:
            spec = ArrivalSpec(
                kind="poisson", rate=factor * capacity, duration_s=args.duration, seed=SEED
            )
            await phase(f"open_{factor:g}", spec)
    return out


def cmd_measure(args: Any) -> int:
    import ray

    from benchmarks.deploy import SYSTEMS, Resources, ServeCluster, logical_cpus_needed
    from benchmarks.runner import System
    from benchmarks.targets import make_target

    workload = embed_workload(args.requests, SEED)
    spec, resources = SYSTEMS["carpool"], Resources()
    cluster = ServeCluster(args.port, logical_cpus_needed([spec], resources))
    doc: dict[str, Any] = {
        "command": " ".join([".venv/bin/python -m benchmarks.twin_halfload_diag", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_before": list(os.getloadavg()),
        "requests": args.requests,
    }
    import deployments.embedder

    # The embed app as the suite builds it, with the recording subclass as its embedder.
    deployments.embedder.EmbeddingDeployment = DiagEmbedding  # type: ignore[misc]
    cluster.start()
    try:
        session = ray._private.worker._global_node.get_session_dir_path()
        cluster.deploy([spec], resources, {"carpool": {}})
        system = System("carpool", make_target("embed", "carpool", spec.prefix), "bench-carpool")
        doc["phases"] = asyncio.run(_phases(cluster.base_url, system, workload, args))
        time.sleep(2)  # let the replicas flush their access logs
        doc["access"] = access_logs(session)
    finally:
        cluster.shutdown()
    doc["loadavg_after"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc) + "\n")
    print(f"written: {args.out}", file=sys.stderr)
    return 0


# --- compare ---------------------------------------------------------------------------------


def _replica(before: dict, after: dict) -> dict[str, float]:
    """Totals between two cumulative ``/v1/stats`` snapshots (which carry means)."""
    from benchmarks.twin_common import replica_passes

    return replica_passes(before, after)


def _hops(access: list[dict], wall: list[float]) -> dict[str, float]:
    """Mean time per hop of the phase's requests, from Serve's access logs (request ids)."""
    by: dict[str, dict[str, dict]] = {}
    for a in access:
        if a["route"] in ("/embed/v1/embeddings", "embed"):
            by.setdefault(a["id"], {})[a["c"]] = a
    rows = [
        v
        for v in by.values()
        if len(v) == 3 and wall[0] <= v["proxy"]["t"] - v["proxy"]["ms"] / 1000 <= wall[1]
    ]
    if not rows:
        return {}
    return {
        "proxy_to_ingress_ms": statistics.fmean(
            v["proxy"]["ms"] - v["ingress"]["ms"] for v in rows
        ),
        "ingress_to_embedder_ms": statistics.fmean(
            v["ingress"]["ms"] - v["embedder"]["ms"] for v in rows
        ),
        "embedder_ms": statistics.fmean(v["embedder"]["ms"] for v in rows),
    }


def _quantiles(xs: list[float]) -> list[int]:
    return [round(_pct(xs, q)) for q in (10, 25, 50, 75, 90, 99)]


def cmd_compare(args: Any) -> int:
    """The replica's passes against the profile's price, the hops, and the twin (its pass
    scale fitted on the 1-client phase, as ``twin_validate report`` fits it) per phase."""
    from benchmarks.twin_report import _mean_ms, embed_spec
    from carpool_twin.calibrate import serving_pass_scale
    from carpool_twin.profile import load_profile
    from carpool_twin.replicas import PointsCurve
    from carpool_twin.sim import Overheads

    doc = json.loads(Path(args.measured).read_text())
    profile = load_profile(args.profile)
    entry = next(m for m in profile["models"] if m["role"] == "embedder")
    price = PointsCurve(entry["pass"]["points"])
    reqs = embed_requests(embed_workload(doc["requests"], SEED))
    ph = {k: v for k, v in doc["phases"].items() if isinstance(v, dict)}
    c1 = ph["closed_1"]
    forward = _replica(c1["stats_before"], c1["stats_after"])["forward_ms"]
    scale = serving_pass_scale(embed_spec(profile, {}), "embedder", reqs, c1["ok"], forward)
    overheads = Overheads()
    span = max(r["end"] for r in c1["records"])
    bare = embed_spec(profile, {}, overheads, scale).build()
    overheads.fixed_ms = c1["mean_ms"] - _mean_ms(
        bare.run(clients=1, requests=reqs, duration_s=span, warmup_s=0)
    )
    print(f"pass scale {scale:.3f} (1-client phase), fixed_ms {overheads.fixed_ms:.1f}")
    for name, p in ph.items():
        cpu = p["cpu"]
        print(
            f"== {name}: ok {p['ok']} p50 {p['p50_ms']:.0f} p99 {p['p99_ms']:.0f} "
            f"mean {p['mean_ms']:.0f}; other processes {cpu['machine_s'] - cpu['ours_s']:.1f} "
            f"cpu-s, steal {cpu['steal_s']} s over {cpu['wall_s']} s"
        )
        hops = _hops(doc["access"], p["wall"])
        if hops:
            print("   hops (Serve access logs):", {k: round(v, 1) for k, v in hops.items()})
        passes = (p.get("inside") or {}).get("passes") or []
        if passes:
            wall = sum(x[1] - x[0] for x in passes) * 1000
            thread = sum(x[2] for x in passes) * 1000
            priced = sum(price({"padded_tokens": x[4] * x[5]}) for x in passes)
            print(
                f"   {len(passes)} passes, {sum(x[4] for x in passes) / len(passes):.2f} items "
                f"each: wall {wall / priced:.3f}x the profile's price, the pass thread's CPU "
                f"{thread / priced:.3f}x (CPU / wall {thread / wall:.3f})"
            )
        if p.get("arrivals"):
            twin = embed_spec(profile, {}, overheads, scale).build()
            arrivals = [(t, reqs[i % len(reqs)]) for i, t in enumerate(p["arrivals"])]
            twin.run(arrivals=arrivals, warmup_s=0)
            lat = [1000 * (r["end"] - r["sched"]) for r in p["records"] if r["status"] == 200]
            sim = [1000 * (r.ended - r.sent) for r in twin.records if r.ended is not None]
            print(
                f"   latency q10/25/50/75/90/99 measured {_quantiles(lat)} twin {_quantiles(sim)}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.twin_halfload_diag", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", default="benchmarks/results/twin-halfload-diag.json")
    m.add_argument("--requests", type=int, default=2000)
    m.add_argument("--calibrate-s", type=float, default=10.0)
    m.add_argument("--closed-s", type=float, default=20.0)
    m.add_argument("--duration", type=float, default=30.0)
    m.add_argument(
        "--factors", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.25]
    )
    m.add_argument(
        "--switches", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.0005]
    )
    m.add_argument("--rate", type=float, default=None, help="absolute rate for the 0.5 phase")
    m.add_argument("--port", type=int, default=8171)
    c = sub.add_parser("compare")
    c.add_argument("measured")
    c.add_argument("--profile", default="benchmarks/results/twin-profile-cpu-run4-before.json")
    args = p.parse_args(argv)
    return cmd_measure(args) if args.command == "measure" else cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main())
