"""``python -m carpool_twin.planner``: replica counts and batching knobs for a target, from the twin.

    python -m carpool_twin.planner --config serve-gpu.yaml --profile profiles/gpu-h200.json \\
        --traffic "embed=400,rank=20,generate=30" --slo "p99_ms=500" [--gpus 8] --out plan/

Writes ``plan/overlay.yaml`` (per deployment: ``num_replicas`` and changed ``user_config``),
``plan/serve.planned.yaml`` (the config with the overlay applied), ``plan/plan.json`` and
``plan/plan.md`` (throughput, p50/p99, GPUs and CPUs, cost per million items or tokens at
the stated prices). The search itself is ``carpool_twin.plan``; docs/planning.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from carpool_twin.path import MODES, ServingPath, with_replicas
from carpool_twin.plan import Planner, Slo, apply_overlay, bottlenecks, overlay_of
from carpool_twin.profile import load_profile
from carpool_twin.traffic import parse_traffic


def table(rows: list[dict[str, Any]], price_gpu_h: float, price_cpu_h: float) -> str:
    lines = [
        f"Prices: ${price_gpu_h:g} per GPU-hour, ${price_cpu_h:g} per CPU-hour (stated, not measured).",
        "",
        "| kind | replicas | knobs | throughput | p50 ms | p99 ms | TTFT p99 ms | GPUs | CPUs "
        "| $ per million | SLO |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        knobs = "; ".join(f"{k}: {v}" for k, v in r["knobs"].items() if v) or "as configured"
        lines.append(
            f"| {r['kind']} | {r['replicas']} | {knobs} | {r['throughput']:,} {r['unit']} | "
            f"{r['p50_ms']:,} | {r['p99_ms']:,} | {r['ttft_p99_ms'] or '-'} | {r['gpus']} | "
            f"{r['cpus']} | {r['usd_per_million']} | {'met' if r['slo_met'] else 'MISSED'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m carpool_twin.planner", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", required=True, help="serve config to plan (serve-gpu.yaml)")
    p.add_argument("--profile", required=True, help="cost profile (profiles/*.json)")
    p.add_argument(
        "--traffic",
        required=True,
        help="KIND=RATE,... (embed, rank, generate; requests/s), a YAML/JSON mix, or "
        "trace:PATH.csv[@rate]",
    )
    p.add_argument(
        "--slo", required=True, help="p99_ms=500 or embed.p99_ms=300,generate.ttft_p99_ms=800"
    )
    p.add_argument("--gpus", type=float, help="fit the largest multiple of the traffic in N GPUs")
    p.add_argument("--dtype", help="profile entries of this dtype (e.g. bfloat16)")
    p.add_argument("--threads", type=int, help="CPU profile entries of this thread count")
    p.add_argument("--price-gpu-hour", type=float, default=3.0, help="USD per GPU-hour")
    p.add_argument("--price-cpu-hour", type=float, default=0.04, help="USD per CPU-hour")
    p.add_argument("--duration", type=float, default=30.0, help="simulated seconds per trial")
    p.add_argument("--out", default="plan", help="folder for the overlay, config and table")
    p.add_argument(
        "--path-profile",
        help="the serving path's CPU costs (default: profiles/path-cpu-2core.json)",
    )
    p.add_argument("--ingress", choices=MODES, help="HTTP layer (default: the path profile's)")
    args = p.parse_args(argv)

    profile = load_profile(args.profile)
    traffic = parse_traffic(args.traffic)
    planner = Planner(
        args.config, profile, Slo.parse(args.slo), args.dtype, args.threads, args.duration
    )
    scale = 1.0
    if args.gpus:
        scale, plan = planner.fit_gpus(traffic, args.gpus)
        traffic = traffic.scaled(scale)
    else:
        plan = planner.plan(traffic)
    rows = [c.row(args.price_gpu_hour, args.price_cpu_hour) for c in plan.values()]
    path = ServingPath.load(args.path_profile, args.ingress)
    # The ingress replicas for this load, from the path's measured CPU per request: the
    # planned config runs them (past the head's carpool_ingress, on ingress_cpu nodes).
    ingress = path.size_ingress(planner.config, traffic)
    config = with_replicas(planner.config, ingress)
    overlay = {**overlay_of(plan), **{n: {"num_replicas": r} for n, r in ingress.items()}}
    gpus = sum(c.gpus for c in plan.values())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import yaml

    (out / "overlay.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
    (out / "serve.planned.yaml").write_text(
        yaml.safe_dump(apply_overlay(config, overlay), sort_keys=False)
    )
    doc = {
        "command": " ".join(
            ["python -m carpool_twin.planner", *(argv if argv is not None else sys.argv[1:])]
        ),
        "profile": {"name": profile.get("name"), "hardware": profile.get("hardware")},
        "traffic": {"source": traffic.source, "scale": scale, "rates": traffic.rates()},
        "slo": vars(planner.slo),
        "rows": rows,
        "overlay": overlay,
        "bottlenecks": bottlenecks(traffic, gpus, config, path),
    }
    (out / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = table(rows, args.price_gpu_hour, args.price_cpu_hour)
    (out / "plan.md").write_text(text)
    print(text)
    print(f"traffic x{scale:.3g}: {traffic.rates()}; shared: {doc['bottlenecks']}")
    print(f"wrote {out}/overlay.yaml, serve.planned.yaml, plan.json, plan.md")
    return 0 if all(r["slo_met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
