"""The twin's side of ``python -m benchmarks.twin_validate report``: its predictions on the
very requests and arrival times a measurement recorded, every figure's error, and TWIN.md.

``benchmarks/twin_validate.py`` measures (the harness's side) and holds the command line.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.twin_common import (
    GEN_CALIB_LOADED_CLIENTS,
    ROOT,
    SEED,
    embed_requests,
    gen_requests,
)
from benchmarks.workloads import embed_workload
from carpool_twin.calibrate import serving_pass_scale
from carpool_twin.profile import load_profile
from carpool_twin.replicas import SimRequest
from carpool_twin.sim import Overheads, SimResult
from carpool_twin.topology import TwinSpec

# --- predicting -----------------------------------------------------------------------------


HOST_CORES = 2.0  # this machine: the replica, the serving path and the load generator share them


def embed_spec(
    profile: dict,
    knobs: dict[str, Any],
    overheads: Overheads | None = None,
    pass_scale: float = 1.0,
) -> TwinSpec:
    overlay = {"embedder": {"user_config": knobs}} if knobs else {}
    spec = TwinSpec.from_serve_config(
        ROOT / "serve.yaml", profile, overlay, threads=1, roles=("embedder",)
    )
    spec.overheads = copy.deepcopy(overheads) if overheads else Overheads()
    spec.pools["embedder"].pass_scale = pass_scale
    return spec


def embed_pass_scale(
    profile: dict, base: dict, reqs: list[SimRequest], knobs: dict[str, Any] | None = None
) -> float | None:
    """What serving adds to each embedder pass, from a configuration's 1-client calibration
    run (``base``, with its ``knobs``; the default's unless told): the replica's own total
    pass time there (/v1/stats) over the profile's price of the same requests' passes
    (``carpool_twin.calibrate``). None for a measurement without it."""
    cal = base["closed_1"]
    forward_ms = (cal.get("replica") or {}).get("forward_ms")
    if not forward_ms or cal["ok"] != cal["sent"]:
        return None
    spec = embed_spec(profile, knobs or {})
    return serving_pass_scale(spec, "embedder", reqs, cal["ok"], forward_ms)


def loaded_pass_scale(
    profile: dict, base: dict, reqs: list[SimRequest], overheads: Overheads, scale: float
) -> float | None:
    """What a pass costs under load, from the default's 8-client calibration run (not a
    validated figure): the replica's own ms per padded token there (``/v1/stats``) over what
    the twin, with ``scale``, charges per padded token for its passes of the same load. The
    1-client run cannot show it: its passes run while the rest of the serving path waits for
    them, and under load they share the host with it (run 9: 7-27% dearer per padded token
    in every loaded phase than the 1-client passes of the same replica). None without it."""
    cal = base.get("closed_8") or {}
    rep = cal.get("replica") or {}
    if not rep.get("padded_tokens") or not rep.get("forward_ms"):
        return None
    twin = embed_spec(profile, {}, overheads, scale).build()
    twin.run(clients=8, requests=reqs, duration_s=cal["span_s"], warmup_s=0)
    stats = twin.pools["embedder"].replicas[0].server.executor.stats  # type: ignore[union-attr]
    if not stats.padded_tokens or not stats.forward_ms:
        return None
    measured = rep["forward_ms"] / rep["padded_tokens"]
    return scale * measured / (stats.forward_ms / stats.padded_tokens)


def host_cpu(
    profile: dict, base: dict, reqs: list[SimRequest], pass_scale: float = 1.0
) -> dict[str, float]:
    """The serving path's host CPU, from the default's idle window and 1-client calibration run
    (CPU seconds of the load generator and every process of the cluster, read from /proc):
    what the cluster burns idle (cores), and what each request costs outside the model's
    passes (ms: proxy, ingress, the replica's request handling, the load generator), the
    passes being what the twin prices them at on the same requests."""
    cal, idle = base["closed_1"], base.get("idle")
    if "cpu" not in cal or not idle:
        return {}
    background = idle["ours_s"] / idle["wall_s"]
    twin = embed_spec(profile, {}, pass_scale=pass_scale).build()
    r = twin.run(clients=1, requests=reqs, duration_s=cal["span_s"], warmup_s=0)
    pass_ms = 1000 * sum(twin.busy_s.values()) / max(r.answered, 1)
    serving_s = cal["cpu"]["ours_s"] - background * cal["cpu"]["wall_s"]
    per_request = max(0.0, 1000 * serving_s / max(cal["ok"], 1) - pass_ms)
    return {"background_cores": round(background, 3), "cpu_ms_per_request": round(per_request, 2),
            "pass_ms_per_request": round(pass_ms, 2)}  # fmt: skip


def predict_embed(
    profile: dict,
    measured: dict,
    requests: int,
    host: bool = True,
    scale_passes: bool = False,
    scale_each: bool = False,
    loaded: bool = True,
) -> dict:
    """The twin on each configuration's requests and arrivals. Fitted on the default's
    calibration runs only (none of them a validated figure): what serving adds to each pass
    (``embed_pass_scale``, with ``scale_passes``; with ``scale_each``, each configuration's
    from its own 1-client run instead), the serving path's host CPU (``host_cpu``, with
    ``host``), then the latency outside the replica's passes (``fixed_ms``: the 1-client
    run's mean latency less the twin's, both models included)."""
    reqs = embed_requests(embed_workload(requests, SEED))
    base = measured["default"]
    out: dict[str, Any] = {}
    scale = (embed_pass_scale(profile, base, reqs) if scale_passes else None) or 1.0
    if scale != 1.0:
        out["pass_scale"] = round(scale, 4)
    overheads = Overheads()
    if host and (cpu := host_cpu(profile, base, reqs, scale)):
        out["host"] = {"cores": HOST_CORES, **cpu}
        overheads = Overheads(
            host_cores=HOST_CORES,
            cpu_ms_per_request=cpu["cpu_ms_per_request"],
            background_cores=cpu["background_cores"],
        )
    if loaded and (under_load := loaded_pass_scale(profile, base, reqs, overheads, scale)):
        scale = under_load
        out["loaded_pass_scale"] = round(scale, 4)
    bare = (
        embed_spec(profile, {}, overheads, scale)
        .build()
        .run(clients=1, requests=reqs, duration_s=base["closed_1"]["span_s"], warmup_s=0)
    )
    overheads.fixed_ms = max(0.0, base["closed_1"]["mean_ms"] - _mean_ms(bare))
    out["fixed_ms"] = round(overheads.fixed_ms, 2)
    for name, m in measured.items():
        if not isinstance(m, dict) or "closed_32" not in m or "half" not in m:
            continue
        own = scale
        if scale_passes and scale_each:
            own = embed_pass_scale(profile, m, reqs, m["knobs"]) or scale
        spec = embed_spec(profile, m["knobs"], overheads, own)
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
        if own != scale:
            out[name]["pass_scale"] = round(own, 4)
    return out


def _mean_ms(result: SimResult) -> float:
    # A 1-client closed loop: mean latency = window / answered.
    return 1000 * result.window_s / max(result.answered, 1)


def gen_spec(
    profile: dict,
    knobs: dict[str, Any],
    step_ms: float = 0.0,
    fixed_ms: float = 0.0,
    seq_ms: float = 0.0,
    variant: tuple[str | None, int | None] = (None, 1),
) -> TwinSpec:
    """serve.yaml's small generator with ``knobs``, priced by the profile's entry of
    ``variant`` (dtype, torch threads: one thread on this machine, any on a GPU)."""
    spec = TwinSpec.from_serve_config(
        ROOT / "serve.yaml", profile, {"small": {"user_config": knobs}}, dtype=variant[0],
        threads=variant[1], roles=("small",),
    )  # fmt: skip
    pool = spec.pools["small"]
    pool.mode = "continuous"
    pool.step_ms = step_ms
    pool.seq_ms = seq_ms
    spec.overheads = Overheads(fixed_ms=fixed_ms)
    return spec


def _gen_closed(
    spec: TwinSpec, prompts: list[int], calls: list[dict], clients: int, first: list[int]
) -> SimResult:
    """Closed loop over generation_compare's calls: prompt ``i`` is ``PROMPTS[i % 8]``."""
    reqs = gen_requests(prompts, [c["max_tokens"] for c in calls],
                        [first[i % len(first)] for i in range(len(calls))])  # fmt: skip
    return spec.build().run(clients=clients, requests=reqs, max_requests=len(reqs), warmup_s=0,
                            duration_s=math.inf)  # fmt: skip


def fit_generation(
    profile: dict,
    m: dict,
    tokens: list[int],
    first: list[int],
    loaded: bool = True,
    variant: tuple[str | None, int | None] = (None, 1),
) -> tuple[float, float, float]:
    """``(fixed_ms, step_ms, seq_ms)`` of one configuration, fitted on its calibration runs
    only: the latency from a call to the engine's inbox (``fixed_ms``: the 1-client run's
    median first token beyond the twin's) and the engine's work outside the passes, per step
    (``step_ms``) and, with ``loaded``, per sequence in a step (``seq_ms``: sampling, text,
    the event to its stream). The two overheads make the twin's wall time match both the
    1-client run and the 8-client one (the one calibration point whose steps hold several
    sequences), solved by Newton steps on the two wall times; without the 8-client run
    ``step_ms`` alone matches the 1-client run. The passes cost what the profile says."""
    from benchmarks.generation_compare import PROMPTS, workload

    cal = m["calibrate"]
    cal8 = m.get("calibrate_8") if loaded else None
    n8 = GEN_CALIB_LOADED_CLIENTS
    # Each calibration run's calls (32 tokens each) and prompts, by its clients, built once.
    loads = {}
    for clients, run_ in ((1, cal), (n8, cal8)):
        if run_:
            calls = workload(run_["requests"], 32, 32, SEED)
            loads[clients] = (calls, [tokens[i % len(PROMPTS)] for i in range(len(calls))])

    def run(clients: int, fixed: float, step: float, seq: float) -> SimResult:
        calls, prompts = loads[clients]
        spec = gen_spec(profile, m["knobs"], step, fixed, seq, variant)
        return _gen_closed(spec, prompts, calls, clients, first)

    fixed_ms = step_ms = seq_ms = 0.0
    for _ in range(5):
        bare = run(1, fixed_ms, step_ms, seq_ms)
        fixed_ms = max(0.0, fixed_ms + cal["ttft_p50_ms"] - bare.ttft_p50_ms)
        w1 = run(1, fixed_ms, step_ms, seq_ms).window_s
        if not cal8:
            step_ms = max(0.0, step_ms + 1000 * (cal["wall_s"] - w1) / max(cal["engine_steps"], 1))
            continue
        w8 = run(n8, fixed_ms, step_ms, seq_ms).window_s
        # Both wall times are close to linear in the two overheads: a Newton step each round.
        a = run(1, fixed_ms, step_ms + 1.0, seq_ms).window_s - w1
        b = run(1, fixed_ms, step_ms, seq_ms + 1.0).window_s - w1
        c = run(n8, fixed_ms, step_ms + 1.0, seq_ms).window_s - w8
        d = run(n8, fixed_ms, step_ms, seq_ms + 1.0).window_s - w8
        r1, r8 = cal["wall_s"] - w1, cal8["wall_s"] - w8
        det = a * d - b * c
        if abs(det) < 1e-12:
            break
        step_ms = max(0.0, step_ms + (r1 * d - b * r8) / det)
        seq_ms = max(0.0, seq_ms + (a * r8 - c * r1) / det)
    return fixed_ms, step_ms, seq_ms


def predict_generation(profile: dict, measured: dict, loaded: bool = True) -> dict[str, Any]:
    """Per configuration: numbers fitted on its calibration runs (``fit_generation``); then
    every client count and the trace."""
    from benchmarks.generation_compare import PROMPTS, workload

    tokens = measured["prompt_tokens"]
    first = measured.get("first_delta_tokens") or [1] * len(PROMPTS)
    # This machine's runs: one torch thread, the profile's only dtype; a GPU run says its own.
    variant = (measured.get("dtype"), measured.get("threads", 1))
    out: dict[str, Any] = {}
    for name, m in measured.items():
        if not isinstance(m, dict) or "knobs" not in m or "calibrate" not in m:
            continue
        fixed_ms, step_ms, seq_ms = fit_generation(profile, m, tokens, first, loaded, variant)
        spec = gen_spec(profile, m["knobs"], step_ms, fixed_ms, seq_ms, variant)
        res: dict[str, Any] = {
            "step_overhead_ms": round(step_ms, 2),
            "seq_overhead_ms": round(seq_ms, 3),
            "fixed_ms": round(fixed_ms, 2),
        }
        for key, r in m.items():
            if key.isdigit() and "tokens_per_s" in r:
                calls = workload(r["requests"], 8, 256, SEED)
                prompts = [tokens[i % len(PROMPTS)] for i in range(len(calls))]
                res[key] = _gen_closed(spec, prompts, calls, int(key), first).as_dict()
        if "trace" in m and "tokens_per_s" in m["trace"]:
            t = m["trace"]
            reqs = gen_requests(t["prompt_tokens"], t["max_tokens"], t.get("first_delta_tokens"))
            arrivals = list(zip(t["times"], reqs, strict=True))
            res["trace"] = spec.build().run(arrivals=arrivals, warmup_s=0).as_dict()
        out[name] = res
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
    for name, t in (predicted.get("generation") or {}).items():
        for key, tr in t.items():
            if not isinstance(tr, dict):
                continue
            m = gen[name][key]
            config = f"{name}, trace" if key == "trace" else f"{name}, {key} clients"
            add(config, "tokens/s", m["tokens_per_s"], tr["tokens_per_s"])
            add(config, "TTFT p50 ms", m["ttft_p50_ms"], tr["ttft_p50_ms"])
            add(config, "TTFT p99 ms", m["ttft_p99_ms"], tr["ttft_p99_ms"])
    return rows


def predict_round(profile: dict, rnd: dict, requests: int, args: Any) -> dict[str, Any]:
    """The twin on one round of a measurement, fitted on that round's calibration runs."""
    loaded = not args.no_loaded
    predicted: dict[str, Any] = {}
    if rnd.get("embed"):
        predicted["embed"] = predict_embed(
            profile,
            rnd["embed"],
            requests,
            host=not args.no_host,
            scale_passes=args.pass_scale or args.scale_each,
            scale_each=args.scale_each,
            loaded=loaded,
        )
    if rnd.get("generation"):
        predicted["generation"] = predict_generation(profile, rnd["generation"], loaded)
    return predicted


def combine(per_round: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each figure as the median over the rounds of its measured and of its predicted value,
    the error between the two medians, and (with rounds) each round's values and the
    measured values' spread ((largest - smallest) / median: how far the harness moves
    between rounds)."""
    keyed: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rows in per_round:
        for row in rows:
            keyed.setdefault((row["config"], row["figure"]), []).append(row)
    out = []
    for (config, figure), rows in keyed.items():
        ms = [r["measured"] for r in rows]
        ts = [r["twin"] for r in rows]
        m, t = statistics.median(ms), statistics.median(ts)
        row = {"config": config, "figure": figure, "measured": round(m, 2), "twin": round(t, 2),
               "error": round((t - m) / m, 4) if m else math.nan}  # fmt: skip
        if len(rows) > 1:
            row |= {"measured_rounds": ms, "twin_rounds": ts,
                    "spread": round((max(ms) - min(ms)) / m, 4) if m else math.nan}  # fmt: skip
        out.append(row)
    return out


def fitted(predicted: dict[str, Any]) -> dict[str, Any]:
    """What one round's twin was fitted to, for the report."""
    embed = predicted.get("embed", {})
    gen = predicted.get("generation") or {}
    return {
        "embed_fixed_ms": embed.get("fixed_ms"),
        "embed_pass_scale": embed.get("pass_scale"),
        "embed_loaded_pass_scale": embed.get("loaded_pass_scale"),
        "embed_host": embed.get("host"),
        "generation_step_overhead_ms": {k: v.get("step_overhead_ms") for k, v in gen.items()},
        "generation_fixed_ms": {k: v.get("fixed_ms") for k, v in gen.items()},
        "generation_seq_overhead_ms": {k: v.get("seq_overhead_ms") for k, v in gen.items()},
    }


def cmd_report(args: Any) -> int:
    from benchmarks.twin_markdown import markdown

    measured = json.loads(Path(args.measured).read_text())
    profile = load_profile(args.profile)
    # Runs 1-9 are one round each, at the top of the file.
    rounds = measured.get("rounds") or [measured]
    predicted = [predict_round(profile, r, measured["requests"], args) for r in rounds]
    rows = combine([figures(r, p) for r, p in zip(rounds, predicted, strict=True)])
    errors = [abs(r["error"]) for r in rows if not math.isnan(r["error"])]
    spreads = [r["spread"] for r in rows if not math.isnan(r.get("spread", math.nan))]
    doc = {
        "median_abs_error": round(statistics.median(errors), 4) if errors else None,
        "max_abs_error": round(max(errors), 4) if errors else None,
        "rounds": len(rounds),
        # How far the harness itself moves between rounds: the error a twin cannot beat.
        "median_measured_spread": round(statistics.median(spreads), 4) if spreads else None,
        "figures": rows,
        "profile": args.profile,
        "measured": args.measured,
        "measure_command": measured.get("command"),
        "report_command": " ".join([".venv/bin/python -m benchmarks.twin_validate", *sys.argv[1:]]),
        # Where the embedder's pass prices come from: "serving" when the profile's entry
        # was re-timed in a replica (carpool_twin serving-profile), else bare passes.
        "embed_passes_from": next(
            (
                "serving" if e.get("serving") else "bare"
                for e in profile["models"]
                if e.get("role") == "embedder"
            ),
            None,
        ),
        "fitted": [fitted(p) for p in predicted],
        "predicted": predicted,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    Path(args.md).write_text(markdown(doc, measured, rounds[0]))
    print(Path(args.md).read_text())
    return 0
