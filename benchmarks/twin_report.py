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

from benchmarks.twin_validate import (
    ROOT,
    SEED,
    embed_requests,
    gen_requests,
)
from benchmarks.workloads import embed_workload
from carpool.twin.calibrate import serving_pass_scale
from carpool.twin.profile import load_profile
from carpool.twin.replicas import SimRequest
from carpool.twin.sim import Overheads, SimResult
from carpool.twin.topology import TwinSpec

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
    (``carpool.twin.calibrate``). None for a measurement without it."""
    cal = base["closed_1"]
    forward_ms = (cal.get("replica") or {}).get("forward_ms")
    if not forward_ms or cal["ok"] != cal["sent"]:
        return None
    spec = embed_spec(profile, knobs or {})
    return serving_pass_scale(spec, "embedder", reqs, cal["ok"], forward_ms)


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
    profile: dict, knobs: dict[str, Any], step_ms: float = 0.0, fixed_ms: float = 0.0
) -> TwinSpec:
    spec = TwinSpec.from_serve_config(
        ROOT / "serve.yaml", profile, {"small": {"user_config": knobs}}, threads=1,
        roles=("small",),
    )  # fmt: skip
    pool = spec.pools["small"]
    pool.mode = "continuous"
    pool.step_ms = step_ms
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


def predict_generation(profile: dict, measured: dict) -> dict[str, Any]:
    """Per configuration: two numbers fitted on its 1-client calibration run (the latency to
    the engine, the work per step outside the passes); then every client count and the
    trace."""
    from benchmarks.generation_compare import PROMPTS, workload

    tokens = measured["prompt_tokens"]
    first = measured.get("first_delta_tokens") or [1] * len(PROMPTS)
    out: dict[str, Any] = {}
    for name, m in measured.items():
        if not isinstance(m, dict) or "knobs" not in m or "calibrate" not in m:
            continue
        cal = m["calibrate"]
        calls = workload(cal["requests"], 32, 32, SEED)
        prompts = [tokens[i % len(PROMPTS)] for i in range(len(calls))]
        # Two numbers from the 1-client run: the latency from a call to the engine's inbox
        # (``fixed_ms``: the first token's wait beyond the twin's) and the work per step
        # beyond the passes (the rest of the wall time, over its steps). Each moves the
        # other a little: a few rounds settle them.
        step_ms = fixed_ms = 0.0
        for _ in range(4):
            bare = _gen_closed(
                gen_spec(profile, m["knobs"], step_ms, fixed_ms), prompts, calls, 1, first
            )
            fixed_ms = max(0.0, fixed_ms + cal["ttft_p50_ms"] - bare.ttft_p50_ms)
            bare = _gen_closed(
                gen_spec(profile, m["knobs"], step_ms, fixed_ms), prompts, calls, 1, first
            )
            step_ms = max(
                0.0, step_ms + 1000 * (cal["wall_s"] - bare.window_s) / max(cal["engine_steps"], 1)
            )
        spec = gen_spec(profile, m["knobs"], step_ms, fixed_ms)
        res: dict[str, Any] = {
            "step_overhead_ms": round(step_ms, 2),
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


def cmd_report(args: Any) -> int:
    measured = json.loads(Path(args.measured).read_text())
    profile = load_profile(args.profile)
    predicted: dict[str, Any] = {}
    if measured.get("embed"):
        predicted["embed"] = predict_embed(
            profile,
            measured["embed"],
            measured["requests"],
            host=not args.no_host,
            scale_passes=args.pass_scale or args.scale_each,
            scale_each=args.scale_each,
        )
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
        "fitted": {
            "embed_fixed_ms": predicted.get("embed", {}).get("fixed_ms"),
            "embed_pass_scale": predicted.get("embed", {}).get("pass_scale"),
            "embed_host": predicted.get("embed", {}).get("host"),
            # Where the embedder's pass prices come from: "serving" when the profile's entry
            # was re-timed in a replica (carpool.twin serving-profile), else bare passes.
            "embed_passes_from": next(
                (
                    "serving" if e.get("serving") else "bare"
                    for e in profile["models"]
                    if e.get("role") == "embedder"
                ),
                None,
            ),
            "generation_step_overhead_ms": {
                k: v.get("step_overhead_ms") for k, v in (predicted.get("generation") or {}).items()
            },
            "generation_fixed_ms": {
                k: v.get("fixed_ms") for k, v in (predicted.get("generation") or {}).items()
            },
        },
        "predicted": predicted,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    Path(args.md).write_text(markdown(doc, measured))
    print(Path(args.md).read_text())
    return 0


def markdown(doc: dict, measured: dict) -> str:
    fitted = doc["fitted"]
    host = fitted.get("embed_host")
    gen = measured.get("generation") or {}
    trace = (gen.get("default") or {}).get("trace")
    lines = [
        "# The twin against the harness",
        "",
        f"Measured: `{doc['measure_command']}` (started {measured.get('started')}, load average "
        f"{measured.get('loadavg_before')} before, {measured.get('loadavg_after')} after), "
        "under the benchmark lock.",
        f"Predicted: `{doc['report_command']}` with the cost profile `{doc['profile']}`.",
        "",
        f"**Median absolute error {100 * (doc['median_abs_error'] or 0):.1f}%, largest "
        f"{100 * (doc['max_abs_error'] or 0):.1f}%** over {len(doc['figures'])} figures "
        "(the issue's targets: median at most 10%, none worse than 25%).",
        "",
        "| configuration | figure | measured | twin | error |",
        "|---|---|---|---|---|",
    ]
    for r in doc["figures"]:
        lines.append(
            f"| {r['config']} | {r['figure']} | {r['measured']:,.1f} | {r['twin']:,.1f} | "
            f"{100 * r['error']:+.1f}% |"
        )
    lines += ["", "## What is fitted, and on what", ""]
    scaled = fitted.get("embed_pass_scale") is not None
    passes = (
        "the embedder's passes as its deployed replica ran them, one request of each of the "
        "profile's shapes at a time, on the default configuration before its phases "
        "(`carpool.twin serving-profile`); the generator's bare steps"
        if fitted.get("embed_passes_from") == "serving"
        else "bare forward passes, no serving"
    )
    lines.append(
        f"Nothing is fitted on a figure above. The passes cost what the profile measured ({passes})"
        + (", times what serving added to a pass in the calibration run" if scaled else "")
        + ". Fitted on calibration runs, none of them among the "
        "figures (for embed, the **default** configuration's idle window of the deployed "
        "cluster and its 1-client closed loop):"
    )
    if fitted.get("embed_pass_scale") is not None:
        lines.append(
            f"- what serving adds to each embedder pass: **{fitted['embed_pass_scale']:.3f}x** "
            "the profile's price, the replica's own record of its passes' wall time in the "
            "1-client run (`/v1/stats`) over the twin's price of the same requests' passes "
            "(`carpool.twin.calibrate.serving_pass_scale`; `PoolSpec.pass_scale`). It is pass "
            "time, so it holds the replica and queues under load."
        )
    if host:
        lines.append(
            f"- the serving path's host CPU, read from /proc (CPU seconds of the load generator "
            f"and every process of the Ray cluster): {host['background_cores']} cores busy "
            f"idle, and **{host['cpu_ms_per_request']} ms of CPU per request** outside the "
            f"model's passes (proxy, ingress, the replica's request handling, the load "
            f"generator; the passes are what the twin prices them at on the same requests, "
            f"{host['pass_ms_per_request']} ms each). The twin runs the passes on a host of "
            f"{host['cores']:g} cores that this demand shares: while the passes and the "
            "serving path together want more than the cores, every runnable thread slows "
            "alike (processor sharing; `Overheads.host_cores`, `carpool.twin.sim.host_slowdown`)."
        )
    if fitted.get("embed_fixed_ms") is not None:
        lines.append(
            f"- the serving latency outside the model (`fixed_ms` = {fitted['embed_fixed_ms']} "
            "ms per request, proxy + ingress + hops): the 1-client run's mean latency less the "
            "twin's."
        )
    steps = {
        k: v for k, v in (fitted.get("generation_step_overhead_ms") or {}).items() if v is not None
    }
    if steps:
        fixed = fitted.get("generation_fixed_ms") or {}
        lines.append(
            "- generation, per configuration, from its own 1-client calibration run (4 requests "
            "of 32 tokens, not among the figures): the latency from a call to the engine's "
            "inbox (`fixed_ms`: arrival collector, tokenizing, submission; the run's median "
            "time to first token less the twin's), "
            + ", ".join(f"{k} {fixed.get(k)} ms" for k in steps)
            + ", and the engine's work per step outside the forward passes (scheduling, "
            "sampling, detokenizing, streaming; the run's wall time less the twin's, over its "
            "engine steps), " + ", ".join(f"{k} {v} ms" for k, v in steps.items()) + "."
        )
    lines += [
        "",
        "## Scope",
        "",
        "The embed figures go through HTTP, Serve's proxy and the embed ingress, as the suite "
        "deploys serve.yaml's embed app (one torch thread, `thread_policy: reserved`), on one "
        "private Ray instance; closed-32 runs for the window given, half capacity is Poisson at "
        "half of closed-32's request rate, 3x is Poisson at three times it (300 requests, the "
        "suite's window). The configurations other than `default` change one knob each; the "
        "embed side was calibrated on `default` only, and no figure of any configuration was "
        "fitted on (each generation configuration has its own 1-client calibration run).",
    ]
    if gen:
        lines += [
            "",
            "Generation is carpool's **continuous** engine in process (no HTTP, as "
            "`benchmarks.generation_compare` runs it; SmolLM2-135M, greedy, `ignore_eos`, one "
            f"torch thread, `limits.max_seq_len` {gen.get('max_seq_len')}), closed loops of "
            "`generation_compare`'s workload (`max_tokens` spread over 8-256); not serve.yaml's "
            "`mode: vllm` small model, whose step costs no profile holds.",
        ]
    if trace:
        lines += [
            "",
            f"The conversation trace: {trace['requests']} requests of the Azure LLM inference "
            f"trace (conversation, 2023-11-16; `{trace['source']}`) from {trace['start_s']:g} s "
            f"in, **time scaled** so they arrive at {trace['rate']:g} requests/s on average "
            f"(bursts kept), **token counts times {trace['token_scale']:g}** (context and "
            "generated; prompts synthesized to that many tokens, outputs forced by "
            "`ignore_eos`), open loop. Trace: Azure Public Dataset, CC-BY 4.0; Patel et al., "
            '"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024.',
        ]
    lines += [
        "",
        "A configuration with an `error` in the measurement file is left out of the table.",
    ]
    # Hand-written sections kept beside the measurements, so the report can be regenerated.
    for extra in (
        ROOT / "benchmarks/results/twin-notes.md",
        ROOT / "benchmarks/results/twin-plan-check.md",
    ):
        if extra.exists():
            lines += ["", extra.read_text().rstrip()]
    return "\n".join(lines) + "\n"
