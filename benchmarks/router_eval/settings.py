"""Paths, models and fixed settings of the router evaluation, shared by its parts."""

from __future__ import annotations

from pathlib import Path

# The benchmarks/ folder (this package lives in it).
HERE = Path(__file__).resolve().parent.parent
DATA = HERE / "data"
PROMPTS_PATH = DATA / "router_prompts.jsonl"
QUESTIONS_PATH = DATA / "router_questions.jsonl"
LENGTHS_PATH = DATA / "router_lengths.json"
RESULTS_PATH = HERE / "results" / "router_eval.json"
REPORT_PATH = HERE / "ROUTER.md"

SMALL_MODEL = "packaged:SmolLM2-135M-Instruct"
LARGE_MODEL = "packaged:Qwen2.5-Coder-0.5B-Instruct"
LENGTH_MAX_TOKENS = 192
# Upper edges of the length buckets (the last one takes everything longer).
BUCKETS = (16, 64)
TRAIN_MAX = 200
CASCADE_MAX_TOKENS = 48
CASCADE_SYSTEM = "Answer the question briefly. Give only the answer."
# Torch threads of the in-process models. One by default: the 2 cores are shared with other
# work, and two OpenMP threads against a busy core spin at each barrier (measured here:
# 52 tok/s with 1 thread vs 4 tok/s with 2 while another process held a core).
THREADS = {"torch": 1}
