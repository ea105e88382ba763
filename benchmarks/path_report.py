"""Summaries, within-round ratios and the table of ``python -m benchmarks path`` (pure).

``finish`` adds the summary (median over rounds, with min-max) and the ratios, each taken
within one round, to a results dict; ``render_table`` and ``write_markdown`` print them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.peers import median_spread, paired_ratios
from benchmarks.proc_cpu import CLASSES

REPORT_MD = Path(__file__).resolve().parent / "PATH.md"
# The generated block of PATH.md sits between these; the text around it is written by hand.
BEGIN, END = "<!-- path:begin -->", "<!-- path:end -->"

METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "req_per_s": lambda v: v["req_per_s"],
    "p50_ms": lambda v: v["latency_ms"]["p50"],
    "p99_ms": lambda v: v["latency_ms"]["p99"],
    "total_cpu_ms": lambda v: v["total_cpu_ms_per_req"],
    "path_cpu_ms": lambda v: v["path_cpu_ms_per_req"],
    "client_cpu_ms": lambda v: v["client_cpu_ms_per_req"]["process"],
    "outside_cores": lambda v: v.get("outside_cpu_cores", math.nan),
    **{f"{c}_ms": (lambda v, c=c: v["cpu_ms_per_req"].get(c, 0.0)) for c in CLASSES},
}
# (numerator system, denominator system, request kinds): req/s ratios within a round.
# A kind "a:b" compares the numerator's kind a with the denominator's kind b (carpool's embed
# app URL against Infinity's /v1/embeddings: the same request, each system's own URL).
RATIOS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("carpool", "carpool-previous", ("embed", "embed-prefix", "completion", "auto", "refused")),
    ("carpool", "carpool-python-proxy", ("embed", "rerank", "completion", "auto", "refused")),
    ("carpool", "infinity", ("embed", "embed-prefix:embed")),
    ("carpool", "serve-noop", ("embed", "embed-prefix:embed")),
    ("serve-noop", "serve-noop-python-proxy", ("embed",)),
    ("carpool", "vllm", ("completion",)),
)


def measured(value: Any) -> bool:
    return isinstance(value, dict) and "req_per_s" in value


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{system: {kind: {metric: median_spread}}}``; a row never measured keeps its error."""
    out: dict[str, dict[str, Any]] = {}
    for per_system in rounds:
        for system, rows in per_system.items():
            for kind, value in rows.items():
                if kind.startswith("_"):
                    continue
                slot = out.setdefault(system, {}).setdefault(kind, {"values": [], "error": None})
                if measured(value):
                    slot["values"].append(value)
                else:
                    slot["error"] = value.get("error")
    summary: dict[str, dict[str, Any]] = {}
    for system, kinds in out.items():
        for kind, slot in kinds.items():
            row: dict[str, Any] = {
                m: median_spread([f(v) for v in slot["values"]]) for m, f in METRICS.items()
            }
            row["n"] = len(slot["values"])
            row["one_process"] = any(v.get("one_process") for v in slot["values"])
            if not slot["values"]:
                row["error"] = slot["error"]
            summary.setdefault(system, {})[kind] = row
    return summary


def ratios(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """req/s ratios and the auto-minus-small CPU (AUTO_PAIRS), each within one round."""
    out: dict[str, dict[str, float]] = {}
    for num, den, kinds in RATIOS:
        for kind in kinds:
            num_kind, _, den_kind = kind.partition(":")
            wanted = {num: num_kind, den: den_kind or num_kind}
            per_round = [
                {
                    s: r[s][k]["req_per_s"]
                    for s, k in wanted.items()
                    if measured(r.get(s, {}).get(k))
                }
                for r in rounds
            ]
            if any(num in p and den in p for p in per_round):
                out[f"{num}/{den} req/s {kind}"] = paired_ratios(per_round, num, den)
    for auto, base in AUTO_PAIRS:
        for metric in ("total_cpu_ms_per_req", "path_cpu_ms_per_req"):
            diffs = [
                r["carpool"][auto][metric] - r["carpool"][base][metric]
                for r in rounds
                if measured(r.get("carpool", {}).get(auto))
                and measured(r.get("carpool", {}).get(base))
            ]
            if diffs:
                out[f"carpool {auto} - {base} {metric}"] = median_spread(diffs)
    return out


# A request naming auto less one naming small: auto - chat is the router's price (the same
# request); count-auto - count prices a request the cascade sends to large (path.make_probe).
AUTO_PAIRS = (("auto", "completion"), ("auto", "chat"), ("count-auto", "count"))


def finish(results: dict[str, Any]) -> None:
    results["summary"] = summarise(results["rounds"])
    results["ratios"] = ratios(results["rounds"])


def _num(v: dict[str, float] | float, digits: int = 1) -> str:
    x = v["median"] if isinstance(v, dict) else v
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def one_line(kind: str, value: dict[str, Any]) -> str:
    """A progress line for one probe."""
    if not measured(value):
        return f"{kind}: {value.get('error', '?')[:300]}"
    return (
        f"{kind}: {value['req_per_s']:.1f} req/s, p50/p99 {value['latency_ms']['p50']:.0f}/"
        f"{value['latency_ms']['p99']:.0f} ms, server {value['total_cpu_ms_per_req']:.2f} "
        f"CPU-ms/req (path {value['path_cpu_ms_per_req']:.2f}), client "
        f"{value['client_cpu_ms_per_req']['process']:.2f}, {value['answered']} answers in "
        f"{value['window_s']:.0f} s, outside {value.get('outside_cpu_cores', math.nan):.2f} cores"
    )


def render_table(results: dict[str, Any]) -> str:
    """Rows: system x request kind; CPU columns in ms per answered request (medians)."""
    summary = results.get("summary") or {}
    head = [
        "system",
        "request",
        "req/s",
        "p50 ms",
        "p99 ms",
        "server CPU",
        *CLASSES,
        "path CPU",
        "client CPU",
        "outside (cores)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: list[str] = []
    for system, kinds in summary.items():
        for kind, row in kinds.items():
            if row.get("error"):
                cells = ["n/a"] * (len(head) - 2)
                why = str(row["error"])[:300].replace("`", "'")  # kept inside one code span
                notes.append(f"- {system} {kind}: not measured: `{why}`")
            else:
                path = _num(row["path_cpu_ms"], 2) + (
                    " (whole process)" if row["one_process"] else ""
                )
                cells = [
                    _num(row["req_per_s"]),
                    _num(row["p50_ms"], 0),
                    _num(row["p99_ms"], 0),
                    _num(row["total_cpu_ms"], 2),
                    *[_num(row[f"{c}_ms"], 2) for c in CLASSES],
                    path,
                    _num(row["client_cpu_ms"], 2),
                    _num(row["outside_cores"], 2),
                ]
            lines.append("| " + " | ".join([system, kind, *cells]) + " |")
    rats = results.get("ratios") or {}
    if rats:
        lines += ["", "| within one round | median (min-max) |", "|---|---|"]
        lines += [
            f"| {k} | {_num(v, 2)} ({_num(v['min'], 2)}-{_num(v['max'], 2)}) |"
            for k, v in rats.items()
        ]
    return "\n".join(lines + (["", *notes] if notes else []))


def write_markdown(results: dict[str, Any], path: Path = REPORT_MD) -> None:
    """Replaces PATH.md's generated block (the hand-written text around it stays)."""
    rounds = len(results.get("rounds") or [])
    block = "\n".join(
        [
            BEGIN,
            f"`{results['command']}`, {results.get('finished', '?')}, {rounds} round(s), "
            f"{results['config']['clients']} clients, {results['config']['duration']:g} s windows; "
            f"load average before {results['machine']['loadavg_before'][0]:.2f}, after "
            f"{results['machine'].get('loadavg_after', [math.nan])[0]:.2f}; took "
            f"{results.get('wall_s', 0):.0f} s. CPU in ms per answered request (medians over "
            "rounds).",
            "",
            render_table(results),
            END,
        ]
    )
    text = path.read_text() if path.exists() else f"# The serving path's cost\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, foot = rest.partition(END)
    path.write_text(head + block + foot)
