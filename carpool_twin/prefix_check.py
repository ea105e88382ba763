"""The placement twin against on-box runs of ``benchmarks.prefix_replay``.

``check`` replays each run's requests (its workload facts rebuild them,
``carpool_twin.mooncake``) through the twin with each system's policy (``SYSTEMS``) and sets,
per run and system, the twin's TTFT p50 and mean per-replica prefix hit rate beside the
measured ones, with their relative errors and the median error.

How the box's engines are priced: the small generator's passes in ``profiles/cpu-2core.json``
(carpool's own engine, one thread, fp32), the decode pass times a factor per run and the
prefill pass times that factor and a ratio. Each run's factor is fitted so that its
``default`` system's replay has the run's measured TPOT mean: the box's speed that run (its
engines share 2 cores with each other and the serving path, and ran slower in some runs than
others). The ratio is fitted once, on the first file's ``default`` TTFT p50 (vLLM's CPU
prefill against its decode need not be carpool's engine's); that row is marked fitted and
left out of the TTFT error's median. Nothing else is fitted: the other TTFTs and every hit
rate are the twin's prediction.

Each figure is the median over ``seeds`` replays whose step costs differ by ``STEP_NOISE``:
these runs sit near the engines' saturation, where TTFT moves by 10-20% between replays that
differ only by such noise (as the harness's own repeats do).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from carpool_twin.mooncake import TraceRequest, mooncake, read_rows
from carpool_twin.prefix_engine import EngineSpec
from carpool_twin.prefix_sim import (
    REPLAY_CHARS_PER_TOKEN,
    Pricing,
    config_placement,
    engine_spec,
    median,
    replays,
)
from carpool_twin.profile import find_entry, load_profile
from router.placement import PlacementSettings

# What each system in a benchmark result ran, as a twin policy. ray-prefix is Ray's
# PrefixCacheAffinityRouter asked by HAProxy's placement router without a reservation
# (``choose_replica(_reserve=False)``): Ray then takes the first replica of its first
# candidate list and never calls ``on_request_routed``, so its tree stays empty.
# ray-serve-llm (Ray Serve LLM's own app: another engine path) has no twin here.
SYSTEMS = {"default": "leastconn", "carpool": "carpool", "ray-prefix": "affinity-pick-only"}


def _words(facts: Mapping[str, Any]) -> int:
    return int(str(facts.get("block", "-> 8 words")).split("->")[1].split()[0])


def run_requests(
    facts: Mapping[str, Any], count: int, rows: list[dict[str, Any]]
) -> list[TraceRequest]:
    """The requests a benchmark round sent (its first ``count``: the harness's ``--limit``)."""
    requests, _ = mooncake(
        float(facts["kept_conversations_fraction"]),
        float(facts["rate"]),
        _words(facts),
        int(facts["max_blocks"]),
        float(facts["output_divisor"]),
        offset=float(facts.get("kept_slice_offset", 0.0)),
        rows=rows,
    )
    return requests[:count]


def rounds_of(result: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], Mapping[str, Any]]]:
    """(system, its summary, its round's workload facts) for every system of a result file,
    one rate or a sweep (``name@rate`` keys, one facts entry per rate)."""
    workload = result["workload"]
    by_rate = {
        float(f["rate"]): f for f in (workload if isinstance(workload, list) else [workload])
    }
    out = []
    for key, summary in result["systems"].items():
        name, _, rate = key.partition("@")
        facts = by_rate[float(rate)] if rate else next(iter(by_rate.values()))
        out.append((name, summary, facts))
    return out


def fit_scale(
    requests: Sequence[TraceRequest],
    replicas: int,
    spec: EngineSpec,
    pricing: Pricing,
    target_tpot_ms: float,
    host_cores: float,
    policy: str = "leastconn",
) -> float:
    """The cost factor at which ``policy``'s replays have a median TPOT mean of
    ``target_tpot_ms`` (bisection on its logarithm; TPOT rises with the factor)."""
    lo, hi = math.log(0.1), math.log(10.0)
    for _ in range(14):  # to 0.03% of the factor
        mid = (lo + hi) / 2
        runs = replays(requests, policy, replicas, spec, pricing.at(math.exp(mid)), host_cores)
        if median(runs, lambda r: r.tpot_ms_mean) < target_tpot_ms:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def fit_ratio(
    requests: Sequence[TraceRequest],
    replicas: int,
    spec: EngineSpec,
    pricing: Pricing,
    summary: Mapping[str, Any],
    host_cores: float,
    policy: str = "leastconn",
) -> float:
    """The prefill pass's factor against the decode pass's at which ``policy``'s replays,
    their speed fitted on the run's TPOT, have the run's TTFT p50 (TTFT rises with it)."""
    lo, hi = math.log(0.2), math.log(5.0)
    target = float(summary["ttft_ms"]["p50"])
    for _ in range(9):  # to about 0.6% of the ratio
        mid = (lo + hi) / 2
        trial = replace(pricing, prefill_ratio=math.exp(mid))
        tpot = float(summary["tpot_ms_mean"])
        scale = fit_scale(requests, replicas, spec, trial, tpot, host_cores, policy)
        runs = replays(requests, policy, replicas, spec, trial.at(scale), host_cores)
        if median(runs, lambda r: r.ttft_ms["p50"]) < target:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def _rel(twin: float, measured: float) -> float | None:
    return abs(twin - measured) / measured if measured else None


def box(
    profile_path: str, config_path: str, seeds: int
) -> tuple[Pricing, PlacementSettings, float, EngineSpec]:
    """The on-box engines as the twin prices them (the profile's small generator, one thread,
    fp32) and the placement the config sets, for a replay of ``benchmarks.prefix_replay``."""
    entry = find_entry(load_profile(profile_path), "small", "cpu", "float32", 1)
    config = yaml.safe_load(Path(config_path).read_text())
    settings, period = config_placement(config)
    spec = engine_spec(config, entry, "cpu", REPLAY_CHARS_PER_TOKEN)
    return Pricing(entry, seeds=seeds), settings, period, spec


def check(
    paths: Sequence[str],
    profile_path: str,
    config_path: str,
    host_cores: float,
    trace: Path,
    calibrate_on: str = "default",
    seeds: int = 5,
    prefill_ratio: float | None = None,
) -> dict[str, Any]:
    """Each run's systems through the twin against what they measured (module docstring).

    ``prefill_ratio`` None: fitted on the first file's ``calibrate_on`` system (its TTFT
    p50, the one figure then fitted rather than predicted)."""
    pricing, settings, period, spec = box(profile_path, config_path, seeds)
    profile = load_profile(profile_path)
    rows = read_rows(trace)
    ratio_fitted_on = None
    if prefill_ratio is None:
        first = json.loads(Path(paths[0]).read_text())
        name, summary, facts = next(e for e in rounds_of(first) if e[0] == calibrate_on)
        requests = run_requests(facts, int(summary["requests"]), rows)
        prefill_ratio = fit_ratio(
            requests, int(facts["replicas"]), spec, pricing, summary, host_cores, SYSTEMS[name]
        )
        sweep = isinstance(first["workload"], list) and len(first["workload"]) > 1
        run = Path(paths[0]).name + (f"@{float(facts['rate']):g}" if sweep else "")
        ratio_fitted_on = (run, name)
    pricing = replace(pricing, prefill_ratio=prefill_ratio)
    out: dict[str, Any] = {
        "runs": [],
        "prefill_ratio": round(prefill_ratio, 4),
        "prefill_ratio_fitted_on": ratio_fitted_on,
        "spec": vars(spec) | {"host_cores": host_cores},
        "pricing": {"profile": profile.get("name"), "noise": pricing.noise, "seeds": seeds},
        "placement": vars(settings) | {"stats_period_s": period},
    }
    for path in paths:
        result = json.loads(Path(path).read_text())
        # One round per rate (a sweep has several): each fits its own speed, as the box's
        # speed may differ between rounds.
        rounds: dict[float, list[tuple[str, Mapping[str, Any], Mapping[str, Any]]]] = {}
        for entry_ in rounds_of(result):
            if entry_[0] in SYSTEMS:
                rounds.setdefault(float(entry_[2]["rate"]), []).append(entry_)
        sweep = len(rounds) > 1
        for rate, entries in rounds.items():
            anchor = next((e for e in entries if e[0] == calibrate_on), entries[0])
            name, summary, facts = anchor
            replicas = int(facts["replicas"])
            requests = run_requests(facts, int(summary["requests"]), rows)
            target = float(summary["tpot_ms_mean"])
            scale = fit_scale(requests, replicas, spec, pricing, target, host_cores, SYSTEMS[name])
            run = f"{Path(path).name}@{rate:g}" if sweep else Path(path).name
            for system, measured, facts in entries:
                out["runs"].append(
                    _row(run, system, measured, facts, rows, replicas, spec, pricing.at(scale),
                         host_cores, settings, period, name, ratio_fitted_on == (run, system))
                )  # fmt: skip
    out["median_rel_err"] = _medians(out["runs"])
    return out


def _row(
    run: str,
    system: str,
    measured: Mapping[str, Any],
    facts: Mapping[str, Any],
    rows: list[dict[str, Any]],
    replicas: int,
    spec: EngineSpec,
    pricing: Pricing,
    host_cores: float,
    settings: PlacementSettings,
    period: float,
    calibrated_on: str,
    ttft_fitted: bool,
) -> dict[str, Any]:
    """One system of one run: the twin's figures (medians over the seeds) and the measured."""
    requests = run_requests(facts, int(measured["requests"]), rows)
    twin = replays(requests, SYSTEMS[system], replicas, spec, pricing, host_cores, settings, period)
    hits = list(measured["replica_prefix_hit_rate"].values())
    row = {
        "run": run,
        "system": system,
        "twin_policy": SYSTEMS[system],
        "replicas": replicas,
        "scale": round(pricing.scale, 3),
        "prefill_scale": round(pricing.scale * pricing.prefill_ratio, 3),
        "calibrated_on": calibrated_on,
        # This row's TTFT p50 fixed the prefill ratio: fitted, not predicted.
        "ttft_fitted": ttft_fitted,
        "ttft_p50_ms": {
            "twin": median(twin, lambda r: r.ttft_ms["p50"]),
            "measured": measured["ttft_ms"]["p50"],
            "twin_seeds": [round(r.ttft_ms["p50"]) for r in twin],
        },
        "hit_rate_mean": {
            "twin": median(twin, lambda r: r.hit_rate_mean),
            "measured": statistics.fmean(hits) if hits else 0.0,
        },
        "tpot_ms_mean": {
            "twin": median(twin, lambda r: r.tpot_ms_mean),
            "measured": measured["tpot_ms_mean"],
        },
        "ttft_p90_ms": {
            "twin": median(twin, lambda r: r.ttft_ms["p90"]),
            "measured": measured["ttft_ms"]["p90"],
        },
        "measured_replica_hit_rates": measured["replica_prefix_hit_rate"],
        "twin_replica_hit_rates": [r.replica_prefix_hit_rate for r in twin],
        "twin_placed": [r.placed for r in twin],
    }
    for figure in ("ttft_p50_ms", "hit_rate_mean", "tpot_ms_mean", "ttft_p90_ms"):
        row[figure]["rel_err"] = _rel(row[figure]["twin"], row[figure]["measured"])
    return row


def _medians(runs: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Median relative errors: of TTFT p50 (rows whose TTFT was fitted left out), of the hit
    rate, and of both together."""
    errors = {
        "ttft_p50_ms": [
            r["ttft_p50_ms"]["rel_err"]
            for r in runs
            if r["ttft_p50_ms"]["rel_err"] is not None and not r["ttft_fitted"]
        ],
        "hit_rate_mean": [
            r["hit_rate_mean"]["rel_err"] for r in runs if r["hit_rate_mean"]["rel_err"] is not None
        ],
    }
    both = errors["ttft_p50_ms"] + errors["hit_rate_mean"]
    out = {f: statistics.median(e) if e else None for f, e in errors.items()}
    out["both"] = statistics.median(both) if both else None
    return out


def check_table(doc: Mapping[str, Any]) -> str:
    fitted_on = doc["prefill_ratio_fitted_on"]
    source = f"fitted on {' '.join(fitted_on)} TTFT p50" if fitted_on else "given"
    lines = [
        f"prefill part x{doc['prefill_ratio']:.3f} of the decode pass's factor ({source}); "
        "each run's factor fitted on its default's TPOT mean",
        "",
        "| run | system | decode / prefill x | TTFT p50 ms twin / measured | err | hit rate "
        "(replica mean) twin / measured | err | TPOT ms twin / measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["runs"]:
        t, h, p = r["ttft_p50_ms"], r["hit_rate_mean"], r["tpot_ms_mean"]
        fitted = " (fitted)" if r["ttft_fitted"] else ""
        lines.append(
            f"| {r['run']} | {r['system']} | {r['scale']:.2f} / {r['prefill_scale']:.2f} | "
            f"{t['twin']:,.0f} / {t['measured']:,.0f} | {_pct(t['rel_err'])}{fitted} | "
            f"{h['twin']:.3f} / {h['measured']:.3f} | {_pct(h['rel_err'])} | "
            f"{p['twin']:,.0f} / {p['measured']:,.0f} |"
        )
    m = doc["median_rel_err"]
    lines.append(
        f"\nmedian relative error: TTFT p50 {_pct(m['ttft_p50_ms'])} (fitted row left out), hit rate "
        f"{_pct(m['hit_rate_mean'])}, both {_pct(m['both'])}"
    )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
