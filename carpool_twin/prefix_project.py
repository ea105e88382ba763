"""The placement twin on GPU clusters: the Mooncake replay on N GPUs, per policy.

For each cluster size and policy: one replica of the small generator per GPU (serve-gpu.yaml's
engine: its KV cache, ``max_num_seqs``, step budget; vLLM's CUDA block of 16 tokens), steps
priced by ``profiles/gpu-h200.json``'s small generator as measured (no factor), and the whole
Mooncake trace (every conversation, the benchmark's text and output shape; one copy of it per
``gpus_per_copy`` GPUs, each copy's conversations with their own text and shifted in time,
so that every size replays as many requests per GPU over as long) replayed at the highest
arrival rate whose TTFT p99 meets the SLO: a search over the rate, the trace's time
compressed to each rate tried. Every row states the SLO and meets it by construction; the rows compare how
much each policy carries within it, its TTFT and the prefix hit rate it gets.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from carpool_twin.mooncake import TraceRequest, mooncake, read_rows, turn_gap_s
from carpool_twin.prefix_engine import EngineSpec
from carpool_twin.prefix_sim import (
    REPLAY_CHARS_PER_TOKEN,
    Pricing,
    ReplayResult,
    config_placement,
    engine_spec,
    replays,
)
from carpool_twin.profile import find_entry, load_profile
from router.placement import PlacementSettings

ROOT = Path(__file__).resolve().parents[1]
PROJECT_POLICIES = ("carpool", "pow2", "affinity")


def _project_one(
    rows: list[dict[str, Any]],
    policy: str,
    gpus: int,
    spec: EngineSpec,
    pricing: Pricing,
    settings: PlacementSettings,
    period: float,
    slo_ms: float,
    per_gpu_guess: float,
    copies: int,
    step: float = 1.25,
    bisections: int = 3,
) -> dict[str, Any]:
    """The highest rate within the SLO for one policy and cluster, and its replay: out from
    ``per_gpu_guess`` by factors of ``step`` until the SLO holds at one rate and fails at
    the next, then that bracket halved ``bisections`` times."""
    runs: dict[float, tuple[ReplayResult, list[TraceRequest], dict[str, Any]]] = {}

    def run(rate: float) -> ReplayResult:
        requests, facts = mooncake(1.0, rate, rows=rows, copies=copies)
        # One seed: the rate's bracket, not a figure's spread, is what is searched.
        result = replays(requests, policy, gpus, spec, pricing, None, settings, period)[0]
        runs[rate] = (result, requests, facts)
        return result

    def meets(rate: float) -> bool:
        return run(rate).ttft_ms["p99"] <= slo_ms

    # Each replay costs minutes at 64 GPUs (most of it in carpool's router's own choices),
    # so the bracket starts near the answer and is cut a few times only.
    lo = hi = per_gpu_guess * gpus
    if meets(lo):
        while meets(hi := hi * step):
            lo = hi
    else:
        while not meets(lo := lo / step):
            hi = lo
            if lo < 1e-3:
                raise ValueError(f"{policy} meets the SLO at no rate on {gpus} GPUs")
    for _ in range(bisections):
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    result, requests, facts = runs[lo]  # every rate bisected was run
    return {
        "gpus": gpus,
        "policy": policy,
        "rate_rps": round(lo, 1),
        "rate_per_gpu": round(lo / gpus, 2),
        "first_failing_rps": round(hi, 1),
        "ttft_ms": {k: round(v, 1) for k, v in result.ttft_ms.items()},
        "meets_slo": result.ttft_ms["p99"] <= slo_ms,
        "hit_rate": round(result.prefix_hit_rate, 4),
        "hit_rate_replica_mean": round(result.hit_rate_mean, 4),
        "tpot_ms_mean": round(result.tpot_ms_mean, 1),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "busiest_replica_share": round(max(result.placed.values()) / result.requests, 4),
        "requests": result.requests,
        "answered": result.answered,
        "replay_s": round(result.wall_s, 1),
        "time_scale": facts["time_scale"],
        "median_turn_gap_s": round(turn_gap_s(requests), 3),
        "preempted": result.preempted,
    }


def project(
    gpus: Sequence[int],
    policies: Sequence[str],
    profile_path: str,
    config_path: str,
    dtype: str,
    slo_ms: float,
    trace: Path,
    per_gpu_guess: float,
    gpus_per_copy: int,
    step: float = 1.25,
    bisections: int = 3,
    out: Path | None = None,
    command: str = "",
) -> dict[str, Any]:
    """Every size and policy (module docstring); ``gpus_per_copy``: one copy of the trace
    per that many GPUs, so every size replays as many requests per GPU, over as long."""
    profile = load_profile(profile_path)
    entry = find_entry(profile, "small", "cuda", dtype)
    config = yaml.safe_load(Path(config_path).read_text())
    spec = engine_spec(config, entry, "cuda", REPLAY_CHARS_PER_TOKEN)
    # serve-gpu.yaml carries no placement block: carpool's router with serve-replicas.yaml's
    # settings, which are the router's defaults.
    settings, period = config_placement(yaml.safe_load((ROOT / "serve-replicas.yaml").read_text()))
    rows = read_rows(trace)
    out_rows: list[dict[str, Any]] = []
    doc = {
        "command": command,
        "slo": f"TTFT p99 <= {slo_ms:g} ms",
        "profile": f"{profile.get('name')} small {dtype}",
        "spec": vars(spec),
        "placement": vars(settings) | {"stats_period_s": period},
        "gpus_per_copy": gpus_per_copy,
        "search": {"per_gpu_guess": per_gpu_guess, "step": step, "bisections": bisections},
        "rows": out_rows,
    }
    for n in gpus:
        for policy in policies:
            started = time.perf_counter()
            copies = max(1, n // gpus_per_copy)
            row = _project_one(
                rows, policy, n, spec, Pricing(entry, seeds=1), settings, period, slo_ms,
                per_gpu_guess, copies, step, bisections,
            )  # fmt: skip
            row["copies"] = copies
            row["twin_s"] = round(time.perf_counter() - started, 1)
            print(json.dumps(row), file=sys.stderr, flush=True)
            out_rows.append(row)
            if out is not None:
                out.write_text(json.dumps(doc, indent=1))
    return doc


def project_table(doc: Mapping[str, Any]) -> str:
    lines = [
        f"SLO: {doc['slo']}; one replica per GPU ({doc['profile']}); one copy of the trace per "
        f"{doc['gpus_per_copy']} GPUs",
        "",
        "| GPUs | policy | requests/s within SLO (per GPU) | misses it at | TTFT p50 / p90 / p99 "
        "ms | prefix hit rate | busiest replica's share | requests (copies), replay s | median "
        "turn gap s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        t = r["ttft_ms"]
        lines.append(
            f"| {r['gpus']} | {r['policy']} | {r['rate_rps']:,.0f} ({r['rate_per_gpu']:.1f}) | "
            f"{r['first_failing_rps']:,.0f} | {t['p50']:,.0f} / {t['p90']:,.0f} / {t['p99']:,.0f} | {r['hit_rate']:.3f} | "
            f"{r['busiest_replica_share']:.3f} | {r['requests']:,} ({r['copies']}), "
            f"{r['replay_s']:.0f} | {r['median_turn_gap_s']:.2f} |"
        )
    return "\n".join(lines)
