"""What every reliability command shares: the machine, output files, tables, load shares."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.deploy import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results" / "reliability"

# How a mixed load splits the machine: each endpoint's rate is load x share x its capacity,
# so the shares (summing to 1) say what part of the machine's time each one gets.
FAULT_SHARES = {"embed": 0.35, "rank": 0.15, "search": 0.2, "generate": 0.3}
SOAK_SHARES = {"embed": 0.5, "rank": 0.2, "search": 0.2, "generate": 0.1}
# Closed-loop clients for a capacity measurement: enough to keep the model busy, few enough
# that the latency admission bound (about 1 s of queued work) does not turn it into refusals.
# A search reranks several ~200-token chunks (seconds on this CPU), a generator runs 16 slots.
CAPACITY_CONCURRENCY = {"embed": 12, "rank": 4, "search": 2, "generate": 16}


def machine() -> dict[str, Any]:
    import psutil

    def version(mod: str) -> str:
        try:
            return __import__(mod).__version__
        except Exception:  # any import problem just means "unknown"
            return "?"

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if "model name" in ln), cpu)
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "ray": version("ray"),
        "torch": version("torch"),
        "loadavg": list(os.getloadavg()),
        # Environment that changes what is measured (inherited by every Ray worker).
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OMP_", "RAY_"))},
    }


def git_state() -> dict[str, Any]:
    def run(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": run("rev-parse", "--short", "HEAD").strip(),
        "dirty_files": [ln[3:] for ln in run("status", "--short").splitlines() if ln][:50],
    }


def shares_rates(
    shares: dict[str, float], capacities: dict[str, float], load: float
) -> dict[str, float]:
    """Per-endpoint rates so that the machine is ``load`` busy, split by ``shares``."""
    return {name: load * share * capacities[name] for name, share in shares.items()}


def parse_rates(items: Sequence[str]) -> dict[str, float]:
    """``["embed=10", "search=1.5"]`` or ``["embed=10,search=1.5"]`` -> dict."""
    out: dict[str, float] = {}
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"rate {part!r}: expected name=requests_per_second")
            out[name.strip()] = float(value)
    return out


def write_results(command: str, data: dict[str, Any], markdown: str, out: Path | None) -> Path:
    """Writes ``<command>-<time>.json`` and ``.md``; returns the JSON path."""
    folder = out or RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(data.get("started_at", time.time())))
    path = folder / f"{command}-{stamp}.json"
    path.write_text(json.dumps(_clean(data), indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(markdown)
    return path


def _clean(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:,.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (also readable as plain text on a terminal)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def statuses_text(hist: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in hist.items()) or "-"


def header_md(title: str, data: dict[str, Any]) -> str:
    m = data["machine"]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(data["started_at"]))
    return (
        f"# {title}\n\n"
        f"Measured {when} for {data['wall_s'] / 60:.1f} min: `{data['command']}`\n\n"
        f"Machine: {m['cpus']} cores ({m['cpu']}), {m['memory_gib']} GiB, no GPU; ray "
        f"{m['ray']}, torch {m['torch']}, Python {m['python']}. Load generator, HTTP proxy "
        f"and every replica share these cores. Load average before: "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg'])}. Deployment: "
        f"{data['deployment']}.\n"
    )
