"""The peers harness's fixed choices: where things live, the ports, the SLO, the model name."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS_HOME = Path(os.environ.get("CARPOOL_PEERS_HOME", "~/.cache/carpool/peers")).expanduser()
SMOLLM2_DIR = Path("~/.cache/carpool/models/SmolLM2-135M-Instruct").expanduser()
RESULTS_JSON = REPO_ROOT / "benchmarks" / "peers.json"
REPORT_MD = REPO_ROOT / "benchmarks" / "PEERS.md"
LOG_DIR = REPO_ROOT / "benchmarks" / "results" / "peers"
# The generated tables sit between these markers; the reading around them is written by hand.
BEGIN, END = "<!-- peers:begin -->", "<!-- peers:end -->"

# 8200-8299 is this harness's range: never a developer's `make serve` (8000) or the suite (8100).
PORTS = {"carpool": 8210, "infinity": 8207, "vllm": 8208}
HOST = "127.0.0.1"
SLO_MS = 500.0
# Seconds between one system's stop and the next one's start.
SETTLE_S = 2.0
# The name every generation system answers to, so one request body serves all of them.
SERVED_MODEL = "small"
