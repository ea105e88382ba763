"""carpool's own generation engines: a thread each, stepping a transformers model.

- ``ContinuousEngine`` (iteration-level batching): every step decodes one token for each
  running sequence and prefills prompt chunks of new ones, within ``max_num_seqs`` and
  ``max_step_tokens``. A finished, cancelled or timed-out sequence leaves at the end of the
  step it is noticed in and its slot goes to the next waiting request. It runs its own
  scheduler over the slot KV cache (``runner.SlotRunner``).
- ``static.StaticEngine``: one padded ``generate`` per batch, for comparison.

Both give the same greedy tokens as an unbatched ``generate`` for the same prompt, and apply
sampling per sequence (``sampling.SamplerState``). The server talks to them through
``protocol.GenerationEngine`` (async); ``submit`` with caller-set sinks is the synchronous
door for scripts and tests. Events a step produces for sequences read on an event loop are
handed over in one ``call_soon_threadsafe`` per step, not one per token.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from carpool.generation.assembly import EngineCore
from carpool.generation.prefix_cache import CachedPrefix, PrefixCache
from carpool.generation.sampling import (
    apply_constraints,
    apply_penalties,
    chosen_logprobs,
    sample_rows,
    top_alternatives,
)
from carpool.generation.scheduler import Scheduler, SchedulerLimits
from carpool.generation.sequence import (
    GenSequence,
    SeqEvent,
    StepRecord,
    TokenizerInfo,
    check_fits,
)

logger = logging.getLogger(__name__)

# How long an idle engine thread sleeps between checks when nothing wakes it.
IDLE_POLL_S = 0.5


class ThreadedEngine(EngineCore):
    """An engine whose steps run in a thread of its own, fed through an inbox."""

    def __init__(self, tokenizer: TokenizerInfo, limits: SchedulerLimits, max_seq_len: int) -> None:
        super().__init__(tokenizer, limits, max_seq_len)
        self._inbox: list[GenSequence] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[GenSequence, SeqEvent]] = []

    # --- called from any thread ---------------------------------------------------------

    def submit(self, seqs: Sequence[GenSequence]) -> None:
        """Queues sequences whose sinks the caller set; admitted at the engine's next step."""
        check_fits(seqs, self.max_seq_len)
        self._enqueue(list(seqs))

    def _enqueue(self, seqs: list[GenSequence]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._inbox.extend(seqs)
            self._ensure_thread()
            self._cond.notify()

    def cancel(self, seq: GenSequence) -> None:
        self.abort([seq])

    def abort(self, seqs: Sequence[GenSequence]) -> None:
        """Marks sequences cancelled; their slots are freed at the next step."""
        for seq in seqs:
            seq.cancelled = True
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_health(self) -> str | None:
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
        return self._stalled(self.num_waiting() + int(self.stats().get("running", 0)))

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
                self._flush()
        self._fail_all("the engine was shut down")
        self._flush()

    @abstractmethod
    def _loop_once(self) -> None:
        """One scheduling round (a step, or a whole static batch)."""

    @abstractmethod
    def _fail_all(self, reason: str) -> None:
        """Finishes every sequence the engine holds with an error and resets its state."""

    def _record(self, record: StepRecord) -> None:
        super()._record(record)
        self._flush()  # each step's events leave with the step (static: inside generate)

    def _deliver(self, seq: GenSequence, event: SeqEvent) -> None:
        if seq.loop is None:
            super()._deliver(seq, event)
        else:
            self._outbox.append((seq, event))

    def _flush(self) -> None:
        """Hands a step's events to their loops, one wake-up per loop instead of per token."""
        if not self._outbox:
            return
        box, self._outbox = self._outbox, []
        by_loop: dict[Any, list[tuple[GenSequence, SeqEvent]]] = {}
        for seq, event in box:
            by_loop.setdefault(seq.loop, []).append((seq, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # that loop is closed: its readers are gone
                logger.debug("dropped %d events for a closed loop", len(items))


def _deliver_all(items: list[tuple[GenSequence, SeqEvent]]) -> None:
    for seq, event in items:
        try:
            seq.sink(event)
        except Exception:
            logger.debug("sink of sequence %s failed", seq.id, exc_info=True)


class ContinuousEngine(ThreadedEngine):
    """Iteration-level batching over a slot KV cache (see the module docstring)."""

    mode = "continuous"

    def __init__(
        self,
        runner: Any,
        tokenizer: TokenizerInfo,
        limits: SchedulerLimits,
        max_seq_len: int,
        queue_policy: str = "priority",
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        super().__init__(tokenizer, limits, max_seq_len)
        self.runner = runner
        self.scheduler: Scheduler[GenSequence] = Scheduler(limits, queue_policy)
        # Slot order: decoding sequences hold rows 0..D-1, prefilling ones rows D..D+P-1.
        self.decoding: list[GenSequence] = []
        self.prefilling: list[GenSequence] = []
        # Prefixes of finished sequences (None: off), and the one each waiting sequence will
        # copy into its row when admitted (its num_computed already counts it).
        self.prefix_cache = prefix_cache
        self._reused: dict[int, tuple[CachedPrefix, int]] = {}

    def set_limits(self, max_num_seqs: int, max_step_tokens: int) -> None:
        super().set_limits(max_num_seqs, max_step_tokens)
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
            **(self.prefix_cache.stats() if self.prefix_cache else {}),
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
            self._reuse_prefix(seq)
            self.scheduler.add(seq)
        self._reap()
        plan = self.scheduler.schedule(self.decoding, self.prefilling)
        if not plan:
            return
        self.prefilling.extend(plan.admitted)
        for seq in plan.admitted:
            reused = self._reused.pop(seq.id, None)
            if reused is not None:
                entry, length = reused
                row = len(self.decoding) + self.prefilling.index(seq)
                self.runner.cache.write_prefix(row, entry.keys, entry.values, length)
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
                self._reused.pop(seq.id, None)
                self._finish_now(seq, reason)

    def _reuse_prefix(self, seq: GenSequence) -> None:
        """Counts the longest cached prefix of a new prompt as computed; its values are
        copied into the sequence's row when it is admitted (the entry is held till then)."""
        if self.prefix_cache is None or seq.num_computed:
            return
        hit = self.prefix_cache.lookup(seq.prompt_ids)
        if hit is not None:
            self._reused[seq.id] = hit
            seq.num_computed = seq.cached_tokens = hit[1]

    def _remember_prefix(self, seq: GenSequence, row: int) -> None:
        """Keeps the values a leaving sequence computed (prompt and output) for later prompts."""
        if self.prefix_cache is None or seq.num_computed < self.prefix_cache.block_tokens:
            return
        tokens = (seq.prompt_ids + seq.output_ids)[: seq.num_computed]
        self.prefix_cache.store(tokens, lambda n: self.runner.cache.read_prefix(row, n))

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
            self._remember_prefix(seq, i)
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
            self._remember_prefix(seq, d + j)
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
        self._reused.clear()
        self.runner.cache.release()


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
