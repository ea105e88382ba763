"""The part every engine shares: token ids in, text deltas and bookkeeping out.

``EngineCore`` turns each sampled token of a sequence into what the client sees (incremental
detokenisation, stop strings, end-of-sequence, length limits, logprobs, structured-output
checks) and keeps the totals, the mean slot time admission uses, and the listeners (metrics).
carpool's native engines and the vLLM adapter both build on it, so the text a request gets
is character for character the same whichever engine made the tokens. It also gives them
``generate``/``generate_batch`` over ``protocol.EventStream``; an engine supplies
``_enqueue`` (take sequences) and ``abort``.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from carpool.generation.protocol import EventStream
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.sequence import (
    EngineListener,
    GenSequence,
    SeqEvent,
    StepRecord,
    TokenizerInfo,
    check_fits,
)
from carpool.generation.text import IncrementalDecoder

logger = logging.getLogger(__name__)

# An engine with work that has not finished a step for this long is wedged (a hung device
# call, a deadlock). A step is one forward pass over at most max_step_tokens, seconds even
# on CPU, so two minutes only trips on a real hang; health checks then fail and Serve
# replaces the replica.
STALL_S = 120.0


class EngineCore(ABC):
    """Output assembly and bookkeeping shared by every engine; see the module docstring."""

    mode: str
    # Whether the engine calls sinks from a thread of its own (EventStream delivers them).
    threaded = True

    def __init__(self, tokenizer: TokenizerInfo, limits: SchedulerLimits, max_seq_len: int) -> None:
        self.tok = tokenizer
        self.limits = limits
        self.max_seq_len = max_seq_len
        self.listeners: list[EngineListener] = []
        self._closed = False
        # When the engine last finished a scheduling round or a step (monotonic).
        self.last_progress = time.monotonic()
        self.stall_s = STALL_S
        self.totals: dict[str, Any] = {
            "steps": 0,
            "sequences_finished": 0,
            "prompt_tokens": 0,
            "prompt_cached_tokens": 0,  # of those, found in a prefix cache
            "output_tokens": 0,  # of finished sequences
            "tokens_generated": 0,  # as they are sampled
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "max_running": 0,
        }
        # How long a sequence holds its slot (first token to finish), averaged: with
        # max_num_seqs it says how fast waiting requests get a slot, for admission.
        self.mean_slot_s = 0.0

    # --- the protocol ---------------------------------------------------------------------

    async def start(self) -> None:  # noqa: B027 - optional hook; most engines need none
        """Nothing to ready by default: the engine starts with its first sequences."""

    def generate(self, seqs: Sequence[GenSequence], grace_s: float | None = None) -> EventStream:
        return self.generate_batch([seqs], grace_s)[0]

    def generate_batch(
        self, groups: Sequence[Sequence[GenSequence]], grace_s: float | None = None
    ) -> list[EventStream]:
        """One submission for several requests (``@serve.batch`` hands a burst over at once).

        ``grace_s``: a stream whose sequences all have deadlines gives up this long after
        the last of them (the engine should have reported them timed out by then).
        """
        seqs = [seq for group in groups for seq in group]
        check_fits(seqs, self.max_seq_len)
        if self._closed:
            raise RuntimeError("engine is closed")
        streams = []
        for group in groups:
            deadlines = [s.deadline for s in group]
            deadline = None
            if grace_s is not None and None not in deadlines:
                deadline = max(d for d in deadlines if d is not None) + grace_s
            streams.append(EventStream(group, self.abort, self.threaded, deadline))
        self._enqueue(seqs)
        return streams

    @abstractmethod
    def _enqueue(self, seqs: list[GenSequence]) -> None:
        """Takes sequences whose sinks are set; they start at the engine's next step."""

    @abstractmethod
    def abort(self, seqs: Sequence[GenSequence]) -> None:
        """Stops sequences at the engine's next step (finish reason 'cancelled')."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Current and cumulative figures of this engine."""

    def kv_capacity_tokens(self) -> int:
        """Tokens this engine's KV cache holds at once; 0: not known (routers then assume)."""
        return 0

    @abstractmethod
    def num_waiting(self) -> int:
        """Sequences submitted but not yet running (cheap; any thread)."""

    @abstractmethod
    def check_health(self) -> str | None:
        """Why this engine cannot serve, or None."""

    @abstractmethod
    def close(self) -> None:
        """Stops the engine."""

    def _stalled(self, busy: int) -> str | None:
        """Why an engine holding ``busy`` sequences looks wedged (no step for stall_s)."""
        idle_for = time.monotonic() - self.last_progress
        if busy and idle_for > self.stall_s:
            return (
                f"the engine has {busy} sequences but finished no step for {idle_for:.0f} s "
                f"(stall limit {self.stall_s:g} s)"
            )
        return None

    def set_limits(self, max_num_seqs: int, max_step_tokens: int) -> None:
        """Applies new bounds (from reconfigure); running sequences above them finish normally."""
        SchedulerLimits(max_num_seqs, max_step_tokens)  # validates before anything changes
        self.limits.max_num_seqs = max_num_seqs
        self.limits.max_step_tokens = max_step_tokens

    def estimated_wait_s(self, extra: int = 0) -> float:
        """Time until a request queued now (behind ``extra`` more) gets a slot, roughly.

        Slots free at about ``max_num_seqs / mean_slot_s`` per second; 0 until a sequence has
        finished, so a fresh replica admits.
        """
        waiting = self.num_waiting() + extra
        if waiting <= 0 or self.mean_slot_s <= 0:
            return 0.0
        return waiting * self.mean_slot_s / max(self.limits.max_num_seqs, 1)

    # --- output assembly -------------------------------------------------------------------

    def _expired(self, seq: GenSequence, now: float) -> str | None:
        if seq.cancelled:
            return "cancelled"
        if seq.deadline is not None and now > seq.deadline:
            return "timeout"
        return None

    def _accept(
        self,
        seq: GenSequence,
        token: int,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
    ) -> bool:
        """Appends a sampled token, sends the text it completes; True when the sequence ends."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.output_ids.append(token)
        seq._pending_ids.append(token)
        seq.sampler.observe(token)
        grammar = seq.sampler.grammar
        if grammar is not None and not grammar.accept(token):
            # The mask allows only tokens the grammar accepts, so this means a bug: end the
            # sequence rather than send output that breaks the promised format.
            why = "allows no next token" if grammar.dead else f"refused token {token}"
            self._send(seq, "", "error", f"the output grammar {why}")
            return True
        if logprob is not None:
            seq.output_logprobs.append(logprob)
            seq._pending_logprobs.append(logprob)
        if seq.params.top_logprobs:
            seq._pending_top.append(top or [])
        self.totals["tokens_generated"] += 1
        if seq._decoder is None:
            seq._decoder = IncrementalDecoder(self.tok.decode, context=len(seq._context))
        ids = seq._context + seq.output_ids
        visible = seq._stopper.feed(seq._decoder.step(ids))
        reason = None
        if seq._stopper.stopped_by is not None or (
            token in self.tok.eos_ids and not seq.params.ignore_eos
        ):
            reason = "stop"
        elif grammar is not None and grammar.complete():
            reason = "stop"  # the structured output is whole; only end-of-sequence could follow
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_seq_len:
            reason = "length"
        if reason is not None and seq._stopper.stopped_by is None:
            visible += seq._stopper.feed(seq._decoder.flush(ids))
            if seq._stopper.stopped_by is None:
                visible += seq._stopper.finish()
        if visible or reason is not None:
            self._send(seq, visible, reason)
        return reason is not None

    def _send(
        self, seq: GenSequence, text: str, reason: str | None, error: str | None = None
    ) -> None:
        if reason is not None:
            seq.finish_reason = reason
            seq.finished_at = time.monotonic()
            if seq.first_token_at is not None:
                held = seq.finished_at - seq.first_token_at
                done = self.totals["sequences_finished"]
                self.mean_slot_s = held if done == 0 else 0.9 * self.mean_slot_s + 0.1 * held
            self.totals["sequences_finished"] += 1
            self.totals["prompt_tokens"] += seq.num_prompt_tokens
            self.totals["prompt_cached_tokens"] += seq.cached_tokens
            self.totals["output_tokens"] += len(seq.output_ids)
            key = f"finished_{reason}"
            self.totals[key] = self.totals.get(key, 0) + 1
        event = SeqEvent(
            index=seq.index,
            text=text,
            token_ids=seq._pending_ids,
            token_logprobs=seq._pending_logprobs,
            top_logprobs=seq._pending_top,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=len(seq.output_ids),
            error=error,
        )
        seq._pending_ids = []
        seq._pending_logprobs = []
        seq._pending_top = []
        self._deliver(seq, event)
        if reason is not None:
            for listener in self.listeners:
                try:
                    listener.on_finish(seq)
                except Exception:
                    logger.debug("engine listener failed", exc_info=True)

    def _finish_now(self, seq: GenSequence, reason: str, error: str | None = None) -> None:
        """Ends a sequence for a reason other than its own tokens (cancel, timeout, error)."""
        if seq.finished:
            return
        self._send(seq, seq._stopper.finish() if reason != "error" else "", reason, error)

    def _record(self, record: StepRecord) -> None:
        self.last_progress = time.monotonic()
        self.totals["steps"] += 1
        self.totals["prefill_s"] += record.prefill_ms / 1000
        self.totals["decode_s"] += record.decode_ms / 1000
        self.totals["max_running"] = max(self.totals["max_running"], record.running)
        for listener in self.listeners:
            try:
                listener.on_step(record)
            except Exception:
                logger.debug("engine listener failed", exc_info=True)

    def _deliver(self, seq: GenSequence, event: SeqEvent) -> None:
        """Hands an event to the sequence's sink (threaded engines batch these per step)."""
        try:
            seq.sink(event)
        except Exception:  # a broken sink (closed loop) must not stop the engine
            logger.debug("sink of sequence %s failed", seq.id, exc_info=True)
