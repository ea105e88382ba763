"""vLLM as a generation engine: carpool's server, router and lanes on top of vLLM's AsyncLLM.

``VllmEngine`` implements ``protocol.GenerationEngine`` over vLLM's own async engine
(``vllm.v1.engine.async_llm.AsyncLLM``), on the event loop of the caller: in a Serve
replica, the replica's own loop, as vLLM's OpenAI server runs it on the server's loop. No
thread of carpool's sits between them: a request's token ids go from vLLM's output handler
to the request's event stream on the same loop.

How the pieces map:

- Tokens: the server tokenises (chat template included) and hands vLLM token ids
  (``TokensPrompt``); vLLM does not detokenise (``detokenize=False``). Its token ids go
  through ``assembly.EngineCore._accept``, so text deltas, stop strings, end-of-sequence and
  length handling are carpool's, character for character the continuous engine's. vLLM
  stops on carpool's end-of-sequence ids itself (``stop_token_ids``); a stop string is seen
  here, and the request is aborted in vLLM at once.
- Structured output: a sequence's ``constraint`` goes to vLLM's structured outputs
  (``StructuredOutputsParams(json=schema)``).
- Logprobs: ``logprobs=k`` under ``logprobs_mode="processed_logprobs"``: the distribution
  the token was drawn from, as carpool's own engines report it.
- Cancellation and deadlines: each sequence is an asyncio task around ``AsyncLLM.generate``;
  ``abort`` or the deadline timer cancels the task, and ``generate`` aborts the request in
  vLLM's engine core before the cancellation ends the task.
- Priority: with ``priority_scheduling`` vLLM's scheduler orders its waiting queue by the
  integer ``priority`` (lower first, then arrival): carpool's tier and predicted length with
  aging, the key the router's lanes use (``vllm_priority``).
- Stats: a vLLM stat logger turns each engine-core iteration's stats into ``StepRecord``s
  for the listeners, so carpool's generator metrics and dashboard work unchanged.

- Orphans: vLLM's engine core is a child process that outlives a replica killed without its
  cleanup (SIGKILL, ``ray stop``); ``engine_reaper`` watches the replica from a process of
  its own and ends the engine core within seconds of the replica's death.

vLLM is imported only when an engine is built: without it ``engine: vllm`` fails with what
to install (``VllmNotInstalled``), and nothing else needs it. vLLM's output handler binds to
the first loop that generates; an engine serves one loop for its life (a replica's).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.aging import aging_key
from carpool.generation.assembly import EngineCore
from carpool.generation.engine_reaper import start_reaper
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.sequence import GenSequence, StepRecord, TokenizerInfo
from carpool.generation.vllm_options import (
    DEFAULT_AGING_TOKENS_PER_S,
    DEFAULT_TIER_PENALTY_TOKENS,
    VllmOptions,
    engine_args,
    engine_env,
    finish_reason,
    gpu_budget_problem,
    import_vllm,
    sampling_kwargs,
    structured_outputs_kwargs,
)

logger = logging.getLogger(__name__)


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


class VllmEngine(EngineCore):
    """A ``GenerationEngine`` over vLLM's ``AsyncLLM``; see the module docstring."""

    mode = "vllm"
    threaded = False  # sinks are called on the loop the requests are read on

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
        import_vllm()  # fail here, with the install hint, before anything starts
        if device.startswith("cuda"):
            check_gpu(model_path, options, device)
        super().__init__(tokenizer, limits, max_seq_len)
        self.options = options
        self.device = device
        self.bytes_per_token = bytes_per_token
        # vLLM fixes its sequence cap at start; carpool's limits follow it (admission).
        self.engine_max_num_seqs = options.max_num_seqs or limits.max_num_seqs
        self.limits.max_num_seqs = self.engine_max_num_seqs
        self.args = engine_args(
            options, model_path, max_seq_len, self.engine_max_num_seqs, dtype, device
        )
        self.started_at = time.monotonic()
        self._flights: dict[int, _Flight] = {}
        self._engine = _EngineStats()
        self._last_record = time.perf_counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Built here, blocking (the engine-core process loads the model): AsyncLLM starts its
        # output handler on the loop of the first generate, the replica's.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.update(engine_env(options, device))  # read by the engine-core process
        # Before the engine core exists, so a replica killed while vLLM loads leaves none.
        self.reaper = start_reaper()
        self.llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**self.args), stat_loggers=[_stat_logger_factory(self)]
        )
        cache = self.llm.vllm_config.cache_config
        self.block_size = int(cache.block_size or 0)
        self.num_blocks = int(cache.num_gpu_blocks or 0)
        self.last_progress = time.monotonic()

    # --- the protocol ---------------------------------------------------------------------

    def _enqueue(self, seqs: list[GenSequence]) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(
                "a vLLM engine serves one event loop (its output handler runs there); "
                "generate from the loop that started it"
            )
        now = time.monotonic()
        for seq in seqs:
            flight = _Flight(seq, f"carpool-{seq.id}")
            self._flights[seq.id] = flight
            if seq.cancelled or (seq.deadline is not None and now > seq.deadline):
                self._done(flight, self._expired(seq, now) or "cancelled")
                continue
            flight.task = loop.create_task(self._drive(flight))
            if seq.deadline is not None:
                flight.timer = loop.call_later(
                    max(0.0, seq.deadline - now), self._stop_flight, seq.id, "timeout"
                )

    def abort(self, seqs: Sequence[GenSequence]) -> None:
        """Cancels the sequences' tasks; ``generate`` aborts them in vLLM before they end."""
        for seq in seqs:
            seq.cancelled = True
            self._stop_flight(seq.id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for flight in list(self._flights.values()):
            self._finish_now(flight.seq, "error", "the engine was shut down")
            if flight.task is not None:
                flight.task.cancel()
        self._flights.clear()
        try:
            self.llm.shutdown()
        except Exception:
            logger.warning("vLLM engine did not shut down cleanly", exc_info=True)

    def set_limits(self, max_num_seqs: int, max_step_tokens: int) -> None:
        SchedulerLimits(max_num_seqs, max_step_tokens)  # validates like the other engines
        if max_num_seqs != self.engine_max_num_seqs:
            logger.warning(
                "user_config asks max_num_seqs %d but vLLM runs with %d until the replica "
                "restarts; set vllm.max_num_seqs in the args to change it",
                max_num_seqs,
                self.engine_max_num_seqs,
            )
        self.limits.max_step_tokens = max_step_tokens

    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

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

    def check_health(self) -> str | None:
        if self._closed:
            return "the engine is closed"
        if self.llm.errored:
            return f"vLLM's engine core died: {self.llm.dead_error}"
        return self._stalled(len(self._flights))

    # --- per sequence ---------------------------------------------------------------------

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
                if out.num_cached_tokens:  # vLLM's prefix cache served these prompt tokens
                    seq.cached_tokens = out.num_cached_tokens
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


def check_gpu(model_path: str, options: VllmOptions, device: str = "cuda") -> None:
    """Refuses, by name, a driver too old for torch's CUDA and a budget the GPU cannot hold.

    Both would otherwise fail later and less clearly: the driver in torch's first CUDA call
    (every GPU replica alike), the budget in vLLM's free-memory check or as an OOM.
    """
    import torch

    from carpool import cuda_driver

    cuda_driver.check(require_gpu=True)
    _, total = torch.cuda.mem_get_info(torch.device(device))
    problem = gpu_budget_problem(model_path, options, weight_bytes(model_path), total)
    if problem is not None:
        raise RuntimeError(problem)


def weight_bytes(model_path: str) -> int:
    """Bytes of the model's weight files (safetensors, else .bin), 0 when none are found."""
    from pathlib import Path

    folder = Path(model_path)
    files = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


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
