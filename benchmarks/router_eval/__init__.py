"""Router evaluation: length predictor, lanes vs FIFO, and the small-first cascade.

``python -m benchmarks.router_eval --help`` for the command (cli.py). Split by job:

- settings: paths, models and fixed settings (``THREADS`` is set by ``--threads``);
- metrics: the pure metric functions and the cascade threshold sweep;
- models: the data files, ``GeneratorServer`` configs per engine, the cached true lengths;
- predictor, lanes, cascade: the three parts, each run with real models in-process;
- report: ``benchmarks/ROUTER.md`` from the results JSON;
- cli: the command line, which merges each run's figures into the results and the report.

This package re-exports what the tests and other code import from it.
"""

from __future__ import annotations

from benchmarks.router_eval.cascade import _answer_all, part_cascade
from benchmarks.router_eval.cli import lanes_command, main, merge_lanes
from benchmarks.router_eval.lanes import (
    _drive,
    _lane_router,
    _lane_trace,
    _Request,
    _versions,
    _warm_predictor,
    lane_summary,
    part_lanes,
)
from benchmarks.router_eval.metrics import (
    QuestionOutcome,
    auc,
    bucket,
    bucket_accuracy,
    cascade_diagnostics,
    check_answer,
    kendall_tau,
    mae_log,
    normalize,
    recommend,
    sweep,
)
from benchmarks.router_eval.models import (
    ENGINES,
    _bare_router,
    _features,
    _NoClient,
    _run_all,
    chat,
    load_jsonl,
    make_server,
    server_config,
    true_lengths,
)
from benchmarks.router_eval.predictor import part_predictor
from benchmarks.router_eval.report import (
    NOTES,
    PART_HEADINGS,
    previous_sections,
    render,
    write_report,
)
from benchmarks.router_eval.settings import (
    BUCKETS,
    CASCADE_MAX_TOKENS,
    CASCADE_SYSTEM,
    DATA,
    HERE,
    LARGE_MODEL,
    LENGTH_MAX_TOKENS,
    LENGTHS_PATH,
    PROMPTS_PATH,
    QUESTIONS_PATH,
    REPORT_PATH,
    RESULTS_PATH,
    SMALL_MODEL,
    THREADS,
    TRAIN_MAX,
)

__all__ = [
    "BUCKETS",
    "CASCADE_MAX_TOKENS",
    "CASCADE_SYSTEM",
    "DATA",
    "ENGINES",
    "HERE",
    "LARGE_MODEL",
    "LENGTHS_PATH",
    "LENGTH_MAX_TOKENS",
    "NOTES",
    "PART_HEADINGS",
    "PROMPTS_PATH",
    "QUESTIONS_PATH",
    "REPORT_PATH",
    "RESULTS_PATH",
    "SMALL_MODEL",
    "THREADS",
    "TRAIN_MAX",
    "QuestionOutcome",
    "_NoClient",
    "_Request",
    "_answer_all",
    "_bare_router",
    "_drive",
    "_features",
    "_lane_router",
    "_lane_trace",
    "_run_all",
    "_versions",
    "_warm_predictor",
    "auc",
    "bucket",
    "bucket_accuracy",
    "cascade_diagnostics",
    "chat",
    "check_answer",
    "kendall_tau",
    "lane_summary",
    "lanes_command",
    "load_jsonl",
    "mae_log",
    "main",
    "make_server",
    "merge_lanes",
    "normalize",
    "part_cascade",
    "part_lanes",
    "part_predictor",
    "previous_sections",
    "recommend",
    "render",
    "server_config",
    "sweep",
    "true_lengths",
    "write_report",
]
