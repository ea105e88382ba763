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
    """The suite's figures are tables now; the offline limit keeps its curve."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if results.get("offline", {}).get("points"):
        return [plot_offline(results["offline"], out_dir / "offline_limit.png")]
    return []


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


def spread(entry: dict[str, Any] | None, digits: int = 1) -> str:
    """``median (min-max)`` of a paired figure; the rounds' spread beside its median."""
    if not entry or entry.get("median") is None:
        return "-"
    lo, hi, med = entry["min"], entry["max"], entry["median"]
    if lo == hi:
        return fmt(float(med), digits)
    return f"{fmt(float(med), digits)} ({fmt(float(lo), digits)}-{fmt(float(hi), digits)})"


def headline_markdown(results: dict[str, Any]) -> str:
    """The headline: every ratio the issue names, median (spread) over paired rounds."""
    head = results.get("headline") or {}
    rows = []
    for key, f in (head.get("figures") or {}).items():
        met = {True: "met", False: "**missed**", None: "-"}[f.get("met")]
        digits = 0 if key.endswith("refused") else 2
        if f.get("not_held"):
            value = f"not held: {f['not_held']}"
        elif f.get("undefined"):
            value = f"undefined: {f['undefined']}"
        else:
            value = spread(f, digits) + (f" ({f['basis']})" if f.get("basis") else "")
        rows.append([f"`{key}`", f["what"], value, f.get("target") or "-", met])
    return table(["key", "what", "median (min-max)", "target", ""], rows)


def _row(name: str, m: dict[str, Any], *extra: Any) -> list[Any]:
    return [
        name,
        *extra,
        spread(m.get("items_per_s")),
        spread(m.get("p50_ms"), 0),
        spread(m.get("p99_ms"), 0),
        spread(m.get("refused"), 0),
        spread(m.get("lost"), 0),
    ]


_COLS = ["items/s", "p50 ms", "p99 ms", "refused", "lost"]


def suite_markdown(results: dict[str, Any], image_prefix: str = "") -> str:
    """Paired tables: each cell is the median over rounds with the min-max in brackets."""
    c = results.get("config", {})
    rounds = c.get("rounds", "?")
    out = [
        f"Run: `{results.get('command', '?')}` "
        f"({fmt((results.get('duration_s') or 0) / 60, 0)} min). {_machine_md(results)}",
        "",
        f"Paired: the systems take turns in {rounds} rounds (A B C, B C A, ...); every cell is "
        "the median of the rounds with the min-max beside it, and every ratio is taken round "
        f"by round before the median. A window is {c.get('window_requests')} requests or "
        f"{fmt(c.get('window_s'), 0)} s, whichever comes first. Client timeout "
        f"{fmt(c.get('client_timeout_s'), 0)} s, so a queued request is not counted lost.",
        "",
        "### Headline",
        "",
        headline_markdown(results),
    ]
    if sat := results.get("saturation"):
        out += [
            "",
            f"### Capacity: closed loop, {c.get('concurrency')} clients (Retry-After honoured)",
            "",
        ]
        out.append(table(["system", *_COLS], [_row(n, m) for n, m in sat.items()]))
    if slo := results.get("slo"):
        out += [
            "",
            f"### Highest Poisson rate with p99 <= {fmt(c.get('slo_ms'), 0)} ms, and with p99 "
            f"slowdown <= {fmt(c.get('slo_slowdown'), 0)}",
            "",
            "A request's slowdown is its latency over its own latency on the idle system "
            "(every distinct request of the pool measured alone, fastest of "
            f"{c.get('idle_passes')}). Each system's rate was searched once with short probes "
            f"({c.get('search_requests')} requests, starting at 0.7 of its capacity), then "
            "confirmed in the paired rounds shown here.",
            "",
        ]
        rows = []
        for name, node in slo.items():
            for crit, label in (("slo_ms", "p99 <= SLO"), ("slowdown", "slowdown")):
                m = node.get(crit)
                if m:
                    passed = f"{m.get('passed_rounds')}/{len(m.get('windows', []))}"
                    rows.append(_row(name, m, label, fmt(m.get("rate"), 2), passed))
        out.append(table(["system", "criterion", "rate req/s", "rounds passed", *_COLS], rows))
        idle = results.get("idle", {})
        out += [
            "",
            "Idle latency: "
            + "; ".join(
                f"{n} p50 {fmt(v.get('p50_ms'), 0)} ms, max {fmt(v.get('max_ms'), 0)} ms"
                for n, v in idle.items()
            )
            + ".",
        ]
    if gp := results.get("goodput"):
        out += [
            "",
            "### Goodput: clients that ignore Retry-After, and Poisson overload",
            "",
            "Accepted (2xx) items/s; the ratios divide by the `capacity` row: 32 closed-loop "
            "clients honouring Retry-After, measured at the start of each round.",
            "",
        ]
        rows = [_row(name, m, cond) for name, runs in gp.items() for cond, m in runs.items()]
        out.append(table(["system", "load", *_COLS], rows))
    if light := results.get("light"):
        out += ["", f"### Light load: Poisson at {c.get('light_load')} of naive's capacity", ""]
        rows = [
            _row(n, m, fmt(m.get("rate"), 2))
            for n, m in light.items()
            if not n.endswith("_capacity")
        ]
        out.append(table(["system", "rate req/s", *_COLS], rows))
    for key, what in (("burst", "Burst: requests sent at once"), ("bulk", "Bulk clients")):
        if node := results.get(key):
            out += ["", f"### {what} (carpool)", ""]
            out.append(table(["", *_COLS], [_row(key, node)]))
    if off := results.get("offline", {}).get("best"):
        out += [
            "",
            f"Offline limit (the bare model, no serving): {fmt(off.get('items_per_s'))} items/s "
            f"at batch {off.get('batch_size')}.",
            "",
            f"![offline limit]({image_prefix}offline_limit.png)",
        ]
    return "\n".join(out) + "\n"


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


HEADLINE_JSON = BENCH_DIR / "headline.json"
RESULTS_HEADING = "## Results"


def write_readme(results: dict[str, Any], readme: Path = README) -> Path:
    """Rewrites the results section of README.md (everything above it is hand-written) and
    writes headline.json beside it."""
    text = readme.read_text() if readme.is_file() else "# carpool benchmarks\n\n"
    head = text.split(RESULTS_HEADING)[0].rstrip() + "\n\n"
    body = suite_markdown(results, image_prefix="report/")
    analysis = ANALYSIS.read_text() if ANALYSIS.is_file() else ""
    readme.write_text(
        head + RESULTS_HEADING + "\n\n" + body + (f"\n{analysis.strip()}\n" if analysis else "")
    )
    headline = {
        "command": results.get("command"),
        "started_at": results.get("started_at"),
        **(results.get("headline") or {}),
    }
    write_json(headline, readme.parent / HEADLINE_JSON.name)
    return readme
