"""``python -m carpool.twin.project``: a traffic mix projected onto clusters of N GPUs.

For each N: the largest multiple of the mix whose plan (``carpool.twin.plan``) meets the SLO
within N GPUs; the same for what every request shares, against documented ceilings (the
HTTP proxies, one per node with ``proxy_location: EveryNode`` plus the head, about 250
requests/s each; the router's replicas forwarding ``auto`` requests through handles, about
450/s each; both measured on this project's 2-core machines, PLATFORM.md); the binding one
is the bottleneck. The mix is then run at that multiple through one whole-cluster twin, every
kind together behind the proxies, for the goodput and p99 the table shows.

    python -m carpool.twin.project --config serve-gpu.yaml --profile profiles/gpu-h200.json \\
        --dtype bfloat16 --traffic "embed=3,rank=1,generate=1" --slo p99_ms=500 --gpus 8,16,64
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from typing import Any

from carpool.twin.plan import HANDLE_RPS, PROXY_RPS, Choice, Planner, Slo, overlay_of
from carpool.twin.profile import load_profile
from carpool.twin.sim import Overheads
from carpool.twin.topology import TwinSpec
from carpool.twin.traffic import Traffic, parse_traffic


def _router_replicas(config: Mapping[str, Any]) -> int:
    for app in config.get("applications") or []:
        router = (app.get("args") or {}).get("router")
        if isinstance(router, dict):
            return int(router.get("num_replicas", 2))
    return 0


def project(
    planner: Planner,
    traffic: Traffic,
    gpus: float,
    gpus_per_node: int,
    duration_s: float,
    full_search: bool = False,
) -> dict[str, Any]:
    rates = traffic.rates()
    proxies = math.ceil(gpus / gpus_per_node) + 1
    shared = {"HTTP proxy": proxies * PROXY_RPS / sum(rates.values())}
    routers = _router_replicas(planner.config)
    if rates.get("generate") and routers:
        shared["router"] = routers * HANDLE_RPS / rates["generate"]
    # The models' bound is searched only up to the lowest shared bound: past it the shared
    # one binds whatever the GPUs could do, and the search there is what never finished.
    cap = min(shared.values(), default=None)
    gpu_scale, plan = planner.fit_gpus(traffic, gpus, cap=None if full_search else cap)
    capped = cap is not None and not full_search and gpu_scale >= cap
    bounds = {"GPUs (models)": gpu_scale, **shared}
    bottleneck = min(shared, key=shared.__getitem__) if capped else min(bounds, key=bounds.get)
    scale = bounds[bottleneck]
    if bottleneck != "GPUs (models)":
        plan = planner.plan(traffic.scaled(scale))  # fewer GPUs suffice at the lower rate
    busiest = _busiest(plan)
    result = whole_cluster(planner, plan, traffic.scaled(scale), proxies, duration_s)
    return {
        "gpus": gpus,
        "scale": round(scale, 3),
        "rates": {k: round(v * scale, 1) for k, v in rates.items()},
        "bounds": {k: round(v, 3) for k, v in bounds.items()},
        # True: the models' bound was not searched past the shared one (it is at least that).
        "gpu_bound_capped": capped,
        "bottleneck": bottleneck,
        "busiest_model": busiest,
        "gpus_used": round(sum(c.gpus for c in plan.values()), 3),
        "replicas": {r: n for c in plan.values() for r, n in c.replicas.items()},
        "overlay": overlay_of(plan),
        "proxies": proxies,
        "per_kind": result,
    }


def _busiest(plan: Mapping[str, Choice]) -> str:
    """The model whose replicas were busiest in its plan (the next to saturate)."""
    best, value = "", -1.0
    for choice in plan.values():
        for name, util in choice.result.utilisation.items():
            if util > value:
                best, value = name.rsplit("-", 1)[0], util
    return f"{best} ({value:.0%} busy)" if best else "-"


def whole_cluster(
    planner: Planner,
    plan: Mapping[str, Choice],
    traffic: Traffic,
    proxies: int,
    duration_s: float,
) -> dict[str, Any]:
    """Every kind at once through the proxies, at the planned replicas and knobs."""
    spec = TwinSpec.from_serve_config(
        planner.config, planner.profile, overlay_of(plan), planner.dtype, planner.threads
    )
    spec.overheads = Overheads(proxy_rps=PROXY_RPS, proxies=proxies)
    total = sum(traffic.rates().values())
    duration = max(5.0, min(duration_s, 20_000 / max(total, 1e-9)))
    arrivals = sorted(
        (a for per_kind in traffic.arrivals(duration).values() for a in per_kind),
        key=lambda a: a[0],
    )
    twin = spec.build()
    twin.run(arrivals=arrivals, warmup_s=min(2.0, duration / 5))
    out: dict[str, Any] = {}
    for kind in traffic.rates():
        r = twin.summary(kind, min(2.0, duration / 5))
        out[kind] = {
            "goodput": round(r.tokens_per_s if kind == "generate" else r.items_per_s, 1),
            "unit": "tokens/s" if kind == "generate" else "items/s",
            "p50_ms": round(r.p50_ms, 1),
            "p99_ms": round(r.p99_ms, 1),
            "ttft_p99_ms": None if math.isnan(r.ttft_p99_ms) else round(r.ttft_p99_ms, 1),
            "refused": r.refused,
        }
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| GPUs | requests/s (embed / rank / generate) | replicas | GPUs used | goodput | p99 ms "
        "| bottleneck (x mix at each bound) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rates = " / ".join(f"{v:,.0f}" for v in row["rates"].values())
        reps = ", ".join(f"{k} {v}" for k, v in row["replicas"].items())
        good = "; ".join(f"{k} {v['goodput']:,} {v['unit']}" for k, v in row["per_kind"].items())
        p99 = "; ".join(
            f"{k} {v['p99_ms']:,}" + (f" (TTFT {v['ttft_p99_ms']:,})" if v["ttft_p99_ms"] else "")
            for k, v in row["per_kind"].items()
        )
        bounds = ", ".join(
            f"{k} {'≥ ' if k == 'GPUs (models)' and row.get('gpu_bound_capped') else ''}{v:,.0f}"
            for k, v in row["bounds"].items()
        )
        lines.append(
            f"| {row['gpus']:g} | {rates} | {reps} | {row['gpus_used']} | {good} | {p99} | "
            f"**{row['bottleneck']}** ({bounds}); busiest model: {row['busiest_model']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m carpool.twin.project", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--profile", required=True)
    p.add_argument("--dtype")
    p.add_argument("--traffic", required=True, help="as python -m carpool.plan --traffic")
    p.add_argument("--slo", required=True, help="as python -m carpool.plan --slo")
    p.add_argument("--gpus", default="8,16,64", help="cluster sizes, comma-separated")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds per trial")
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument(
        "--full-search",
        action="store_true",
        help="search the models' bound past the HTTP proxies' and the router's (slow: a "
        "64-GPU cluster at thousands of times the mix)",
    )
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    planner = Planner(
        args.config, profile, Slo.parse(args.slo), args.dtype, None, args.duration, 1500
    )
    traffic = parse_traffic(args.traffic)
    rows = [
        project(planner, traffic, float(n), args.gpus_per_node, args.duration, args.full_search)
        for n in args.gpus.split(",")
    ]
    text = markdown(rows)
    print(text)
    if args.out:
        doc = {"command": " ".join(["python -m carpool.twin.project", *(argv or sys.argv[1:])]),
               "profile": profile.get("name"), "rows": rows}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
