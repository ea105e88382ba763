"""The vLLM tier: real vLLM (the CPU build here) on the packaged SmolLM2-135M-Instruct.

Each module skips itself where vLLM is not importable (the main venv: ``make test``; a
conftest cannot skip, it would fail collection); ``make test-vllm`` builds the vLLM venv and
runs it there. One vLLM engine per session (loading it costs about 35 s on 2 cores), beside
carpool's own continuous engine on the same weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# vLLM's usage reporter phones home; nothing in the tests may reach the network.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

SMOLLM2 = (
    Path(os.environ.get("CARPOOL_CACHE", "~/.cache/carpool")).expanduser()
    / "models"
    / "SmolLM2-135M-Instruct"
)

# Small on purpose: the tests need a handful of sequences at once, and the KV cache is
# allocated whole at start (GiB, VLLM_CPU_KVCACHE_SPACE).
VLLM_OPTIONS = {"cpu_kvcache_space_gib": 1, "max_num_seqs": 8, "enforce_eager": True}
BATCHING = {"max_num_seqs": 8, "max_step_tokens": 512, "batch_wait_timeout_s": 0.0}
LIMITS = {"max_seq_len": 2048, "max_tokens_limit": 2000}


@pytest.fixture(scope="session")
def smollm2() -> str:
    if not (SMOLLM2 / "config.json").exists():
        pytest.skip(f"{SMOLLM2} is missing: run `make models` in the main venv first")
    return str(SMOLLM2)


def generator_config(path: str, mode: str, **extra: object) -> dict:
    return {
        "source": {"model": path, "served_model_name": f"smollm2-{mode}", "dtype": "float32"},
        "mode": mode,
        "replica": {"num_cpus": 1, "torch_threads": 1},
        "limits": LIMITS,
        "batching": BATCHING,
        "vllm": VLLM_OPTIONS,
        **extra,
    }


@pytest.fixture(scope="session")
def vllm_server(smollm2: str) -> Iterator[object]:
    from deployments.generator import GeneratorServer

    server = GeneratorServer(generator_config(smollm2, "vllm"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def own_server(smollm2: str) -> Iterator[object]:
    from deployments.generator import GeneratorServer

    server = GeneratorServer(generator_config(smollm2, "continuous"))
    yield server
    server.close()
