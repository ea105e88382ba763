"""``python -m benchmarks.twin_validate``: the twin's predictions beside the harness's measurements.

Two steps, so the measurement (minutes, under the benchmark lock) and the report (seconds)
can be redone apart:

    flock /tmp/carpool-bench.lock .venv/bin/python -m benchmarks.twin_validate measure \\
        --out benchmarks/results/twin-validate.json
    .venv/bin/python -m benchmarks.twin_validate report benchmarks/results/twin-validate.json

``measure`` runs, for each embed configuration (serve.yaml's embed app as the suite deploys it:
one torch thread, ``thread_policy: reserved``; knobs overridden per configuration), on one
private Ray + Serve: a calibration run (1 closed-loop client: the serving latency outside the
model), 32 closed-loop clients (capacity), Poisson at half of that capacity (latency) and at 3x
(goodput); and, for generation, ``benchmarks.generation_compare`` (carpool's continuous engine
in process, greedy, ``ignore_eos``) at 4, 16 and 64 clients. ``report`` runs the twin on the very
same requests and arrival times with a cost profile, and writes ``benchmarks/TWIN.md`` and
``benchmarks/twin.json`` (every figure, its error, the median and largest absolute error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.arrivals import ArrivalSpec
from benchmarks.workloads import EmbedRequest, Workload, embed_workload
from carpool.twin.profile import load_profile
from carpool.twin.replicas import SimRequest
from carpool.twin.sim import Overheads, SimResult
from carpool.twin.topology import TwinSpec

ROOT = Path(__file__).resolve().parent.parent
# The embed configurations validated: serve.yaml's knobs, then changes the twin was not fitted on.
EMBED_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "max_batch_tokens_1024": {"max_batch_tokens": 1024},
    "max_batch_size_8": {"max_batch_size": 8},
    "greedy": {"split_policy": "greedy"},
}
GEN_CLIENTS = (4, 16, 64)
GEN_KNOBS = {"max_num_seqs": 64, "max_batch_tokens": 512}  # serve.yaml's small generator
MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length: longer texts are truncated to it
SEED = 0


# --- requests, as the twin sees them --------------------------------------------------------


def embed_requests(workload: Workload) -> list[SimRequest]:
    """Token lengths of each text: the workload's words + [CLS]/[SEP] (exact for WordPiece)."""
    out = []
    for r in workload.requests:
        assert isinstance(r, EmbedRequest)
        out.append(
            SimRequest("embed", lengths=tuple(min(MAX_LENGTH, len(t.split()) + 2) for t in r.texts))
        )
    return out


def gen_requests(prompt_tokens: list[int], max_tokens: list[int]) -> list[SimRequest]:
    return [
        SimRequest("generate", prompt_tokens=p, max_tokens=m, output_tokens=m, model="small")
        for p, m in zip(prompt_tokens, max_tokens, strict=True)
    ]


# --- measuring ------------------------------------------------------------------------------


def _summary(run: Any) -> dict[str, Any]:
    s = run.summary
    return {
        "items_per_s": s["items_per_s"],
        "requests_per_s": s["requests_per_s"],
        "p50_ms": s["latency_ms"]["p50"],
        "p99_ms": s["latency_ms"]["p99"],
        "mean_ms": s["mean_latency_ms"],
        "ok": s["ok"],
        "rejected": s["rejected"],
        "sent": s["sent"],
        "span_s": s["span_s"],
        "loadavg": list(run.loadavg),
    }


async def _embed_phases(base_url: str, system: Any, workload: Workload, args: Any) -> dict:
    from benchmarks.loadgen import LoadGenerator
    from benchmarks.runner import Bench

    out: dict[str, Any] = {}
    async with LoadGenerator(base_url, 256, 120.0, False) as gen:
        bench = Bench(gen)
        await gen.wait_ready(system.target.ready_path, timeout_s=300)
        warm = ArrivalSpec(kind="closed", concurrency=4, duration_s=5)
        await bench.run(system, workload, warm)
        calib = ArrivalSpec(kind="closed", concurrency=1, duration_s=args.calibrate_s)
        out["closed_1"] = _summary(await bench.run(system, workload, calib))
        closed = ArrivalSpec(kind="closed", concurrency=32, duration_s=args.duration)
        out["closed_32"] = _summary(await bench.run(system, workload, closed))
        capacity = out["closed_32"]["requests_per_s"]
        for name, factor, duration in (
            ("half", 0.5, args.duration),
            ("open_3x", 3.0, 300 / (3 * capacity)),  # the suite's window: 300 requests
        ):
            spec = ArrivalSpec(
                kind="poisson", rate=factor * capacity, duration_s=duration, seed=SEED
            )
            out[name] = _summary(await bench.run(system, workload, spec))
            out[name]["rate"] = factor * capacity
            out[name]["arrivals"] = spec.schedule()
    return out


def measure_embed(args: Any) -> dict[str, Any]:
    from benchmarks.deploy import SYSTEMS, Resources, ServeCluster, logical_cpus_needed
    from benchmarks.runner import System
    from benchmarks.targets import make_target

    workload = embed_workload(args.requests, SEED)
    spec, resources = SYSTEMS["carpool"], Resources()
    cluster = ServeCluster(args.port, logical_cpus_needed([spec], resources))
    results: dict[str, Any] = {"resources": resources.model_dump()}
    cluster.start()
    try:
        for name in args.configs:
            knobs = EMBED_CONFIGS[name]
            print(f"embed {name}: deploying {knobs}", file=sys.stderr, flush=True)
            cluster.deploy([spec], resources, {"carpool": knobs})
            system = System(
                "carpool", make_target("embed", "carpool", spec.prefix), "bench-carpool"
            )
            started = time.time()
            try:
                results[name] = {
                    "knobs": knobs,
                    **asyncio.run(_embed_phases(cluster.base_url, system, workload, args)),
                }
            except Exception as exc:  # one configuration's failure must not lose the others
                results[name] = {"knobs": knobs, "error": repr(exc)}
            print(f"embed {name}: {time.time() - started:.0f} s", file=sys.stderr, flush=True)
            _save(args.out + ".partial", {"embed": results})
    finally:
        cluster.shutdown()
    return results


def _save(path: str, doc: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def prompt_tokens(model: str) -> list[int]:
    """Tokens of each of generation_compare's prompts, as its server feeds them."""
    from transformers import AutoTokenizer

    from benchmarks.generation_compare import PROMPTS
    from carpool.models import resolve_model_source

    tok = AutoTokenizer.from_pretrained(resolve_model_source(model))
    return [len(tok(p)["input_ids"]) for p in PROMPTS]


def measure_generation(args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"knobs": GEN_KNOBS, "model": args.gen_model}
    out["prompt_tokens"] = prompt_tokens(args.gen_model)
    for clients in args.gen_clients:
        requests = min(64, max(16, 2 * clients))  # two waves where it fits in a minute
        path = Path(args.out).with_suffix(f".gen{clients}.json")
        cmd = [
            sys.executable, "-m", "benchmarks.generation_compare", "--modes", "continuous",
            "--model", args.gen_model, "--requests", str(requests), "--concurrency", str(clients),
            "--max-num-seqs", str(GEN_KNOBS["max_num_seqs"]),
            "--max-batch-tokens", str(GEN_KNOBS["max_batch_tokens"]),
            "--threads", "1", "--seed", str(SEED), "--out", str(path),
        ]  # fmt: skip
        print("generation:", " ".join(cmd), file=sys.stderr, flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            out[str(clients)] = {"error": "generation_compare failed; see its output"}
            continue
        report = json.loads(path.read_text())
        result = report["results"]["continuous"] if "results" in report else report
        out[str(clients)] = {"requests": requests, **result}
    return out


def cmd_measure(args: Any) -> int:
    results: dict[str, Any] = {
        "command": " ".join([".venv/bin/python -m benchmarks.twin_validate", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_before": list(os.getloadavg()),
        "requests": args.requests,
    }
    if args.configs:
        results["embed"] = measure_embed(args)
    if args.gen_clients:
        results["generation"] = measure_generation(args)
    results["loadavg_after"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"measured: {args.out}", file=sys.stderr)
    return 0


# --- predicting -----------------------------------------------------------------------------


def embed_spec(profile: dict, knobs: dict[str, Any], fixed_ms: float = 0.0) -> TwinSpec:
    overlay = {"embedder": {"user_config": knobs}} if knobs else {}
    spec = TwinSpec.from_serve_config(
        ROOT / "serve.yaml", profile, overlay, threads=1, roles=("embedder",)
    )
    spec.overheads = Overheads(fixed_ms=fixed_ms)
    return spec


def predict_embed(profile: dict, measured: dict, requests: int) -> dict[str, Any]:
    """The twin on each configuration's requests and arrivals; the serving latency outside the
    model (``fixed_ms``) is the one number fitted, on the default's 1-client calibration run."""
    reqs = embed_requests(embed_workload(requests, SEED))
    base = measured["default"]
    bare = (
        embed_spec(profile, {})
        .build()
        .run(clients=1, requests=reqs, duration_s=base["closed_1"]["span_s"], warmup_s=0)
    )
    fixed_ms = max(0.0, base["closed_1"]["mean_ms"] - _mean_ms(bare))
    out: dict[str, Any] = {"fixed_ms": round(fixed_ms, 2)}
    for name, m in measured.items():
        if not isinstance(m, dict) or "closed_32" not in m or "half" not in m:
            continue
        spec = embed_spec(profile, m["knobs"], fixed_ms)
        twin: dict[str, SimResult] = {
            "closed_32": spec.build().run(
                clients=32, requests=reqs, duration_s=m["closed_32"]["span_s"], warmup_s=0
            )
        }
        for phase in ("half", "open_3x"):
            times = m[phase]["arrivals"]
            arrivals = [(t, reqs[i % len(reqs)]) for i, t in enumerate(times)]
            twin[phase] = spec.build().run(arrivals=arrivals, warmup_s=0)
        out[name] = {k: v.as_dict() for k, v in twin.items()}
    return out


def _mean_ms(result: SimResult) -> float:
    # A 1-client closed loop: mean latency = window / answered.
    return 1000 * result.window_s / max(result.answered, 1)


def predict_generation(profile: dict, measured: dict) -> dict[str, Any]:
    from benchmarks.generation_compare import PROMPTS, workload

    spec = TwinSpec.from_serve_config(
        ROOT / "serve.yaml", profile, {"small": {"user_config": GEN_KNOBS}}, threads=1,
        roles=("small",),
    )  # fmt: skip
    spec.pools["small"].mode = "continuous"
    out: dict[str, Any] = {}
    for key, m in measured.items():
        if not key.isdigit() or "tokens_per_s" not in m:
            continue
        clients = int(key)
        calls = workload(m["requests"], 8, 256, SEED)
        prompts = [measured["prompt_tokens"][i % len(PROMPTS)] for i in range(len(calls))]
        reqs = gen_requests(prompts, [c["max_tokens"] for c in calls])
        r = spec.build().run(clients=clients, requests=reqs, max_requests=len(reqs), warmup_s=0,
                             duration_s=math.inf)  # fmt: skip
        out[key] = r.as_dict()
    return out


# --- the report -----------------------------------------------------------------------------


def figures(measured: dict, predicted: dict) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(config: str, figure: str, m: float, t: float) -> None:
        err = (t - m) / m if m else math.nan
        rows.append({"config": config, "figure": figure, "measured": round(m, 2),
                     "twin": round(t, 2), "error": round(err, 4)})  # fmt: skip

    for name, m in (measured.get("embed") or {}).items():
        t = predicted.get("embed", {}).get(name)
        if not t or not isinstance(m, dict) or "open_3x" not in m:
            continue
        add(name, "closed-32 items/s", m["closed_32"]["items_per_s"], t["closed_32"]["items_per_s"])
        add(name, "closed-32 p50 ms", m["closed_32"]["p50_ms"], t["closed_32"]["p50_ms"])
        add(name, "half-capacity p50 ms", m["half"]["p50_ms"], t["half"]["p50_ms"])
        add(name, "half-capacity p99 ms", m["half"]["p99_ms"], t["half"]["p99_ms"])
        add(name, "3x goodput items/s", m["open_3x"]["items_per_s"], t["open_3x"]["items_per_s"])
    gen = measured.get("generation") or {}
    for key, t in (predicted.get("generation") or {}).items():
        m = gen[key]
        add(f"continuous, {key} clients", "tokens/s", m["tokens_per_s"], t["tokens_per_s"])
        add(f"continuous, {key} clients", "TTFT p50 ms", 1000 * m["ttft_p50_s"], t["ttft_p50_ms"])
    return rows


def cmd_report(args: Any) -> int:
    measured = json.loads(Path(args.measured).read_text())
    profile = load_profile(args.profile)
    predicted: dict[str, Any] = {}
    if measured.get("embed"):
        predicted["embed"] = predict_embed(profile, measured["embed"], measured["requests"])
    if measured.get("generation"):
        predicted["generation"] = predict_generation(profile, measured["generation"])
    rows = figures(measured, predicted)
    errors = [abs(r["error"]) for r in rows if not math.isnan(r["error"])]
    doc = {
        "median_abs_error": round(statistics.median(errors), 4) if errors else None,
        "max_abs_error": round(max(errors), 4) if errors else None,
        "figures": rows,
        "profile": args.profile,
        "measured": args.measured,
        "measure_command": measured.get("command"),
        "report_command": " ".join([".venv/bin/python -m benchmarks.twin_validate", *sys.argv[1:]]),
        "fitted": {"embed_fixed_ms": predicted.get("embed", {}).get("fixed_ms")},
        "predicted": predicted,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    Path(args.md).write_text(markdown(doc, measured))
    print(Path(args.md).read_text())
    return 0


def markdown(doc: dict, measured: dict) -> str:
    lines = [
        "# The twin against the harness",
        "",
        f"Measured: `{doc['measure_command']}` (started {measured.get('started')}, load average "
        f"{measured.get('loadavg_before')} before, {measured.get('loadavg_after')} after).",
        f"Predicted: `{doc['report_command']}` with the cost profile `{doc['profile']}`.",
        "",
        f"**Median absolute error {100 * (doc['median_abs_error'] or 0):.1f}%, largest "
        f"{100 * (doc['max_abs_error'] or 0):.1f}%** over {len(doc['figures'])} figures.",
        "",
        "| configuration | figure | measured | twin | error |",
        "|---|---|---|---|---|",
    ]
    for r in doc["figures"]:
        lines.append(
            f"| {r['config']} | {r['figure']} | {r['measured']:,.1f} | {r['twin']:,.1f} | "
            f"{100 * r['error']:+.1f}% |"
        )
    lines += ["", "The one fitted number: the serving latency outside the model "
              f"(`fixed_ms` = {doc['fitted']['embed_fixed_ms']} ms per embed request, proxy + "
              "ingress + hops), from the default configuration's 1-client calibration run, "
              "which is not among the figures above. Everything else comes from the profile."]  # fmt: skip
    lines += [
        "",
        "Scope, stated: the embed figures go through HTTP, Serve's proxy and the embed "
        "ingress, as the suite deploys serve.yaml's embed app (one torch thread, "
        "`thread_policy: reserved`); the twin prices the embedder's passes through the "
        "profile's measured points. "
        + (
            "Generation is validated against carpool's **continuous** engine in process "
            "(`benchmarks.generation_compare`: no HTTP, greedy, `ignore_eos`, `max_num_seqs` "
            "64, `max_batch_tokens` 512, one thread), not against serve.yaml's `mode: vllm` "
            "small model, whose step costs no profile holds"
            if any(r["figure"] == "tokens/s" for r in doc["figures"])
            else "Generation was **not measured** in this run (no figure above)"
        )
        + "; the conversation trace "
        "was not validated (no time under the benchmark lock). A configuration with an "
        "`error` in the measurement file is left out of the table.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.twin_validate", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="the harness's figures (run under the benchmark lock)")
    m.add_argument("--out", default="benchmarks/results/twin-validate.json")
    m.add_argument("--configs", type=lambda s: [x for x in s.split(",") if x],
                   default=list(EMBED_CONFIGS), help=f"embed configs: {list(EMBED_CONFIGS)}")  # fmt: skip
    m.add_argument("--gen-clients", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=list(GEN_CLIENTS))  # fmt: skip
    m.add_argument("--gen-model", default="packaged:SmolLM2-135M-Instruct")
    m.add_argument("--requests", type=int, default=2000)
    m.add_argument("--duration", type=float, default=40.0)
    m.add_argument("--calibrate-s", type=float, default=15.0)
    m.add_argument("--port", type=int, default=8163)
    r = sub.add_parser("report", help="the twin beside a measurement: TWIN.md and twin.json")
    r.add_argument("measured")
    r.add_argument("--profile", default="profiles/cpu-2core.json")
    r.add_argument("--md", default="benchmarks/TWIN.md")
    r.add_argument("--json", default="benchmarks/twin.json")
    args = p.parse_args(argv)
    return cmd_measure(args) if args.command == "measure" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
