"""How low placement alone could take a replay's TTFT: the floor under any request router.

A router decides where a request goes; it cannot make a prefill shorter than the part of the
prompt that no replica holds, nor serve a request before the work ahead of it on the replica
it picked. The floor takes both away from the run: the same requests, their arrivals spread
``stretch`` times further apart (no request waits behind another), placed by prefix affinity
(a conversation's turns meet their history; the trace's other prompts share only the first
block). What is left is each request's own uncached prefill: no router reaches below it at
the run's rate, where requests do wait for each other.

The box's engines are priced as ``carpool_twin.prefix_check`` prices them (the run's
``default`` TPOT fits the speed, the first file's ``default`` TTFT p50 the prefill ratio,
unless given). Each row sets the floor beside the twin's replay of the run as it was
(``default``: leastconn at the run's arrivals) and the measured figures, as ratios: a
target ratio below ``floor / default`` asks for more than placement can give.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from carpool_twin.mooncake import read_rows
from carpool_twin.prefix_check import (
    SYSTEMS,
    box,
    fit_ratio,
    fit_scale,
    rounds_of,
    run_requests,
)
from carpool_twin.prefix_sim import median, replays

# Arrivals this many times further apart: at 0.8 requests/s on 2 replicas, one every 25 s.
DEFAULT_STRETCH = 20.0


def floor(
    paths: Sequence[str],
    profile_path: str,
    config_path: str,
    host_cores: float,
    trace: Path,
    seeds: int = 5,
    prefill_ratio: float | None = None,
    stretch: float = DEFAULT_STRETCH,
) -> dict[str, Any]:
    """Per run (and rate, in a sweep): the floor's TTFT against the run's default (module
    docstring), measured and in the twin."""
    pricing, settings, period, spec = box(profile_path, config_path, seeds)
    rows = read_rows(trace)
    out: dict[str, Any] = {"stretch": stretch, "runs": []}
    for path in paths:
        result = json.loads(Path(path).read_text())
        entries = rounds_of(result)
        by_rate: dict[float, dict[str, tuple[Any, Any]]] = {}
        for name, summary, facts in entries:
            by_rate.setdefault(float(facts["rate"]), {})[name] = (summary, facts)
        for rate, systems in by_rate.items():
            if "default" not in systems:
                continue  # nothing to set the floor against
            summary, facts = systems["default"]
            replicas = int(facts["replicas"])
            requests = run_requests(facts, int(summary["requests"]), rows)
            if prefill_ratio is None:
                prefill_ratio = fit_ratio(
                    requests, replicas, spec, pricing, summary, host_cores, SYSTEMS["default"]
                )
                out["prefill_ratio_fitted_on"] = f"{Path(path).name}@{rate:g}"
            priced = replace(pricing, prefill_ratio=prefill_ratio)
            target = float(summary["tpot_ms_mean"])
            scale = fit_scale(requests, replicas, spec, priced, target, host_cores)
            at_scale = priced.at(scale)
            apart = [replace(r, at=r.at * stretch) for r in requests]
            lowest = replays(
                apart, "affinity", replicas, spec, at_scale, host_cores, settings, period
            )
            as_run = replays(
                requests, "leastconn", replicas, spec, at_scale, host_cores, settings, period
            )
            row: dict[str, Any] = {
                "run": f"{Path(path).name}@{rate:g}",
                "replicas": replicas,
                "floor_hit_rate_mean": median(lowest, lambda r: r.hit_rate_mean),
            }
            for figure in ("mean", "p90", "p99"):
                low = median(lowest, lambda r, f=figure: r.ttft_ms[f])
                twin_default = median(as_run, lambda r, f=figure: r.ttft_ms[f])
                row[f"ttft_{figure}_ms"] = {
                    "floor": low,
                    "twin_default": twin_default,
                    "floor_vs_twin_default": low / twin_default,
                    **{
                        f"measured_{name}": float(s["ttft_ms"][figure])
                        for name, (s, _) in systems.items()
                    },
                    **{
                        f"floor_vs_measured_{name}": low / float(s["ttft_ms"][figure])
                        for name, (s, _) in systems.items()
                    },
                }
            out["runs"].append(row)
    out["prefill_ratio"] = prefill_ratio
    return out


def floor_table(doc: dict[str, Any]) -> str:
    lines = [
        f"arrivals x{doc['stretch']:g} apart, prefix affinity: each request's own uncached "
        f"prefill (prefill ratio {doc['prefill_ratio']:.3f})",
        "",
        "| run | TTFT | floor ms | default ms (measured / twin) | floor / default "
        "(measured / twin) | measured others |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in doc["runs"]:
        for figure in ("mean", "p90", "p99"):
            f = r[f"ttft_{figure}_ms"]
            others = ", ".join(
                f"{k.removeprefix('measured_')} {v:,.0f}"
                for k, v in f.items()
                if k.startswith("measured_") and k != "measured_default"
            )
            lines.append(
                f"| {r['run']} | {figure} | {f['floor']:,.0f} | "
                f"{f['measured_default']:,.0f} / {f['twin_default']:,.0f} | "
                f"{f['floor_vs_measured_default']:.2f}x / {f['floor_vs_twin_default']:.2f}x | "
                f"{others} |"
            )
    return "\n".join(lines)
