"""Generator: prompts or chats in, generated text out, as a whole or streamed.

One deployment class, deployed once per model size (``small``, ``large``) from config.
``GeneratorServer`` is plain Python over an injected engine (``protocol.GenerationEngine``;
``factory.load_engine`` builds the configured one): it decides admission first, then
tokenises (batched, off the event loop for large prompts) and compiles output grammars
(bounded, with a timeout), submits the sequences of the requests that arrived together in
one go, and relays the engine's events as a result or a stream. A stream's tokens are sent
in messages of a few tokens or a few ms (``stream_interval_*``), the first one at once.
``GeneratorDeployment`` adds ``@serve.batch`` as the way arrivals reach the engine, and Ray
metrics; ``build_generator_deployment`` applies the Serve options from config.

A client that goes away (Serve cancels the call) or a request past ``request_timeout_s``
has its sequences aborted; the engine frees their slots at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from ray import serve
from ray.serve.deployment import Application

from carpool.admission import RequestControls, SlotQueue, deadline_exceeded, slot_refusal
from carpool.autoscaling import CAPACITY_METRIC
from carpool.devices import place_replica
from carpool.errors import RequestError
from carpool.generation.arrivals import ArrivalCollector, Ticket
from carpool.generation.coalesce import StreamCoalescer
from carpool.generation.config import (
    DEADLINE_GRACE_S,
    GenerationLimits,
    GeneratorBatching,
    GeneratorConfig,
    graceful_shutdown_s,
)
from carpool.generation.factory import LoadedEngine, check_kv_budget, load_engine
from carpool.generation.hops import Choice, GenerationEvent, GenerationResult
from carpool.generation.logprobs import TokenTexts, merge_records, raw_record
from carpool.generation.prompts import PromptPlanner, Rendered
from carpool.generation.protocol import GenerationEngine
from carpool.generation.sampling import SamplingParams
from carpool.generation.schemas import MAX_SEQS_PER_CALL, GenerationCall
from carpool.generation.sequence import GenSequence, SeqEvent
from carpool.generation.structured import (
    ConstraintCompiler,
    ConstraintError,
    GrammarBusy,
    GrammarTimeout,
    GrammarUnavailable,
    OutputConstraint,
    compile_refusal,
)
from carpool.generation.vllm_env import check_replica_environment
from carpool.priority import apply_replica_priority
from router.placement import (
    CAPACITY_TOKENS,
    GENERATION,
    PENDING_DECODE_TOKENS,
    PENDING_PREFILL_TOKENS,
    REPORTED_AT,
    RUNNING_SEQS,
    WAITING_SEQS,
)

logger = logging.getLogger(__name__)

# Prompts longer than this (characters, all of a batch's) are tokenised in a worker thread:
# below it the hop costs more than the encoding, above it the loop would stall every stream.
OFF_LOOP_TOKENIZE_CHARS = 20_000

__all__ = [
    "GenerationLimits",
    "GeneratorBatching",
    "GeneratorConfig",
    "GeneratorDeployment",
    "GeneratorServer",
    "build_generator_deployment",
]


class GeneratorServer:
    """Plain-Python generator server over an engine; tests use it without Ray."""

    def __init__(
        self,
        config: GeneratorConfig | dict | None = None,
        model: Any = None,
        tokenizer: Any = None,
        engine: GenerationEngine | None = None,
    ) -> None:
        self.config = (
            config
            if isinstance(config, GeneratorConfig)
            else GeneratorConfig.model_validate(config or {})
        )
        cfg = self.config
        self.name = cfg.source.served_model_name or "generator"
        self.batching = cfg.batching
        if engine is None:
            loaded = load_engine(cfg, model, tokenizer)
        else:  # injected (tests): the tokenizer comes with it
            if tokenizer is None:
                raise ValueError("an injected engine needs its tokenizer")
            loaded = LoadedEngine(engine, tokenizer, model, len(tokenizer), engine.max_seq_len, 0)
        self.engine = loaded.engine
        self.tokenizer = loaded.tokenizer
        self.model = loaded.model
        self.vocab_size = loaded.vocab_size
        self.max_seq_len = loaded.max_seq_len
        self.bytes_per_token = loaded.bytes_per_token
        self.prompts = PromptPlanner(
            self.name,
            self.tokenizer,
            self.max_seq_len,
            cfg.limits.max_tokens_limit,
            cfg.limits.default_max_tokens,
        )
        # Token ids to text for logprobs (special tokens kept: every token gets an entry).
        self.token_texts = TokenTexts(lambda ids: self.tokenizer.decode(ids))
        self._grammars: ConstraintCompiler | None = None  # built at the first constraint
        self._collector: ArrivalCollector | None = None
        # Sequences submitted and not finished, for the work this replica reports to routers.
        self._live: dict[int, GenSequence] = {}
        self._generation = f"{os.getpid()}-{time.time():.6f}"  # a restart is a new one

    # --- control --------------------------------------------------------------------------

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies new scheduling knobs; a bad user_config changes nothing."""
        b = GeneratorBatching.model_validate(user_config)
        if self.config.mode != "vllm" and self.bytes_per_token:  # vLLM sized its own cache
            check_kv_budget(
                b.max_num_seqs,
                self.max_seq_len,
                self.bytes_per_token,
                self.config.limits.max_kv_cache_mb,
            )
        self.engine.set_limits(b.max_num_seqs, b.max_step_tokens)
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

    def record_routing_stats(self) -> dict[str, Any]:
        """What request routers read to place requests (``router.placement``): how many
        sequences wait for their first token here and how many decode, the prompt tokens
        still to prefill and the output tokens still to decode, and the KV cache's size in
        tokens. Serve polls it (``request_routing_stats_period_s``)."""
        prefill = decode = waiting = running = 0
        for seq in list(self._live.values()):
            if not seq.output_ids:
                waiting += 1
                prefill += len(seq.prompt_ids)
            else:
                running += 1
            expected = seq.predicted_tokens or seq.params.max_tokens
            decode += max(0, int(expected) - len(seq.output_ids))
        totals = getattr(self.engine, "totals", {})
        return {
            PENDING_PREFILL_TOKENS: prefill,
            PENDING_DECODE_TOKENS: decode,
            WAITING_SEQS: waiting,
            RUNNING_SEQS: running,
            CAPACITY_TOKENS: getattr(self.engine, "kv_capacity_tokens", lambda: 0)(),
            REPORTED_AT: time.time(),
            GENERATION: self._generation,
            # Cumulative, for reports: how much of the prompts the engine's cache served.
            "prompt_tokens": totals.get("prompt_tokens", 0),
            "prompt_cached_tokens": totals.get("prompt_cached_tokens", 0),
        }

    def check_health(self) -> None:
        """Serve's health check: raises when the engine cannot serve, so Serve replaces us."""
        problem = self.engine.check_health()
        if problem is not None:
            raise RuntimeError(f"generator {self.name!r} is unhealthy: {problem}")

    def close(self) -> None:
        self.engine.close()
        grammars, self._grammars = self._grammars, None
        if grammars is not None:
            grammars.close()

    # --- a batch of arrivals: admission, tokens, grammars, one submission -----------------

    async def _through_batch(self, ticket: Ticket) -> None:
        """Without Serve, an asyncio collector stands in for ``@serve.batch``."""
        if self._collector is None:
            self._collector = ArrivalCollector(self._run_batch)
        await self._collector.add(ticket, self.batching.batch_wait_timeout_s)

    async def _run_batch(self, tickets: Sequence[Ticket]) -> None:
        """Admits, tokenises and submits the calls that arrived together (errors per call)."""
        b = self.batching
        waiting = self.engine.num_waiting()
        live: list[tuple[Ticket, Rendered]] = []
        for ticket in tickets:
            if ticket.abandoned:
                continue
            call = ticket.call
            queue = SlotQueue(waiting, self.engine.mean_slot_s, b.max_num_seqs)
            try:
                refusal = slot_refusal(
                    self.name,
                    queue,
                    RequestControls(call.deadline, call.priority),
                    b.max_waiting,
                    b.max_queue_delay_ms,
                    b.batch_tier_share,
                )
                if refusal is not None:
                    raise refusal
                live.append((ticket, self.prompts.render(call)))
                waiting += ticket.weight  # the next call of the batch queues behind this one
            except RequestError as exc:
                ticket.error = exc
        if not live:
            return
        rendered = [r for _, r in live]
        if sum(r.chars for r in rendered) > OFF_LOOP_TOKENIZE_CHARS:
            ids = await asyncio.to_thread(self.prompts.tokenize, rendered)
        else:
            ids = self.prompts.tokenize(rendered)
        ready: list[Ticket] = []
        for (ticket, _), prompts in zip(live, ids, strict=True):
            try:
                compiled = await self._compile(ticket.call)
                ticket.seqs = self._sequences(ticket.call, prompts, compiled)
                ticket.prompt_tokens = sum(len(p) for p in prompts)
                ready.append(ticket)
            except RequestError as exc:
                ticket.error = exc
        ready = [t for t in ready if not t.abandoned]
        if not ready:
            return
        try:
            streams = self.engine.generate_batch([t.seqs for t in ready], DEADLINE_GRACE_S)
        except Exception as exc:  # a closed engine: fail these calls, not the batch loop
            for ticket in ready:
                ticket.error = RequestError(
                    503, f"model {self.name!r} cannot take requests ({exc}); retry"
                )
            return
        for ticket, stream in zip(ready, streams, strict=True):
            ticket.stream = stream
            if ticket.abandoned:
                stream.close()

    def _sequences(
        self, call: GenerationCall, prompts: list[list[int]], compiled: Any
    ) -> list[GenSequence]:
        max_tokens = self.prompts.check(call, prompts)
        controls = RequestControls(call.deadline, call.priority)
        constraint = OutputConstraint.from_dict(call.constraint)
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
                    logprobs_wanted=call.logprobs is not None or call.judged,
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
                        index=index,
                        deadline=deadline,
                        rank=controls.rank,
                        predicted_tokens=call.predicted_tokens,
                        grammar=grammar,
                        constraint=constraint,
                    )
                )
        return seqs

    async def _compile(self, call: GenerationCall) -> Any:
        """The call's output grammar, compiled off the loop (bounded, cached), or None.

        Every engine mode compiles it: carpool's engines mask with it, and for vLLM (which
        compiles its own) it checks the schema first, so a bad one gets a 400, not a failed
        generation.
        """
        constraint = OutputConstraint.from_dict(call.constraint)
        if constraint is None:
            return None
        param = call.constraint_param or "response_format"
        limits = self.config.limits
        if self._grammars is None:
            self._grammars = ConstraintCompiler(
                self.tokenizer, self.vocab_size, self.engine.tok.eos_ids
            )
        try:
            return await self._grammars.compile_async(
                constraint, limits.grammar_compile_timeout_s, limits.max_grammar_compiles_waiting
            )
        except (ConstraintError, GrammarUnavailable, GrammarTimeout, GrammarBusy) as exc:
            raise compile_refusal(exc, param, self.name) from None

    # --- requests -------------------------------------------------------------------------

    async def _events(self, call: GenerationCall) -> AsyncIterator[tuple[str, Any]]:
        """Yields ('start', prompt_tokens), then ('events', [SeqEvent, ...]) until every
        choice ends; each batch is what the engine had ready, in order."""
        ticket = Ticket(call)
        try:
            await self._through_batch(ticket)
        except BaseException:
            ticket.abandon()
            raise
        if ticket.error is not None:
            raise ticket.error
        stream = ticket.stream
        if stream is None:  # abandoned or never submitted: nothing to relay
            raise RequestError(503, f"model {self.name!r} did not take the request; retry")
        live = [seq for seq in ticket.seqs or () if seq.id not in self._live]
        for seq in live:
            self._live[seq.id] = seq
        try:
            yield "start", ticket.prompt_tokens
            while not stream.done:
                try:
                    events = [await stream.__anext__(), *stream.ready()]
                except TimeoutError:
                    raise self._timeout(call) from None
                for event in events:
                    if event.finish_reason == "timeout":
                        raise self._timeout(call)
                    if event.finish_reason == "error":
                        raise RequestError(
                            503,
                            f"generation failed on model {self.name!r} ({event.error}); retry",
                            code="backend_unavailable",
                        )
                yield "events", events
        finally:
            for seq in live:
                self._live.pop(seq.id, None)
            stream.close()

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

    async def generate(self, call: GenerationCall) -> GenerationResult:
        """Runs a call to the end: choices (text, finish_reason), token counts, and choice 0's
        ``token_ids`` / ``token_logprobs`` (for the router's cascade; HTTP leaves them out)."""
        texts: dict[int, list[str]] = {}
        token_ids: list[int] = []
        token_logprobs: list[float] = []
        reasons: dict[int, str] = {}
        records: dict[int, list[dict[str, Any]]] = {}
        completion = prompt_tokens = 0
        async with aclosing(self._events(call)) as events:
            async for kind, value in events:
                if kind == "start":
                    prompt_tokens = value
                    continue
                for event in value:
                    texts.setdefault(event.index, []).append(event.text)
                    if call.logprobs is not None:
                        records.setdefault(event.index, []).append(self._logprobs(event))
                    if event.index == 0:
                        token_ids.extend(event.token_ids)
                        token_logprobs.extend(event.token_logprobs)
                    if event.finish_reason is not None:
                        reasons[event.index] = event.finish_reason
                        completion += event.completion_tokens
        choices = [Choice(i, "".join(texts.get(i, [])), reasons[i]) for i in sorted(reasons)]
        if call.logprobs is not None:  # only when asked: the record is endpoint-neutral
            for choice in choices:
                choice.logprobs = merge_records(records.get(choice.index, []))
        return GenerationResult(
            self.name, choices, prompt_tokens, completion, token_ids, token_logprobs
        )

    async def stream(self, call: GenerationCall) -> AsyncIterator[GenerationEvent]:
        """Streams a call: a 'start' event, 'delta' events as text arrives, then 'end'.

        A choice's text goes out at its first token, then in messages of at least
        ``stream_interval_tokens`` tokens or ``stream_interval_ms`` apart, and at its end.
        """
        completion = prompt_tokens = 0
        held = StreamCoalescer(
            self.batching.stream_interval_tokens, self.batching.stream_interval_ms
        )
        # aclosing (here and in generate): a caller that stops iterating (a closed local
        # stream) aborts the sequences now, not when the garbage collector gets to them.
        async with aclosing(self._events(call)) as events:
            async for kind, value in events:
                if kind == "start":
                    prompt_tokens = value
                    yield GenerationEvent.start(self.name, value)
                    continue
                for event in held.add(value):
                    if event.finish_reason is not None:
                        completion += event.completion_tokens
                    # A token whose text is held back (a partial character, a possible stop
                    # string) still gets its own delta when logprobs are asked for.
                    with_logprobs = call.logprobs is not None and bool(event.token_ids)
                    if event.text or event.finish_reason is not None or with_logprobs:
                        yield GenerationEvent(
                            "delta",
                            index=event.index,
                            text=event.text,
                            finish_reason=event.finish_reason,
                            logprobs=None if call.logprobs is None else self._logprobs(event),
                        )
        yield GenerationEvent.end(prompt_tokens, completion)


class GeneratorDeployment(GeneratorServer):
    """The Serve shell: ``@serve.batch`` brings arrivals to the engine, and Ray metrics."""

    def __init__(self, config: dict) -> None:
        cfg = GeneratorConfig.model_validate(config)
        # Before vLLM's engine core starts: it inherits the level.
        apply_replica_priority(
            cfg.replica.cpu_niceness, cfg.replica.cpu_scheduling, cfg.replica.cpu_cores
        )
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
        batch_size_fn=lambda tickets: sum(t.weight for t in tickets),
    )
    async def _collect(self, tickets: list[Ticket]) -> list[None]:
        # One admission pass, one tokenizer call and one engine submission for the batch.
        await self._run_batch(tickets)
        return [None] * len(tickets)

    async def _through_batch(self, ticket: Ticket) -> None:
        await self._collect(ticket)

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


def build_generator_deployment(
    config: GeneratorConfig,
    name: str,
    deployment_cls: type[GeneratorDeployment] = GeneratorDeployment,
    bind_args: Sequence[Any] = (),
    deployment_actors: Sequence[Any] = (),
    request_router: Any = None,
) -> Application:
    """Applies the Serve options from ``config`` and binds the deployment (a subclass, such
    as the generate app's direct-streaming ingress, gets ``bind_args`` after the config, and
    the deployment-scoped actors it uses; ``request_router``: Serve's RequestRouterConfig
    for the replica choice, None for Serve's default)."""
    options: dict[str, Any] = {
        **config.serve_options(name),
        "user_config": config.batching.model_dump(),
        "graceful_shutdown_timeout_s": graceful_shutdown_s(config),
    }
    if deployment_actors:
        options["deployment_actors"] = list(deployment_actors)
    if request_router is not None:
        options["request_router_config"] = request_router
    return serve.deployment(deployment_cls).options(**options).bind(config.model_dump(), *bind_args)
