"""Generation engines: one interface, two batching strategies.

``GenerationEngine`` is what a generator server talks to: ``submit`` sequences (thread-safe,
returns at once), ``cancel`` one, read ``stats``. Each sequence carries a ``sink`` that
receives its ``SeqEvent``s (text deltas, then one final event with the finish reason) from
the engine's own thread; the server turns them into responses or stream chunks.

- ``ContinuousEngine`` (iteration-level batching): every step decodes one token for each
  running sequence and prefills prompt chunks of new ones, within ``max_num_seqs`` and
  ``max_batch_tokens``. A finished, cancelled or timed-out sequence leaves at the end of the
  step it is noticed in and its slot goes to the next waiting request. It runs its own
  scheduler over the slot KV cache (``runner.SlotRunner``).
- ``StaticEngine``: the classic way, for comparison. A batch runs as one padded
  transformers ``generate``; rows that finish early keep their place until the longest is
  done, and arrivals wait for the next batch.

Both give the same greedy tokens as an unbatched ``generate`` for the same prompt, and apply
sampling per sequence (``sampling.SamplerState``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from carpool.generation.sampling import (
    SamplerState,
    SamplingParams,
    apply_constraints,
    apply_penalties,
    chosen_logprobs,
    sample_one,
    sample_rows,
    top_alternatives,
)
from carpool.generation.scheduler import Scheduler, SchedulerLimits
from carpool.generation.text import IncrementalDecoder, StopMatcher

logger = logging.getLogger(__name__)

ENGINE_MODES = ("continuous", "static", "vllm")

# Prompt tokens decoded together with the first output tokens so their leading spaces and
# multi-byte characters come out right (see text.IncrementalDecoder).
DECODE_CONTEXT_TOKENS = 4

# How long an idle engine thread sleeps between checks when nothing wakes it.
IDLE_POLL_S = 0.5

# An engine with work that has not finished a step for this long is wedged (a hung device
# call, a deadlock). A step is one forward pass over at most max_batch_tokens, seconds even
# on CPU, so two minutes only trips on a real hang; health checks then fail and Serve
# replaces the replica.
STALL_S = 120.0

# End-of-turn / end-of-text tokens of common chat families, added to the eos ids when the
# vocabulary has them as tokens.
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

_ids = itertools.count()


@dataclass
class SeqEvent:
    """What a sequence produced since its last event; ``finish_reason`` set on the last one.

    Finish reasons: ``stop`` (end of sequence or a stop string), ``length`` (max_tokens or
    the context limit), ``cancelled``, ``timeout``, ``error`` (then ``error`` says why).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Log-probability of each of token_ids under the distribution it was drawn from.
    token_logprobs: list[float] = field(default_factory=list)
    # For each of token_ids, the sequence's top_logprobs most likely (token, logprob) pairs;
    # empty unless its params ask for alternatives.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class GenSequence:
    """One prompt being generated: request side (params, sink) and engine side (progress)."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[SeqEvent], None],
        index: int = 0,
        deadline: float | None = None,
        rank: int = 0,
        predicted_tokens: float | None = None,
        grammar: Any = None,
        constraint: Any = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sink = sink
        self.index = index
        self.deadline = deadline  # time.monotonic() after which the engine drops it
        self.rank = rank  # priority tier: 0 interactive is admitted before 1 batch
        # The router's length prediction; engines with a priority queue of their own use it.
        self.predicted_tokens = predicted_tokens
        # Structured output: ``constraint`` (structured.OutputConstraint) is what the output
        # must be, for engines that constrain on their own (vLLM); ``grammar`` is its
        # per-sequence state for carpool's engines, which mask the logits with it.
        self.constraint = constraint
        self.sampler = SamplerState(params, grammar=grammar)
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.num_computed = 0  # tokens whose keys/values are in the KV cache
        self.cancelled = False  # set from any thread; the engine acts at its next step
        self.finish_reason: str | None = None
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._context = self.prompt_ids[-DECODE_CONTEXT_TOKENS:]
        self._decoder: IncrementalDecoder | None = None
        self._stopper = StopMatcher(params.stop)
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[float] = []
        self._pending_top: list[list[tuple[int, float]]] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_chunk(self, size: int) -> list[int]:
        """The next ``size`` tokens to feed: prompt tokens, then the last sampled token."""
        if self.num_computed < len(self.prompt_ids):
            return self.prompt_ids[self.num_computed : self.num_computed + size]
        return [self.output_ids[-1]]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.id}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
            f"computed={self.num_computed}, finish={self.finish_reason})"
        )


@dataclass
class StepRecord:
    """What one engine step did (exported as metrics by listeners)."""

    running: int
    waiting: int
    decode_seqs: int = 0
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    padded_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_bytes: int = 0

    @property
    def tokens(self) -> int:
        return self.decode_seqs + self.padded_tokens


class EngineListener(Protocol):
    """Receives step and finish records (metrics); called on the engine thread."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_finish(self, seq: GenSequence) -> None: ...


@dataclass
class TokenizerInfo:
    """What an engine needs from the tokenizer: decoding, end-of-sequence and padding ids."""

    decode: Callable[[Sequence[int]], str]
    eos_ids: frozenset[int]
    pad_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, generation_config: Any = None) -> TokenizerInfo:
        eos: set[int] = set()
        for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(x) for x in source)
        # Chat-tuned families end a turn with one token and a document with another; a raw
        # completion may produce either, so both end the sequence.
        vocab = tokenizer.get_vocab()
        eos.update(vocab[name] for name in END_TOKENS if name in vocab)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(eos) if eos else 0

        def decode(ids: Sequence[int]) -> str:
            return tokenizer.decode(list(ids), skip_special_tokens=True)

        return cls(decode=decode, eos_ids=frozenset(eos), pad_id=int(pad))


class GenerationEngine(ABC):
    """Runs sequences on a model in a background thread; see the module docstring."""

    mode: str

    def __init__(self, tokenizer: TokenizerInfo, limits: SchedulerLimits, max_seq_len: int) -> None:
        self.tok = tokenizer
        self.limits = limits
        self.max_seq_len = max_seq_len
        self.listeners: list[EngineListener] = []
        self._inbox: list[GenSequence] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        # When the engine thread last finished a scheduling round or a step (monotonic).
        self.last_progress = time.monotonic()
        self.stall_s = STALL_S
        self.totals = {
            "steps": 0,
            "sequences_finished": 0,
            "prompt_tokens": 0,
            "output_tokens": 0,  # of finished sequences
            "tokens_generated": 0,  # as they are sampled
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "max_running": 0,
        }
        # How long a sequence holds its slot (first token to finish), averaged: with
        # max_num_seqs it says how fast waiting requests get a slot, for admission.
        self.mean_slot_s = 0.0

    # --- called from any thread ---------------------------------------------------------

    def submit(self, seqs: Sequence[GenSequence]) -> None:
        """Queues sequences; they are admitted at the engine's next step."""
        check_fits(seqs, self.max_seq_len)
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._inbox.extend(seqs)
            self._ensure_thread()
            self._cond.notify()

    def estimated_wait_s(self, extra: int = 0) -> float:
        """Time until a request queued now (behind ``extra`` more) gets a slot, roughly.

        Slots free at about ``max_num_seqs / mean_slot_s`` per second; 0 until a sequence has
        finished, so a fresh replica admits.
        """
        waiting = self.num_waiting() + extra
        if waiting <= 0 or self.mean_slot_s <= 0:
            return 0.0
        return waiting * self.mean_slot_s / max(self.limits.max_num_seqs, 1)

    def set_limits(self, max_num_seqs: int, max_batch_tokens: int) -> None:
        """Applies new bounds (from reconfigure); running sequences above them finish normally."""
        SchedulerLimits(max_num_seqs, max_batch_tokens)  # validates before anything changes
        self.limits.max_num_seqs = max_num_seqs
        self.limits.max_batch_tokens = max_batch_tokens

    def cancel(self, seq: GenSequence) -> None:
        """Asks the engine to drop a sequence; its slot is freed at the next step."""
        seq.cancelled = True
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def health_problem(self) -> str | None:
        """Why this engine cannot serve, or None: its thread died, or it stalls with work.

        A thread that has not started yet (no request so far) is healthy: ``submit`` starts
        it. One that ended while the engine is open was killed by something its loop does
        not catch (``_run`` survives every ``Exception``), and the sequences it held will
        never finish.
        """
        thread = self._thread
        if self._closed:
            return "the engine is closed"
        if thread is not None and not thread.is_alive():
            return f"the engine thread {thread.name!r} died"
        busy = self.num_waiting() + int(self.stats().get("running", 0))
        idle_for = time.monotonic() - self.last_progress
        if busy and idle_for > self.stall_s:
            return (
                f"the engine has {busy} sequences but finished no step for {idle_for:.0f} s "
                f"(stall limit {self.stall_s:g} s)"
            )
        return None

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Current and cumulative figures of this engine."""

    @abstractmethod
    def num_waiting(self) -> int:
        """Sequences submitted but not yet running (cheap; any thread)."""

    # --- engine thread ------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self.last_progress = time.monotonic()  # a fresh thread has not stalled yet
            self._thread = threading.Thread(
                target=self._run, name=f"carpool-{self.mode}-engine", daemon=True
            )
            self._thread.start()

    def _take_inbox(self, block: bool) -> list[GenSequence]:
        with self._cond:
            if block and not self._inbox and not self._closed:
                self._cond.wait(IDLE_POLL_S)
            taken, self._inbox = self._inbox, []
            return taken

    def _run(self) -> None:
        import torch

        with torch.no_grad():
            while not self._closed:
                self.last_progress = time.monotonic()
                try:
                    self._loop_once()
                except Exception as exc:  # never let the thread die: fail what ran, go on
                    logger.exception("%s engine step failed", self.mode)
                    self._fail_all(f"{type(exc).__name__}: {exc}")
        self._fail_all("the engine was shut down")

    @abstractmethod
    def _loop_once(self) -> None:
        """One scheduling round (a step, or a whole static batch)."""

    @abstractmethod
    def _fail_all(self, reason: str) -> None:
        """Finishes every sequence the engine holds with an error and resets its state."""

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
        try:
            seq.sink(event)
        except Exception:  # a broken sink (closed loop) must not stop the engine
            logger.debug("sink of sequence %s failed", seq.id, exc_info=True)
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


class ContinuousEngine(GenerationEngine):
    """Iteration-level batching over a slot KV cache (see the module docstring)."""

    mode = "continuous"

    def __init__(
        self,
        runner: Any,
        tokenizer: TokenizerInfo,
        limits: SchedulerLimits,
        max_seq_len: int,
        queue_policy: str = "priority",
    ) -> None:
        super().__init__(tokenizer, limits, max_seq_len)
        self.runner = runner
        self.scheduler: Scheduler[GenSequence] = Scheduler(limits, queue_policy)
        # Slot order: decoding sequences hold rows 0..D-1, prefilling ones rows D..D+P-1.
        self.decoding: list[GenSequence] = []
        self.prefilling: list[GenSequence] = []

    def set_limits(self, max_num_seqs: int, max_batch_tokens: int) -> None:
        super().set_limits(max_num_seqs, max_batch_tokens)
        cache = self.runner.cache
        cache.max_rows = max(max_num_seqs, cache.rows)

    def stats(self) -> dict[str, Any]:
        cache = self.runner.cache
        return {
            "mode": self.mode,
            "running": len(self.decoding) + len(self.prefilling),
            "waiting": self.num_waiting(),
            "kv_blocks_used": self._blocks_used(),
            "kv_blocks_total": cache.blocks_total,
            "kv_bytes_allocated": cache.allocated_bytes,
            "kv_bytes_max": cache.max_bytes,
            **self.totals,
        }

    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    def _blocks_used(self) -> int:
        size = self.runner.cache.block_size
        return sum(-(-s.num_computed // size) for s in self.decoding + self.prefilling)

    # --- the step loop ------------------------------------------------------------------

    def _loop_once(self) -> None:
        idle = not (self.decoding or self.prefilling or len(self.scheduler.waiting))
        if idle:
            self.runner.cache.release()
        for seq in self._take_inbox(block=idle):
            self.scheduler.add(seq)
        self._reap()
        plan = self.scheduler.schedule(self.decoding, self.prefilling)
        if not plan:
            return
        self.prefilling.extend(plan.admitted)
        record = StepRecord(running=0, waiting=0)
        ended: list[GenSequence] = []

        if plan.decode:
            start = time.perf_counter()
            seqs = plan.decode
            logits = self.runner.forward(
                0, [s.next_chunk(1) for s in seqs], [s.num_computed for s in seqs]
            )
            for seq, (token, logprob, top) in zip(seqs, _sample(logits, seqs), strict=True):
                seq.num_computed += 1
                if self._accept(seq, token, logprob, top):
                    ended.append(seq)
            record.decode_ms = (time.perf_counter() - start) * 1000
            record.decode_seqs = len(seqs)

        if plan.prefill:
            start = time.perf_counter()
            seqs = [s for s, _ in plan.prefill]
            logits = self.runner.forward(
                len(self.decoding),
                [s.next_chunk(n) for s, n in plan.prefill],
                [s.num_computed for s in seqs],
            )
            done_rows = []
            for row, (seq, n) in enumerate(plan.prefill):
                seq.num_computed += n
                if seq.num_computed == seq.num_prompt_tokens:
                    done_rows.append(row)
            if done_rows:
                completed = [seqs[r] for r in done_rows]
                sampled = _sample(logits[done_rows], completed)
                for seq, (token, logprob, top) in zip(completed, sampled, strict=True):
                    self._promote(seq)
                    if self._accept(seq, token, logprob, top):
                        ended.append(seq)
            record.prefill_ms = (time.perf_counter() - start) * 1000
            record.prefill_seqs = len(plan.prefill)
            record.prefill_tokens = sum(n for _, n in plan.prefill)
            record.padded_tokens = plan.prefill_padded_tokens

        for seq in ended:
            self._leave(seq)
        record.running = len(self.decoding) + len(self.prefilling)
        record.waiting = len(self.scheduler.waiting)
        record.kv_blocks_used = self._blocks_used()
        record.kv_blocks_total = self.runner.cache.blocks_total
        record.kv_bytes = self.runner.cache.allocated_bytes
        self._record(record)

    def _reap(self) -> None:
        """Drops cancelled and timed-out sequences, running or waiting, before planning."""
        now = time.monotonic()
        for seq in list(self.decoding) + list(self.prefilling):
            reason = self._expired(seq, now)
            if reason is not None:
                self._leave(seq)
                self._finish_now(seq, reason)
        for seq in self.scheduler.waiting:
            reason = self._expired(seq, now)
            if reason is not None:
                self.scheduler.remove(seq)
                self._finish_now(seq, reason)

    def _promote(self, seq: GenSequence) -> None:
        """Moves a sequence whose prompt is now cached from the prefill rows to the decode rows."""
        j = self.prefilling.index(seq)
        first = self.prefilling[0]
        if j != 0:
            d = len(self.decoding)
            length = max(seq.num_computed, first.num_computed)
            self.runner.cache.swap(d, d + j, length)
            self.prefilling[0], self.prefilling[j] = seq, first
        self.decoding.append(self.prefilling.pop(0))

    def _leave(self, seq: GenSequence) -> None:
        """Frees a sequence's slot, moving the last row into the hole to stay compact."""
        cache = self.runner.cache
        if seq in self.decoding:
            i = self.decoding.index(seq)
            last = self.decoding[-1]
            cache.move(len(self.decoding) - 1, i, last.num_computed)
            self.decoding[i] = last
            self.decoding.pop()
            if self.prefilling:
                # The decode rows shrank by one: the last prefill row fills the gap.
                tail = self.prefilling[-1]
                d = len(self.decoding)
                cache.move(d + len(self.prefilling), d, tail.num_computed)
                self.prefilling.insert(0, self.prefilling.pop())
        elif seq in self.prefilling:
            j = self.prefilling.index(seq)
            d = len(self.decoding)
            tail = self.prefilling[-1]
            cache.move(d + len(self.prefilling) - 1, d + j, tail.num_computed)
            self.prefilling[j] = tail
            self.prefilling.pop()

    def _fail_all(self, reason: str) -> None:
        for seq in self.decoding + self.prefilling + list(self.scheduler.waiting):
            self.scheduler.remove(seq)
            self._finish_now(seq, "error", reason)
        for seq in self._take_inbox(block=False):
            self._finish_now(seq, "error", reason)
        self.decoding, self.prefilling = [], []
        self.runner.cache.release()


class StaticEngine(GenerationEngine):
    """One padded transformers ``generate`` per batch (static batching, for comparison).

    Sampling, stops and streaming ride on ``generate``'s hooks: a logits processor picks
    each row's token with the row's own sampler, and a stopping criterion hands every new
    token to the sequence and tells ``generate`` which rows are done. Done rows still run
    (padded) until the batch's longest sequence ends: that is what static batching costs.
    """

    mode = "static"

    def __init__(
        self,
        model: Any,
        tokenizer: TokenizerInfo,
        limits: SchedulerLimits,
        max_seq_len: int,
        block_size: int = 64,
    ) -> None:
        super().__init__(tokenizer, limits, max_seq_len)
        self.model = model
        self.block_size = block_size
        self.waiting: list[GenSequence] = []
        self.batch: list[GenSequence] = []
        self._batch_len = 0

    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.waiting)

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "running": len(self.batch),
            "waiting": self.num_waiting(),
            **self.totals,
        }

    def _loop_once(self) -> None:
        self.waiting.extend(self._take_inbox(block=not self.waiting))
        now = time.monotonic()
        for seq in list(self.waiting):
            reason = self._expired(seq, now)
            if reason is not None:
                self.waiting.remove(seq)
                self._finish_now(seq, reason)
        if not self.waiting:
            return
        # A batch: FCFS while rows x longest prompt stays within the token budget.
        batch: list[GenSequence] = []
        longest = 0
        for seq in self.waiting:
            width = max(longest, seq.num_prompt_tokens)
            if batch and (
                len(batch) >= self.limits.max_num_seqs
                or (len(batch) + 1) * width > self.limits.max_batch_tokens
            ):
                break
            batch.append(seq)
            longest = width
        del self.waiting[: len(batch)]
        self.batch = batch
        try:
            self._generate(batch)
        finally:
            self.batch = []

    def _generate(self, batch: list[GenSequence]) -> None:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria

        engine = self
        device = next(self.model.parameters()).device
        width = max(s.num_prompt_tokens for s in batch)
        ids = torch.full((len(batch), width), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, width - seq.num_prompt_tokens :] = torch.tensor(seq.prompt_ids)
            mask[row, width - seq.num_prompt_tokens :] = 1
        done = torch.zeros(len(batch), dtype=torch.bool, device=device)
        clock = {"start": time.perf_counter(), "last": time.perf_counter(), "steps": 0}
        # The sampler hook sees the logits; the stopping hook accepts the tokens a moment later.
        step_logprobs: list[float] = [0.0] * len(batch)
        step_tops: list[list[tuple[int, float]]] = [[] for _ in batch]

        class RowSampler(LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                forced = torch.full_like(scores, float("-inf"))
                scores = apply_penalties(scores, [s.sampler for s in batch])
                grammars = [None if done[r] else s.sampler.grammar for r, s in enumerate(batch)]
                if any(g is not None for g in grammars):
                    from carpool.generation.structured import apply_grammars

                    scores = apply_grammars(scores.float().clone(), grammars)
                greedy = torch.argmax(scores, dim=-1)
                chosen = []
                for row, seq in enumerate(batch):
                    token = int(greedy[row])
                    if not done[row] and not seq.params.greedy:
                        token = sample_one(scores[row], seq.sampler)
                    forced[row, token] = 0.0
                    chosen.append(token)
                states = [s.sampler for s in batch]
                step_logprobs[:] = chosen_logprobs(scores, chosen, states)
                step_tops[:] = top_alternatives(scores, states)
                return forced

        class RowStopper(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                now = time.perf_counter()
                elapsed_ms = (now - clock["last"]) * 1000
                clock["last"] = now
                first = clock["steps"] == 0
                clock["steps"] += 1
                mono = time.monotonic()
                for row, seq in enumerate(batch):
                    if done[row]:
                        continue
                    reason = engine._expired(seq, mono)
                    if reason is not None:
                        engine._finish_now(seq, reason)
                        done[row] = True
                    elif engine._accept(
                        seq, int(input_ids[row, -1]), step_logprobs[row], step_tops[row]
                    ):
                        done[row] = True
                engine._record(
                    StepRecord(
                        running=len(batch),
                        waiting=engine.num_waiting(),
                        decode_seqs=0 if first else len(batch),
                        prefill_seqs=len(batch) if first else 0,
                        prefill_tokens=sum(s.num_prompt_tokens for s in batch) if first else 0,
                        padded_tokens=len(batch) * width if first else 0,
                        prefill_ms=elapsed_ms if first else 0.0,
                        decode_ms=0.0 if first else elapsed_ms,
                        kv_blocks_used=len(batch) * -(-input_ids.shape[1] // engine.block_size),
                    )
                )
                return done.clone()

        # generate() would stop rows at end-of-sequence on its own, even with ignore_eos, and
        # fills an unset eos from the model's config; the stopping criterion decides instead.
        gen_config = self.model.generation_config
        saved_eos, gen_config.eos_token_id = gen_config.eos_token_id, None
        try:
            self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(s.params.max_tokens for s in batch),
                do_sample=False,
                pad_token_id=self.tok.pad_id,
                logits_processor=LogitsProcessorList([RowSampler()]),
                stopping_criteria=[RowStopper()],
            )
        finally:
            gen_config.eos_token_id = saved_eos
        for seq in batch:  # rows generate() ended without the criterion seeing them (none expected)
            if not seq.finished:
                self._finish_now(seq, "length")

    def _fail_all(self, reason: str) -> None:
        for seq in self.batch + self.waiting + self._take_inbox(block=False):
            self._finish_now(seq, "error", reason)
        self.batch, self.waiting = [], []


def check_fits(seqs: Sequence[GenSequence], max_seq_len: int) -> None:
    """Refuses, before any is queued, a sequence whose prompt plus max_tokens cannot fit."""
    for seq in seqs:
        if seq.num_prompt_tokens + seq.params.max_tokens > max_seq_len:
            raise ValueError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.params.max_tokens}) exceeds max_seq_len {max_seq_len}"
            )


def make_engine(
    mode: str,
    model: Any,
    tokenizer: TokenizerInfo,
    limits: SchedulerLimits,
    max_seq_len: int,
    block_size: int = 64,
    queue_policy: str = "priority",
    vllm: dict[str, Any] | None = None,
    packed_weights: bool = True,
) -> GenerationEngine:
    """The one place that picks an engine by name.

    ``vllm``: for mode 'vllm', the keyword arguments of ``vllm_engine.make_vllm_engine``
    besides the tokenizer and limits (model path, ``VllmOptions``, dtype); vLLM loads the
    weights itself, so ``model`` is unused there.
    ``packed_weights``: mode 'continuous' on CPU in float32 runs its passes on a twin of
    the model with oneDNN-packed linear weights (``runner.pack_linears``; faster, costs a
    second copy of those weights).
    """
    if mode == "vllm":
        # Imported here: the module is light, but vLLM itself must stay optional.
        from carpool.generation.vllm_engine import make_vllm_engine

        if vllm is None:
            raise ValueError("mode 'vllm' needs vllm={'model_path': ..., 'options': ...}")
        return make_vllm_engine(tokenizer=tokenizer, limits=limits, max_seq_len=max_seq_len, **vllm)
    if mode == "continuous":
        from carpool.generation.runner import SlotRunner

        runner = SlotRunner(
            model,
            limits.max_num_seqs,
            max_seq_len,
            block_size,
            tokenizer.pad_id,
            packed_weights=packed_weights,
        )
        return ContinuousEngine(runner, tokenizer, limits, max_seq_len, queue_policy)
    if mode == "static":
        return StaticEngine(model, tokenizer, limits, max_seq_len, block_size)
    raise ValueError(f"unknown engine mode {mode!r}; choose one of {ENGINE_MODES}")


def _sample(logits: Any, seqs: list[GenSequence]) -> list[tuple[int, Any, Any]]:
    """Each row's sampled token, its logprob and the alternatives its request asked for.

    Penalties apply first, then structured-output grammars mask the rows that carry one
    (in place), so all three come from the distribution the token was drawn from.
    """
    states = [s.sampler for s in seqs]
    logits = apply_constraints(apply_penalties(logits, states), states)
    tokens = sample_rows(logits, states)
    return list(
        zip(
            tokens,
            chosen_logprobs(logits, tokens, states),
            top_alternatives(logits, states),
            strict=True,
        )
    )
