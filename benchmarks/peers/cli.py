"""``python -m benchmarks peers``: its options, and the phases run in turn.

Each phase's result is saved to ``--out`` after every round (a run cut short keeps the rounds
it finished) and merged over the file's other phases; PEERS.md's generated block follows.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.embed import run_embed
from benchmarks.peers.generate import run_generate
from benchmarks.peers.install import INSTALLS, ensure_installed
from benchmarks.peers.mixed import run_mixed
from benchmarks.peers.process import load_note
from benchmarks.peers.report import json_default, merge_results, render_tables, write_report
from benchmarks.peers.settings import LOG_DIR, RESULTS_JSON
from carpool import local_ray


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "phase",
        nargs="?",
        choices=("all", "embed", "generate", "mixed", "install"),
        default="all",
        help="what to measure (install: only make the venvs)",
    )
    p.add_argument(
        "--systems",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="embed: carpool,infinity-torch,infinity-optimum; generate: carpool,vllm "
        "(vllm-allcores: no core reserved for its server; vllm-uni: the engine in process); "
        "mixed: carpool,carpool-allcores,infinity+vllm (carpool-<change>: a layout of "
        "benchmarks/peers/layouts.py)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=60.0, help="seconds per measured window")
    p.add_argument("--probe-s", type=float, default=20.0, help="shortest search probe, seconds")
    p.add_argument(
        "--confirm-max-s",
        type=float,
        default=300.0,
        help="longest confirmation window, seconds (it aims at --min-requests requests)",
    )
    p.add_argument(
        "--probe-max-s",
        type=float,
        default=120.0,
        help="longest search probe, seconds (a probe aims at --min-requests requests)",
    )
    p.add_argument("--max-probes", type=int, default=5)
    p.add_argument(
        "--min-requests",
        type=int,
        default=300,
        help="embeddings: a window ends after this many requests or --duration, whichever "
        "comes first (a p99 over 300 samples)",
    )
    p.add_argument("--no-search", action="store_true", help="skip the p99 <= 500 ms search")
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[4, 16, 64],
        help="generation clients, e.g. 4,16,64",
    )
    p.add_argument("--no-trace", action="store_true", help="skip the conversation trace")
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="generate: closed loops ask for whole answers, not streams (no TTFT/TPOT)",
    )
    p.add_argument("--trace", default="../shared/traces/AzureLLMInferenceTrace_conv.csv")
    p.add_argument("--trace-rate", type=float, default=1.0, help="replayed requests/s")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_JSON)
    p.add_argument("--no-report", action="store_true", help="do not touch PEERS.md")


def run(args: argparse.Namespace) -> int:
    os.environ.update(local_ray.ray_environment())
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.phase == "install":
        for spec in INSTALLS.values():
            print(f"{spec.name}: {ensure_installed(spec)}")
        return 0
    command = shlex.join([".venv/bin/python", "-m", "benchmarks", *sys.argv[1:]])
    t0 = time.monotonic()
    new: dict[str, Any] = {"command": command, "load_before": load_note()}
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = old
    phases = {"embed": run_embed, "generate": run_generate, "mixed": run_mixed}

    def save(phase: str, result: dict[str, Any]) -> None:
        # Saved after every round: a run stopped early keeps the rounds it finished.
        nonlocal results
        new[phase] = {**result, "command": command, "finished": time.strftime("%Y-%m-%d %H:%M")}
        new["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        new["wall_s"] = time.monotonic() - t0
        results = merge_results(old, new)
        args.out.write_text(json.dumps(results, indent=1, default=json_default) + "\n")
        if not args.no_report:
            write_report(results)

    for phase, measure in phases.items():
        if args.phase in ("all", phase):
            save(phase, measure(args, LOG_DIR, lambda r, phase=phase: save(phase, r)))
    print(render_tables(results))
    print(f"results: {args.out}; took {new['wall_s']:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks peers", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
