"""Results as JSON, a markdown report and PNG plots (matplotlib, Agg backend: no display)."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.trace import TRACE_ATTRIBUTION

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPORT_DIR = BENCH_DIR / "report"
README = BENCH_DIR / "README.md"
# Hand-written reading of the published numbers; the suite appends it to the README.
ANALYSIS = BENCH_DIR / "analysis.md"

COLORS = {"carpool": "#1f77b4", "naive": "#d62728", "serve-batch": "#ff7f0e", "offline": "#2ca02c"}


# --- machine ---------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, and how busy it was (other agents share it)."""
    import psutil

    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu_model"] = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")),
                platform.processor(),
            )
    except OSError:
        info["cpu_model"] = platform.processor()
    for module in ("torch", "ray", "transformers", "httpx"):
        try:
            info[module] = __import__(module).__version__
        except Exception:
            info[module] = None
    info["busiest_processes"] = busiest_processes()
    return info


def busiest_processes(sample_s: float = 1.0, top: int = 5) -> list[dict[str, Any]]:
    """Processes using the most CPU over ``sample_s`` (to say what else was running)."""
    import psutil

    procs = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            p.cpu_percent(None)
            procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    time.sleep(sample_s)
    usage = []
    for p in procs:
        try:
            cpu = p.cpu_percent(None)
            cmd = " ".join(p.info.get("cmdline") or [p.info.get("name") or ""])[:80]
            usage.append({"pid": p.pid, "cpu_percent": cpu, "cmd": cmd})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    usage.sort(key=lambda u: -u["cpu_percent"])
    return usage[:top]


# --- formatting helpers ----------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(headers: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |")
    return "\n".join(lines)


def run_row(name: str, run: dict[str, Any] | None) -> list[Any]:
    """A common row: throughput, latency percentiles, failures, batching."""
    if not run:
        return [name] + ["-"] * 12
    s, rep = run["summary"], run.get("replica", {})
    lat = s["latency_ms"]
    return [
        name,
        s["requests_per_s"],
        s["items_per_s"],
        s["tokens_per_s"],
        lat.get("p50"),
        lat.get("p90"),
        lat.get("p99"),
        lat.get("p99.9"),
        f"{s['ok']}/{s['sent']}",
        f"{s['errors']}/{s['rejected']}/{s['timeouts'] + s['cancelled']}",
        rep.get("mean_items_per_pass"),
        f"{100 * rep['padding_waste_ratio']:.0f}%" if "padding_waste_ratio" in rep else "-",
        "aborted" if run.get("aborted") else "",
    ]


RUN_HEADERS = [
    "system",
    "req/s",
    "items/s",
    "tokens/s",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "p99.9 ms",
    "ok/sent",
    "err/rej/timeout",
    "items/pass",
    "padding waste",
    "note",
]


# --- plots -----------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_VARIANT_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def _plain_log_ticks(axis: Any) -> None:
    """Log axes labelled 50, 100, 200 rather than 5x10^1 (minor labels overlap otherwise)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _color(name: str) -> str | None:
    """Fixed colours per system; carpool variants get their own, stable per name."""
    if name in COLORS:
        return COLORS[name]
    if name.startswith("carpool-"):
        return _VARIANT_COLORS[sum(map(ord, name)) % len(_VARIANT_COLORS)]
    return None


def plot_latency_throughput(results: dict[str, Any], path: Path) -> Path:
    """p50 and p99 latency against achieved items/s, per system, from every completed probe."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, search in results.get("search", {}).items():
        points = []
        for run in search["probes"]:
            if run.get("aborted"):
                continue  # truncated runs have no meaningful percentiles
            s = run["summary"]
            points.append((s["items_per_s"], s["latency_ms"]["p50"], s["slo_p99_ms"]))
        sat = results.get("saturation", {}).get(name)
        points.sort()
        if not points:
            continue
        xs = [p[0] for p in points]
        color = _color(name)
        ax.plot(xs, [p[2] for p in points], "o-", color=color, label=f"{name} p99")
        ax.plot(xs, [p[1] for p in points], "x--", color=color, alpha=0.6, label=f"{name} p50")
        if sat:
            ax.axvline(sat["summary"]["items_per_s"], color=color, ls=":", alpha=0.5)
    offline = results.get("offline", {}).get("best")
    if offline:
        ax.axvline(offline["items_per_s"], color=COLORS["offline"], lw=2, label="offline limit")
    slo = results.get("config", {}).get("slo_ms")
    if slo:
        ax.axhline(slo, color="grey", ls="--", lw=1, label=f"SLO p99 {slo:g} ms")
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    ax.set_xlabel("throughput (items/s, Poisson open loop)")
    ax.set_ylabel("latency (ms, log)")
    ax.set_title("Latency vs throughput, mixed-length embeddings (dotted: closed-loop saturation)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_batch_histograms(runs: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Forward passes by items per pass (carpool's metric buckets), one panel per system."""
    plt = _plt()
    names = [n for n, r in runs.items() if r and r.get("replica", {}).get("items_per_pass_buckets")]
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4 * max(1, len(names)), 3.6))
    axes = list(axes) if len(names) > 1 else [axes]
    for ax, name in zip(axes, names, strict=False):
        rep = runs[name]["replica"]
        buckets = rep["items_per_pass_buckets"]
        labels = list(buckets)
        counts = [buckets[k] for k in labels]
        ax.bar(range(len(labels)), counts, color=_color(name))
        ax.set_xticks(range(len(labels)), [f"<={k}" for k in labels], rotation=60, fontsize=7)
        ax.set_title(
            f"{name}: mean {rep.get('mean_items_per_pass', 0):.1f} items/pass\n"
            f"padding waste {100 * rep.get('padding_waste_ratio', 0):.0f}%",
            fontsize=9,
        )
        ax.set_xlabel("items per forward pass")
        ax.set_ylabel("passes")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdf(runs: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        lat = sorted(run.get("latencies_ms") or [])
        if not lat:
            continue
        ys = [(i + 1) / run["summary"]["sent"] for i in range(len(lat))]
        ax.plot(lat, ys, label=name, color=_color(name))
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    ax.set_xlabel("latency (ms, log)")
    ax.set_ylabel("share of requests answered")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_offline(offline: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for order, style in (("sorted", "o-"), ("arrival", "s--")):
        pts = sorted(
            (p["batch_size"], p["items_per_s"]) for p in offline["points"] if p["order"] == order
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{order} order")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (texts per forward pass)")
    ax.set_ylabel("items/s")
    ax.set_title(
        f"Offline limit: bare model, {offline['torch_threads']} torch thread(s)", fontsize=10
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def suite_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    if results.get("search"):
        made.append(plot_latency_throughput(results, out_dir / "latency_vs_throughput.png"))
        best = {n: s.get("best") for n, s in results["search"].items() if s.get("best")}
        if best:
            made.append(
                plot_batch_histograms(
                    best,
                    out_dir / "batch_sizes_at_slo.png",
                    "Items per forward pass at each system's highest rate with p99 <= SLO",
                )
            )
    if results.get("trace", {}).get("runs"):
        runs = results["trace"]["runs"]
        made.append(plot_latency_cdf(runs, out_dir / "trace_latency_cdf.png", "Azure trace replay"))
        made.append(
            plot_batch_histograms(runs, out_dir / "batch_sizes_trace.png", "Azure trace replay")
        )
    if results.get("bursty", {}).get("runs"):
        made.append(
            plot_latency_cdf(
                results["bursty"]["runs"], out_dir / "bursty_latency_cdf.png", "Bursty on/off"
            )
        )
    if results.get("offline", {}).get("points"):
        made.append(plot_offline(results["offline"], out_dir / "offline_limit.png"))
    return made


def runs_plots(runs: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Plots for an ad-hoc ``run``: latency CDF per run and batch histograms."""
    out_dir.mkdir(parents=True, exist_ok=True)
    keyed = {r["label"].replace(" embed-mixed", ""): r for r in runs}
    made = [plot_latency_cdf(keyed, out_dir / "latency_cdf.png", "latency")]
    made.append(plot_batch_histograms(keyed, out_dir / "batch_sizes.png", "items per forward pass"))
    curve = [r for r in runs if r["arrival"]["kind"] == "poisson" and not r.get("aborted")]
    if len(curve) > 1:
        by_system: dict[str, list[dict[str, Any]]] = {}
        for r in curve:
            by_system.setdefault(r["system"], []).append(r)
        made.append(
            plot_latency_throughput(
                {"search": {n: {"probes": rs} for n, rs in by_system.items()}},
                out_dir / "latency_vs_throughput.png",
            )
        )
    return made


# --- markdown --------------------------------------------------------------------------


def _machine_md(results: dict[str, Any]) -> str:
    m = results.get("machine_before", {})
    after = results.get("machine_after", {})
    busy = ", ".join(
        f"{p['cmd'].split('/')[-1][:40]} {p['cpu_percent']:.0f}%"
        for p in m.get("busiest_processes", [])[:3]
        if p["cpu_percent"] >= 5
    )
    return (
        f"{m.get('cpu_count')} cores ({m.get('cpu_model')}), {m.get('memory_gib')} GiB, no GPU; "
        f"{m.get('platform')}; Python {m.get('python')}, torch {m.get('torch')}, ray "
        f"{m.get('ray')}, transformers {m.get('transformers')}. Load average (1/5/15 min) "
        f"{m.get('loadavg')} before, {after.get('loadavg')} after; busiest processes at the "
        f"start: {busy or 'none above 5% CPU'}."
    )


def _window(scaling: dict[str, Any]) -> str:
    window = scaling.get("window_s")
    return f"{window[0]:.0f}-{window[1]:.0f} s" if window else "?"


def suite_markdown(results: dict[str, Any], image_prefix: str = "") -> str:
    """The suite report. ``image_prefix`` points image links at where the PNGs are."""
    cfg = results.get("config", {})
    head = results.get("headline", {})
    slo = head.get("slo_ms", cfg.get("slo_ms", 500))
    wl = results.get("workload", {})
    res = cfg.get("resources", {})
    out: list[str] = []
    out.append(
        f"Measured {results.get('machine_before', {}).get('time', '?')} in "
        f"{results.get('duration_s', 0) / 60:.1f} min with:\n"
    )
    out.append(f"```\n{results.get('command', '.venv/bin/python -m benchmarks suite')}\n```\n")
    if results.get("rendered_with"):
        out.append(f"Report rendered from its results.json with `{results['rendered_with']}`.\n")
    out.append(f"**Machine.** {_machine_md(results)}\n")
    out.append(
        f"**Setup.** Every system serves `{res.get('model')}` from one Serve instance on "
        f"127.0.0.1 (HTTP proxy), each model replica with num_cpus {res.get('num_cpus')} and "
        f"{res.get('torch_threads')} torch thread(s), measured one after another in this run. "
        f"Load: asyncio + httpx on the same machine, base64 responses (as the OpenAI SDK asks). "
        f"Workload `embed-mixed`: {wl.get('texts_min')}-{wl.get('texts_max')} texts per request "
        f"(mean {fmt(wl.get('mean_texts_per_request'), 2)}), text lengths log-normal "
        f"(median {wl.get('lengths', {}).get('median')}, sigma {wl.get('lengths', {}).get('sigma')}) "
        f"clipped to {wl.get('lengths', {}).get('low')}-{wl.get('lengths', {}).get('high')} "
        f"tokens; the model truncates at 256.\n"
    )
    systems = results.get("systems", {})
    if systems:
        out.append("Systems:\n")
        for name, s in systems.items():
            out.append(f"- `{name}` ({s['prefix']}): {s['description']}")
        batching = systems.get("carpool", {}).get("args", {}).get("embedder", {}).get("batching")
        if batching:
            out.append(f"\ncarpool batching knobs: `{json.dumps(batching)}`\n")
        out.append("")

    # headline
    out.append(f"### Highest rate with p99 <= {slo:g} ms (Poisson arrivals, mixed lengths)\n")
    rows = []
    search = results.get("search", {})
    for name in search:
        best = search[name].get("best")
        r = run_row(name, best)
        rows.append([r[0], head.get("rows", {}).get(name, {}).get("max_rate_rps"), *r[1:]])
    off = head.get("offline_items_per_s")
    if off:
        rows.append(
            [
                f"offline limit (batch {head.get('offline_batch_size')}, sorted)",
                "-",
                "-",
                off,
                results.get("offline", {}).get("best", {}).get("tokens_per_s"),
            ]
            + ["-"] * 9
        )
    out.append(table(["system", "max rate req/s", *RUN_HEADERS[1:]], rows))
    out.append("")
    ratios = head.get("ratios", {})
    if ratios:
        out.append("**Ratios** (items/s at each system's highest rate with p99 within the SLO):\n")
        for key, value in ratios.items():
            target = head.get("targets", {}).get(key)
            met = head.get("met", {}).get(key)
            verdict = (
                "" if target is None else f" (target >= {target:g}: {'met' if met else 'missed'})"
            )
            out.append(f"- {key}: **{fmt(value, 2)}x**{verdict}")
        out.append("")
    out.append(
        "Latency percentiles are over successful requests, measured from each request's "
        "scheduled arrival. The SLO test counts failed requests as infinitely slow. "
        "`items/pass` and `padding waste` come from the replica's stats, before/after deltas.\n"
    )
    if results.get("search"):
        out.append(f"![latency vs throughput]({image_prefix}latency_vs_throughput.png)\n")
        out.append(f"![batch sizes at the SLO rate]({image_prefix}batch_sizes_at_slo.png)\n")

    # model
    model = results.get("model")
    if model:
        cm = model["cost_model"]
        out.append(f"### Model: the same policies without serving or noise (p99 <= {slo:g} ms)\n")
        out.append(
            f"A discrete-event model (`benchmarks/simulate.py`) replays the same requests with "
            f"Poisson arrivals for {model['seconds']:g} simulated seconds per rate, each forward "
            f"pass costing {cm['per_pass_ms']:.1f} ms + {cm['per_padded_token_ms']:.3f} ms per "
            f"padded token (fitted to the offline runs), with carpool's own splitters and "
            f"@serve.batch's collection as Ray 2.60 does it. No HTTP, no hops, no contention: "
            f"the gap to the measured table is what serving costs here.\n"
        )
        rows = [
            [
                name,
                m["max_rate_rps"],
                m["items_per_s"],
                m["p50_ms"],
                m["p99_ms"],
                m["overload_items_per_s"],
            ]
            for name, m in model["systems"].items()
        ]
        out.append(
            table(
                ["policy", "max rate req/s", "items/s", "p50 ms", "p99 ms", "items/s overloaded"],
                rows,
            )
        )
        out.append("")

    # saturation
    if results.get("saturation"):
        c = cfg.get("saturation_concurrency")
        out.append(f"### Saturation: closed loop, {c} concurrent requests\n")
        out.append(table(RUN_HEADERS, [run_row(n, r) for n, r in results["saturation"].items()]))
        out.append("")

    # bursty
    bursty = results.get("bursty", {})
    if bursty.get("runs"):
        out.append(
            f"### Bursty on/off: mean {fmt(bursty['mean_rate'], 2)} req/s "
            f"({cfg.get('bursty_on_s')} s on at "
            f"{fmt(bursty['mean_rate'] * (cfg.get('bursty_on_s', 1) + cfg.get('bursty_off_s', 1)) / cfg.get('bursty_on_s', 1), 2)} req/s, "
            f"{cfg.get('bursty_off_s')} s off; {cfg.get('bursty_load')} of the offline limit)\n"
        )
        out.append(table(RUN_HEADERS, [run_row(n, r) for n, r in bursty["runs"].items()]))
        out.append(f"\n![bursty latency CDF]({image_prefix}bursty_latency_cdf.png)\n")

    # trace
    trace = results.get("trace", {})
    if trace.get("runs"):
        sc = trace["scaling"]
        out.append(
            f"### Production trace replay: {sc['requests']} requests in {cfg.get('trace_s')} s "
            f"({fmt(trace['rate'], 2)} req/s)\n"
        )
        out.append(
            f"Scale factors: time compressed **{sc['time_factor']:.2f}x** (trace window "
            f"{_window(sc)} of the hour), context tokens x "
            f"**{sc['token_scale']:g}** (one text per request, clipped to 4-512; mean "
            f"{sc['context_tokens_mean']:.0f}, p50 {sc['context_tokens_p50']:.0f}), generated "
            f"tokens x {sc['generated_token_scale']:g} (unused for embeddings). Rate: "
            f"{cfg.get('trace_load')} of the offline limit's token throughput.\n"
        )
        out.append(table(RUN_HEADERS, [run_row(n, r) for n, r in trace["runs"].items()]))
        out.append(f"\n![trace latency CDF]({image_prefix}trace_latency_cdf.png)\n")
        out.append(f"![trace batch sizes]({image_prefix}batch_sizes_trace.png)\n")
        out.append(f"Trace: {TRACE_ATTRIBUTION}\n")

    # offline
    offline = results.get("offline", {})
    if offline.get("points"):
        out.append(
            f"### Offline limit: {offline['items']} texts ({offline['real_tokens']} tokens), "
            f"{offline['torch_threads']} torch thread(s), no serving\n"
        )
        out.append(
            table(
                ["order", "batch size", "items/s", "tokens/s", "padded tokens/s"],
                [
                    [
                        p["order"],
                        p["batch_size"],
                        p["items_per_s"],
                        p["tokens_per_s"],
                        p["padded_tokens_per_s"],
                    ]
                    for p in offline["points"]
                ],
            )
        )
        cm = offline.get("cost_model")
        if cm:
            out.append(
                f"\nFitted cost of a forward pass: **{cm['per_pass_ms']:.1f} ms per pass + "
                f"{cm['per_padded_token_ms']:.3f} ms per padded token**, so one pass costs as much "
                f"as ~{cm['pass_overhead_tokens']:.0f} tokens (carpool's `pass_overhead_tokens`)."
            )
        out.append(f"\n![offline limit]({image_prefix}offline_limit.png)\n")

    # search log
    if results.get("search"):
        out.append("### Search probes\n")
        probe_rows = []
        for name, s in results["search"].items():
            for run in s["probes"]:
                sm = run["summary"]
                probe_rows.append(
                    [
                        name,
                        run["tags"].get("rate"),
                        sm["items_per_s"],
                        sm["latency_ms"]["p50"],
                        sm["slo_p99_ms"],
                        f"{sm['ok']}/{sm['sent']}",
                        "pass" if run["tags"].get("passed") else "fail",
                        run.get("aborted") or "",
                    ]
                )
        out.append(
            table(
                [
                    "system",
                    "offered req/s",
                    "items/s",
                    "p50 ms",
                    "p99 ms (SLO)",
                    "ok/sent",
                    "SLO",
                    "note",
                ],
                probe_rows,
            )
        )
        out.append("")
    return "\n".join(out)


def runs_markdown(results: dict[str, Any]) -> str:
    out = [f"```\n{results.get('command')}\n```\n", f"**Machine.** {_machine_md(results)}\n"]
    out.append(table(["run", *RUN_HEADERS[1:]], [run_row(r["label"], r) for r in results["runs"]]))
    for r in results["runs"]:
        trace = r.get("workload_description", {}).get("trace")
        if trace:
            out.append(
                f"\n{r['label']}: trace time compressed {trace['time_factor']:.2f}x, tokens x "
                f"{trace['token_scale']:g}. {TRACE_ATTRIBUTION}"
            )
    return "\n".join(out) + "\n"


# --- writing ---------------------------------------------------------------------------


def new_results_dir(root: Path = RESULTS_DIR) -> Path:
    path = root / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(results: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(results, indent=1, default=_json_default, allow_nan=True))
    return path


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


README_HEAD = """# carpool benchmarks

Batching strategies side by side under realistic load, against the plain alternatives and
the model's own limit. Generated by `python -m benchmarks suite` (`make bench`); the harness
is in this folder, raw results of every run go to `benchmarks/results/<timestamp>/`
(git-ignored), the PNGs below to `benchmarks/report/`.

## How to run

```
make bench                                   # the standard suite (about 12-13 min on 2 cores)
.venv/bin/python -m benchmarks suite --quick # a 3-4 min check of the harness
.venv/bin/python -m benchmarks run --system carpool --system naive --arrival poisson --rate 10
.venv/bin/python -m benchmarks run --url http://127.0.0.1:8000 --prefix /embed --arrival closed --concurrency 16
.venv/bin/python -m benchmarks run --system carpool --workload trace --arrival replay --rate 20
.venv/bin/python -m benchmarks run --system carpool --workload my.jsonl --arrival sweep --rates 5,10,20
.venv/bin/python -m benchmarks offline       # the bare model's throughput by batch size
.venv/bin/python -m benchmarks trace-info    # the trace window and scale factors for a rate
.venv/bin/python -m benchmarks suite --systems carpool,carpool-wide --variant 'small={"max_batch_tokens": 2048}' --phases saturation,search
.venv/bin/python -m benchmarks report benchmarks/results/<time>/results.json --readme
```

The suite starts its own Ray (token auth off, no dashboard) and Serve on 127.0.0.1:8100
(`--port`), deploys carpool's `pipelines.embed` app (serve.yaml's knobs, overridable with
`--carpool-batching '{...}'`) and the two baselines beside it, each with its own route prefix
and `/v1/stats`, then measures them one after another. `run` does the same for the systems
named, or drives any server already running (`--url`). Workloads: `embed-mixed`,
`rank-mixed` (built-in generators), `trace` (the Azure trace), or a JSONL file of request
bodies (`{"input": [...]}`, `{"query": ..., "documents": [...]}`, optional `arrival_s`).
Arrivals: `poisson`, `bursty`, `sweep` (Poisson at each of `--rates`), `search` (highest rate
within the SLO), `closed` (fixed concurrency), `replay` (the workload's own times).
`--variant NAME='{knobs}'` adds carpool deployments with other batching knobs to the same run;
`carpool-wide` is a former experiment, now carpool's default (`experimental.py`); `report`
re-renders a suite's report, plots and (with `--readme`) this file from its `results.json`.
Tests of the harness itself (no speed claims): `tests/unit/test_bench_harness.py`,
`tests/integration/test_bench_smoke.py` (a fake server with known latency).

## Results

"""


def write_readme(results: dict[str, Any], readme: Path = README) -> Path:
    body = suite_markdown(results, image_prefix="report/")
    analysis = ANALYSIS.read_text() if ANALYSIS.is_file() else ""
    readme.write_text(README_HEAD + body + "\n" + (f"\n{analysis.strip()}\n" if analysis else ""))
    return readme
