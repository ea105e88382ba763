"""Serve conventions (issue 15): health checks that see a dead or wedged engine, and a
graceful shutdown long enough for the longest generation. No Ray: ``check_health`` is
called on the plain server classes, and the deployment options are read from the built
application without deploying it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest

from carpool.autoscaling import CAPACITY_METRIC
from carpool.generation.hops import GenerationResult
from carpool.generation.sampling import SamplingParams
from carpool.generation.schemas import GenerationCall
from carpool.generation.sequence import GenSequence
from deployments.embedder import EmbedderConfig, EmbeddingDeployment, EmbeddingServer
from deployments.generator import (
    GeneratorConfig,
    GeneratorDeployment,
    GeneratorServer,
    build_generator_deployment,
)
from deployments.ranker import RankerConfig, RankingDeployment, RankingServer

# --- generator ------------------------------------------------------------------------------


@pytest.fixture()
def generator() -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from tests.factories import llama_tokenizer, tiny_llama_config

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer)).eval()
    server = GeneratorServer(
        {"limits": {"max_seq_len": 128}, "batching": {"max_num_seqs": 2}},
        model=model,
        tokenizer=tokenizer,
    )
    yield server
    server.close()


def _answer(server: GeneratorServer) -> GenerationResult:
    call = GenerationCall(prompts=["hello"], max_tokens=3, temperature=0.0, ignore_eos=True)
    return asyncio.run(server.generate(call))


def _wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_working_generator_is_healthy(generator: GeneratorServer) -> None:
    generator.check_health()  # before any request: no thread yet, nothing wrong
    assert _answer(generator).completion_tokens == 3
    generator.check_health()
    generator.engine.stall_s = 0.05
    time.sleep(0.2)
    generator.check_health()  # idle for longer than the stall limit is not a stall


# The thread's death is the point; pytest reports any thread ending in an exception.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_fails_the_health_check(generator: GeneratorServer) -> None:
    _answer(generator)
    thread = generator.engine._thread
    assert thread is not None and thread.is_alive()

    def die() -> None:
        raise SystemExit  # not an Exception: _run's guard lets it end the thread

    generator.engine._loop_once = die  # type: ignore[method-assign]
    _wait_until(lambda: not thread.is_alive())
    with pytest.raises(RuntimeError, match=r"engine thread .* died"):
        generator.check_health()


def test_a_wedged_engine_with_work_fails_the_health_check(generator: GeneratorServer) -> None:
    _answer(generator)
    release = threading.Event()
    entered = threading.Event()
    original = generator.engine._loop_once

    def hang() -> None:  # a forward pass that never returns (a hung device call)
        entered.set()
        release.wait(30)

    generator.engine._loop_once = hang  # type: ignore[method-assign]
    try:
        assert entered.wait(5)
        generator.engine.stall_s = 0.2
        generator.check_health()  # stuck, but with no work: nothing waits on it yet
        params = SamplingParams(max_tokens=2, temperature=0.0)
        generator.engine.submit([GenSequence([1, 2, 3], params, lambda event: None)])
        time.sleep(0.4)
        with pytest.raises(RuntimeError, match="finished no step"):
            generator.check_health()
    finally:
        generator.engine._loop_once = original  # type: ignore[method-assign]
        release.set()


def test_a_closed_engine_fails_the_health_check(generator: GeneratorServer) -> None:
    generator.close()
    with pytest.raises(RuntimeError, match="closed"):
        generator.check_health()


def test_serves_shutdown_hook_stops_the_engine_thread(generator: GeneratorServer) -> None:
    _answer(generator)
    thread = generator.engine._thread
    assert thread is not None and thread.is_alive()
    # Serve calls the deployment's __del__ after a stopping replica's requests finished.
    GeneratorDeployment.__del__(generator)  # type: ignore[arg-type]
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        generator.check_health()
    GeneratorDeployment.__del__(generator)  # type: ignore[arg-type]  # twice is harmless


# --- embedder and ranker ------------------------------------------------------------------


class _Embedder:
    name = "fake-embedder"
    max_length = 32
    dimension = 2

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[1, 2, 3] for _ in texts]

    def truncate(self, text: str) -> list[int]:
        return [1, 2, 3]

    def embed_ids(self, batch: list[list[int]]) -> list[np.ndarray]:
        return [np.ones(2, dtype=np.float32) for _ in batch]


class _Scorer:
    name = "fake-scorer"
    max_length = 32

    def encode(self, query: str, documents: list[str], truncate: bool) -> list[Any]:
        return [(([1, 2, 3], None), False) for _ in documents]

    def score(self, batch: list[Any]) -> list[float]:
        return [0.5 for _ in batch]


class _BrokenListener:
    """A pass listener that fails (a metrics exporter, say)."""

    def on_pass(self, record: Any) -> None:
        raise RuntimeError("metrics exporter broke")


async def _serve_then_break(server: Any, request: Any) -> None:
    # One event loop throughout, as in a replica: the worker task lives on it.
    await request()
    server.check_health()
    # A failing listener is logged, not fatal: the request is answered, the worker lives.
    server.executor.listeners.append(_BrokenListener())
    await asyncio.wait_for(request(), 10.0)
    server.check_health()
    # A worker that ends anyway (here: cancelled) fails the check until a job restarts it.
    worker = server.executor._worker
    worker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await worker
    with pytest.raises(RuntimeError, match=r"is unhealthy: its batching worker task ended"):
        server.check_health()


def test_a_dead_embedder_worker_fails_the_health_check() -> None:
    server = EmbeddingServer(EmbedderConfig(), _Embedder())
    server.check_health()  # no request yet: no worker, nothing wrong
    asyncio.run(_serve_then_break(server, lambda: server.embed(["a", "b"])))


def test_a_dead_ranker_worker_fails_the_health_check() -> None:
    server = RankingServer(RankerConfig(), scorer=_Scorer())
    server.check_health()
    asyncio.run(_serve_then_break(server, lambda: server.rank("q", ["a", "b"])))


@pytest.mark.parametrize(
    ("deployment", "server"),
    [
        (GeneratorDeployment, GeneratorServer),
        (EmbeddingDeployment, EmbeddingServer),
        (RankingDeployment, RankingServer),
    ],
)
def test_serve_finds_check_health_on_each_deployment_class(deployment: type, server: type) -> None:
    assert deployment.check_health is server.check_health


# --- graceful shutdown ----------------------------------------------------------------------


def _deployment_config(app: Any) -> Any:
    return app._bound_deployment._deployment_config


@pytest.mark.parametrize("timeout_s", [30.0, 300.0, 1800.0])
def test_generators_get_a_shutdown_grace_covering_their_longest_generation(
    timeout_s: float,
) -> None:
    config = GeneratorConfig.model_validate({"batching": {"request_timeout_s": timeout_s}})
    built = _deployment_config(build_generator_deployment(config, "large"))
    assert built.graceful_shutdown_timeout_s >= timeout_s
    assert built.graceful_shutdown_timeout_s <= timeout_s + 30  # a margin, not a guess


def test_the_default_generator_outlives_serves_20_s_default() -> None:
    built = _deployment_config(build_generator_deployment(GeneratorConfig(), "small"))
    assert built.graceful_shutdown_timeout_s >= GeneratorConfig().batching.request_timeout_s
    assert built.graceful_shutdown_timeout_s > 20


# --- autoscaling capacity -------------------------------------------------------------------


def test_generators_report_the_sequences_they_run_under_the_knobs_in_force(
    generator: GeneratorServer,
) -> None:
    assert generator.record_autoscaling_stats() == {CAPACITY_METRIC: 2.0}
    generator.reconfigure({"max_num_seqs": 4})  # what `serve deploy` does in place
    assert generator.record_autoscaling_stats() == {CAPACITY_METRIC: 4.0}


def test_batched_models_report_their_batch_size_under_the_knobs_in_force() -> None:
    embedder = EmbeddingServer(EmbedderConfig(), _Embedder())
    assert embedder.record_autoscaling_stats() == {CAPACITY_METRIC: 64.0}
    embedder.reconfigure({"max_batch_size": 8})
    assert embedder.record_autoscaling_stats() == {CAPACITY_METRIC: 8.0}
    ranker = RankingServer(
        RankerConfig.model_validate({"batching": {"max_batch_size": 16}}), scorer=_Scorer()
    )
    assert ranker.record_autoscaling_stats() == {CAPACITY_METRIC: 16.0}


@pytest.mark.parametrize(
    ("deployment", "server"),
    [
        (GeneratorDeployment, GeneratorServer),
        (EmbeddingDeployment, EmbeddingServer),
        (RankingDeployment, RankingServer),
    ],
)
def test_serve_finds_the_autoscaling_stats_on_each_deployment_class(
    deployment: type, server: type
) -> None:
    assert deployment.record_autoscaling_stats is server.record_autoscaling_stats
