"""``python -m carpool_twin.project``: a traffic mix projected onto clusters of N GPUs.

For each N: the largest multiple of the mix whose plan (``carpool_twin.plan``) meets the SLO
within N GPUs; the same for each part of the serving path every request crosses, from its
measured CPU per request (``carpool_twin.path``, the path profile): the HTTP layer (HAProxy's
threads on every node with ``proxy_location: EveryNode``, the head included; or Serve's Python
proxy, one core per node, with ``--ingress python-proxy``), each pipeline's ingress replicas
(one core each, as many as the serve config allows), the router's replicas for ``auto``, and
the head node's cores, which serve-gpu.yaml's ingresses (and the router inside generate's) share. The binding bound
is the bottleneck. The mix is then run at that multiple through one whole-cluster twin, every
kind together through the path's stages, for the goodput and p99 the table shows.

    python -m carpool_twin.project --config serve-gpu.yaml --profile profiles/gpu-h200.json \\
        --dtype bfloat16 --traffic "embed=3,rank=1,generate=1" --slo p99_ms=500 --gpus 8,16,64
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from typing import Any

from carpool_twin.path import (
    HEAD_CORES,
    HEAD_INGRESS_UNITS,
    MODES,
    ServingPath,
    tier_units,
    with_replicas,
)
from carpool_twin.plan import Choice, Planner, Slo, overlay_of
from carpool_twin.profile import load_profile
from carpool_twin.sim import Overheads
from carpool_twin.topology import TwinSpec
from carpool_twin.traffic import Traffic, parse_traffic


def project(
    planner: Planner,
    traffic: Traffic,
    gpus: float,
    gpus_per_node: int,
    duration_s: float,
    path: ServingPath,
    full_search: bool = False,
) -> dict[str, Any]:
    rates = traffic.rates()
    config = planner.config
    tiered = tier_units(config) is not None
    # With an ingress tier the ingress replicas are sized for the load (size_ingress) and
    # their nodes follow, so only what does not grow with them caps the models' search:
    # each node's HTTP process (counting no ingress node: a floor) and the head.
    path_bounds = path.bounds(config, traffic, gpus, gpus_per_node)
    fixed = [b for b in path_bounds if not tiered or b.component == "http"]
    shared = {b.name: b.scale for b in fixed}
    # The models' bound is searched only up to the lowest shared bound: past it the shared
    # one binds whatever the GPUs could do, and the search there is what never finished.
    cap = min(shared.values(), default=None)
    gpu_scale, plan = planner.fit_gpus(traffic, gpus, cap=None if full_search else cap)
    capped = cap is not None and not full_search and gpu_scale >= cap
    scale = min(gpu_scale, cap) if cap is not None else gpu_scale
    if tiered:
        # The path sized for that load, and every bound of it (the head's included).
        config = with_replicas(config, path.size_ingress(config, traffic.scaled(scale)))
        path_bounds = path.bounds(config, traffic, gpus, gpus_per_node)
        shared = {b.name: b.scale for b in path_bounds}
    bounds = {"GPUs (models)": gpu_scale, **shared}
    bottleneck = min(shared, key=shared.__getitem__) if capped else min(bounds, key=bounds.get)
    if tiered and bounds[bottleneck] < scale:  # the sized path binds below: resize there
        config = with_replicas(
            config, path.size_ingress(config, traffic.scaled(bounds[bottleneck]))
        )
    scale = bounds[bottleneck]
    if bottleneck != "GPUs (models)":
        plan = planner.plan(traffic.scaled(scale))  # fewer GPUs suffice at the lower rate
    busiest = _busiest(plan)
    overheads = path.overheads(config, gpus, gpus_per_node)
    result = whole_cluster(planner, plan, traffic.scaled(scale), overheads, duration_s)
    layout = path.layout(config, gpus, gpus_per_node)
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
        "ingress_mode": path.mode,
        "proxies": layout.nodes,
        # The ingress tier sized for this load: replicas per ingress deployment (one core
        # each, at most INGRESS_TARGET busy), the carpool_ingress units of every ingress, and
        # the ingress_cpu nodes beyond the head's units.
        "ingress_tier": {
            "replicas": {n: r for _, (n, r) in sorted(layout.ingress.items())},
            "units": layout.units,
            "head_units": HEAD_INGRESS_UNITS,
            "ingress_nodes": layout.ingress_nodes,
        },
        # Each path bound's arithmetic: cores x 1000 / CPU-ms per request = requests/s.
        "path": {
            b.name: {
                "cores": b.cores,
                "cpu_ms_per_request": round(b.ms_per_request, 4),
                "ceiling_rps": round(b.ceiling_rps, 1),
                "load_at_bottleneck": round(b.load * scale, 3),
            }
            for b in path_bounds
        },
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
    overheads: Overheads,
    duration_s: float,
) -> dict[str, Any]:
    """Every kind at once through the serving path's stages, at the planned replicas and knobs."""
    spec = TwinSpec.from_serve_config(
        planner.config, planner.profile, overlay_of(plan), planner.dtype, planner.threads
    )
    spec.overheads = overheads
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
        tier = row.get("ingress_tier") or {}
        if tier.get("units") is not None:
            reps += "; " + ", ".join(f"{k} {v}" for k, v in tier["replicas"].items())
            reps += f" ({tier['units']} carpool_ingress: {tier['ingress_nodes']} ingress nodes)"
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
    p = argparse.ArgumentParser(prog="python -m carpool_twin.project", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--profile", required=True)
    p.add_argument("--dtype")
    p.add_argument("--traffic", required=True, help="as python -m carpool_twin.planner --traffic")
    p.add_argument("--slo", required=True, help="as python -m carpool_twin.planner --slo")
    p.add_argument("--gpus", default="8,16,64", help="cluster sizes, comma-separated")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds per trial")
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument(
        "--full-search",
        action="store_true",
        help="search the models' bound past the serving path's (slow: a 64-GPU cluster at "
        "thousands of times the mix)",
    )
    p.add_argument(
        "--path-profile", help="the path profile (default: profiles/path-cpu-2core.json)"
    )
    p.add_argument(
        "--ingress",
        choices=MODES,
        help="HTTP layer: Ray's HAProxy (as carpool ships) or Serve's Python proxy, the "
        "earlier layout (default: the path profile's default_mode)",
    )
    p.add_argument(
        "--http-threads",
        type=int,
        help="HTTP servers per node (default: HAProxy's nbthread 4; the Python proxy's 1)",
    )
    p.add_argument(
        "--head-cores",
        type=float,
        default=HEAD_CORES,
        help="the head node's cores, shared by the ingresses and the router they host (default: "
        "cluster.yaml's head, 8; 0: not a bound)",
    )
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    path = ServingPath.load(
        args.path_profile, args.ingress, args.http_threads, args.head_cores or None
    )
    planner = Planner(
        args.config, profile, Slo.parse(args.slo), args.dtype, None, args.duration, 1500
    )
    traffic = parse_traffic(args.traffic)
    rows = [
        project(
            planner,
            traffic,
            float(n),
            args.gpus_per_node,
            args.duration,
            path,
            full_search=args.full_search,
        )
        for n in args.gpus.split(",")
    ]
    text = markdown(rows)
    print(text)
    if args.out:
        doc = {"command": " ".join(["python -m carpool_twin.project", *(argv or sys.argv[1:])]),
               "profile": profile.get("name"), "path_profile": path.source,
               "ingress_mode": path.mode, "path_cpu_ms": path.ms, "rows": rows}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
