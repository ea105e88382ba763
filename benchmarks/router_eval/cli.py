"""Router evaluation: length predictor, lanes vs FIFO, and the small-first cascade.

``python -m benchmarks.router_eval [--part predictor|lanes|cascade] [--refresh]`` runs real
models in-process (no Ray): ``GeneratorServer`` over the continuous engine, and for lanes
``RouterServer`` in front of it. It prints tables, merges the figures into
``benchmarks/results/router_eval.json`` and rewrites ``benchmarks/ROUTER.md`` from them.

- predictor: true output lengths of the small model (greedy, max_tokens 192) on
  ``data/router_prompts.jsonl``, cached in ``data/router_lengths.json`` (``--refresh``
  regenerates); ``LengthPredictor`` learns online on a training split, is scored on the rest.
- lanes: the same Poisson trace of short and long requests through the router twice, one
  FIFO lane and then shortest-first lanes, at ~80% of a capacity measured first.
- cascade: small and large answer ``data/router_questions.jsonl`` once each; the
  ``min_mean_logprob`` threshold is then swept offline over the recorded outcomes.

The metric functions are pure and unit-tested (tests/unit/test_router_eval.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.router_eval.cascade import part_cascade
from benchmarks.router_eval.lanes import part_lanes
from benchmarks.router_eval.models import ENGINES
from benchmarks.router_eval.predictor import part_predictor
from benchmarks.router_eval.report import write_report
from benchmarks.router_eval.settings import REPORT_PATH, RESULTS_PATH, THREADS


def merge_lanes(results: dict[str, Any], engine: str, result: dict[str, Any]) -> None:
    """Stores one engine's lanes result beside the other engines' last ones.

    A lanes result from before the engine was a choice (no ``engines`` key) is dropped.
    """
    engines = (results.get("lanes") or {}).get("engines", {})
    results["lanes"] = {"engines": {**engines, engine: result}}


def lanes_command(executable: str, argv: Sequence[str], cwd: Path | None = None) -> str:
    """The command line as run, the interpreter shown relative to the repo or home."""
    exe = Path(executable)
    for base, shown in ((cwd or Path.cwd(), ""), (Path.home(), "~/")):
        if exe.is_relative_to(base):
            exe_text = shown + str(exe.relative_to(base))
            break
    else:
        exe_text = str(exe)
    return " ".join([exe_text, "-m", "benchmarks.router_eval", *argv])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_eval", description=__doc__)
    parser.add_argument("--part", choices=("predictor", "lanes", "cascade", "all"), default="all")
    parser.add_argument("--refresh", action="store_true", help="regenerate the true lengths")
    parser.add_argument("--lane-requests", type=int, default=80)
    # 0.95 of the probe's estimate, which its drain tail makes low: close to 80% in practice.
    parser.add_argument("--lane-load", type=float, default=0.95, help="share of capacity")
    parser.add_argument(
        "--aging",
        type=float,
        default=5.0,
        help="lanes' aging_tokens_per_s (router default 50; a CPU model decoding ~30-40 "
        "tokens/s in all wants far less, or aging undoes the priority within seconds)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="compute threads per model: torch's, or vLLM's OpenMP threads bound to cores 0..n-1",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="continuous",
        help="generation engine under the lanes part; vllm needs the vLLM venv "
        "(make vllm-venv, docs/vllm.md); other parts always use the continuous engine",
    )
    args = parser.parse_args(argv)
    THREADS["torch"] = args.threads
    results: dict[str, Any] = {}
    if RESULTS_PATH.exists():  # parts run alone update their section, keep the others
        results = json.loads(RESULTS_PATH.read_text())
    parts = ("predictor", "lanes", "cascade") if args.part == "all" else (args.part,)
    for part in parts:
        start = time.perf_counter()
        if part == "predictor":
            result = results["predictor"] = part_predictor(args.refresh)
        elif part == "lanes":
            result = part_lanes(args.lane_requests, args.lane_load, args.aging, engine=args.engine)
            result["command"] = lanes_command(
                sys.executable, sys.argv[1:] if argv is None else argv
            )
            merge_lanes(results, args.engine, result)
        else:
            result = results["cascade"] = part_cascade()
        result["wall_s"] = round(time.perf_counter() - start, 1)
        result["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(results, indent=1))
    write_report(results)
    print(f"\nwrote {RESULTS_PATH} and {REPORT_PATH}")
