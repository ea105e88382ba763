"""TWIN.md: the twin beside the harness, as ``benchmarks.twin_report`` computed it."""

from __future__ import annotations

from typing import Any

from benchmarks.twin_common import ROOT


def _each(values: list[Any], fmt: str = "{}") -> str:
    """One fitted value per round, as ``a / b / c`` (one value when all rounds agree)."""
    shown = [fmt.format(v) for v in values if v is not None]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _table(doc: dict) -> list[str]:
    rounds = doc.get("rounds", 1)
    if rounds == 1:
        head = ["| configuration | figure | measured | twin | error |", "|---|---|---|---|---|"]
    else:
        head = [
            "| configuration | figure | measured | twin | error | measured, each round | spread |",
            "|---|---|---|---|---|---|---|",
        ]
    for r in doc["figures"]:
        row = (
            f"| {r['config']} | {r['figure']} | {r['measured']:,.1f} | {r['twin']:,.1f} | "
            f"{100 * r['error']:+.1f}% |"
        )
        if rounds > 1:
            each = " / ".join(f"{v:,.1f}" for v in r.get("measured_rounds", []))
            row += f" {each} | {100 * r.get('spread', 0):.0f}% |"
        head.append(row)
    return head


def markdown(doc: dict, measured: dict, first: dict) -> str:
    """``measured``: the measurement file; ``first``: its first round (what each round ran)."""
    fits: list[dict[str, Any]] = doc["fitted"]  # one per round
    fit0 = fits[0]
    gen = first.get("generation") or {}
    trace = (gen.get("default") or {}).get("trace")
    rounds = doc.get("rounds", 1)
    spread = doc.get("median_measured_spread")
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
    ]
    if rounds > 1:
        lines += [
            "",
            f"Every configuration was measured {rounds} times, the configurations interleaved "
            "in each round; each round's twin is fitted on that round's calibration runs and "
            "predicts that round's requests and arrivals. A figure is the **median over the "
            "rounds** of the measured value and of the predicted one, and its error is between "
            "the two medians. The spread is how far the harness's own figure moved between "
            f"rounds ((largest - smallest) / median; median over the figures {100 * spread:.0f}%)"
            if spread is not None
            else "",
        ]
    lines += ["", *_table(doc), "", "## What is fitted, and on what", ""]
    scaled = fit0.get("embed_pass_scale") is not None
    passes = (
        "the embedder's passes as its deployed replica ran them, one request of each of the "
        "profile's shapes at a time, on the default configuration before its phases "
        "(`carpool_twin serving-profile`); the generator's bare steps"
        if doc.get("embed_passes_from") == "serving"
        else "bare forward passes, no serving"
    )
    lines.append(
        f"Nothing is fitted on a figure above. The passes cost what the profile measured ({passes})"
        + (", times what serving added to a pass in the calibration run" if scaled else "")
        + ". Fitted on calibration runs, none of them among the figures (for embed, the "
        "**default** configuration's idle window of the deployed cluster and its 1- and "
        "8-client closed loops)" + (", one value per round" if rounds > 1 else "") + ":"
    )
    if scaled:
        lines.append(
            "- what serving adds to each embedder pass: **"
            + _each([f.get("embed_pass_scale") for f in fits], "{:.3f}")
            + "x** the profile's price, the replica's own record of its passes' wall time in "
            "the 1-client run (`/v1/stats`) over the twin's price of the same requests' passes "
            "(`carpool_twin.calibrate.serving_pass_scale`; `PoolSpec.pass_scale`)."
        )
    hosts = [f.get("embed_host") for f in fits if f.get("embed_host")]
    if hosts:
        lines.append(
            "- the serving path's host CPU, read from /proc (CPU seconds of the load generator "
            "and every process of the Ray cluster): "
            + _each([h["background_cores"] for h in hosts])
            + " cores busy idle, and **"
            + _each([h["cpu_ms_per_request"] for h in hosts])
            + " ms of CPU per request** outside the model's passes (proxy, ingress, the "
            "replica's request handling, the load generator; the passes are what the twin "
            "prices them at on the same requests). The twin runs the passes on a host of "
            f"{hosts[0]['cores']:g} cores that this demand shares: while the passes and the "
            "serving path together want more than the cores, every runnable thread slows "
            "alike (processor sharing; `Overheads.host_cores`, `carpool_twin.sim.host_slowdown`)."
        )
    loaded = [f.get("embed_loaded_pass_scale") for f in fits]
    if any(v is not None for v in loaded):
        lines.append(
            "- what an embedder pass costs under load: **"
            + _each(loaded, "{:.3f}")
            + "x** the profile's price, the replica's ms per padded token in the 8-client run "
            "(`/v1/stats`) over the twin's for its passes of the same load "
            "(`benchmarks.twin_report.loaded_pass_scale`). The 1-client run cannot show it: "
            "there a pass runs while the rest of the serving path waits for it."
        )
    if fit0.get("embed_fixed_ms") is not None:
        lines.append(
            "- the serving latency outside the model (`fixed_ms` = "
            + _each([f.get("embed_fixed_ms") for f in fits])
            + " ms per request, proxy + ingress + hops): the 1-client run's mean latency less "
            "the twin's."
        )
    for name in fit0.get("generation_step_overhead_ms") or {}:

        def per(key: str, fmt: str = "{}", name: str = name) -> str:
            return _each([(f.get(key) or {}).get(name) for f in fits], fmt)

        lines.append(
            f"- generation `{name}`, from its own calibration runs (1 client x 4 requests and 8 "
            "clients x 16 requests, 32 tokens each, not among the figures): the latency from a "
            "call to the engine's inbox (`fixed_ms`, arrival collector, tokenizing, submission: "
            f"the 1-client run's median time to first token less the twin's) {per('generation_fixed_ms')} "
            "ms; the engine's work outside the forward passes (scheduling, sampling, "
            f"detokenizing, streaming) {per('generation_step_overhead_ms')} ms per step plus "
            f"{per('generation_seq_overhead_ms')} ms per sequence in the step (the two that make "
            "the twin's wall time match both runs')."
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
        "fitted on (each generation configuration has its own calibration runs).",
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
