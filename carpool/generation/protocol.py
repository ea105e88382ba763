"""The one interface between a generator server and its engines (async, like Ray Serve LLM's).

A server hands an engine the sequences of one request (``generate``) or of the requests that
arrived together (``generate_batch``: one submission, one hop into the engine) and reads each
request's ``SeqEvent``s from an ``EventStream`` on its own event loop. Leaving a stream
early, by ``close()`` or by the consuming task being cancelled at any point, aborts its
unfinished sequences in the engine: the cancel cannot be lost, because the stream awaits a
plain ``Queue.get`` (no ``asyncio.wait_for``, which on CPython 3.11 can swallow a cancel that
arrives as the inner get completes, gh-86296) and its deadline is a timer that puts an
event, not a cancellation.

Engines: ``native.ContinuousEngine`` and ``static.StaticEngine`` (carpool's own, a thread
each) and ``vllm_engine.VllmEngine`` (vLLM's ``AsyncLLM`` on the caller's loop); the
``factory`` module picks one by name. Tests inject fakes that satisfy ``GenerationEngine``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.sequence import EngineListener, GenSequence, SeqEvent, TokenizerInfo


class GenerationEngine(Protocol):
    """What a generator server needs of an engine."""

    mode: str
    tok: TokenizerInfo
    limits: SchedulerLimits
    max_seq_len: int
    listeners: list[EngineListener]
    # How long a sequence holds its slot, averaged (admission estimates waits with it).
    mean_slot_s: float

    async def start(self) -> None:
        """Readies the engine on the caller's loop (idempotent; ``generate`` calls it too)."""

    def generate(self, seqs: Sequence[GenSequence], grace_s: float | None = None) -> EventStream:
        """Submits one request's sequences; their events arrive on the returned stream."""

    def generate_batch(
        self, groups: Sequence[Sequence[GenSequence]], grace_s: float | None = None
    ) -> list[EventStream]:
        """Submits several requests' sequences at once: one stream per group, same order."""

    def abort(self, seqs: Sequence[GenSequence]) -> None:
        """Stops sequences; each ends with finish reason 'cancelled' unless already done."""

    def check_health(self) -> str | None:
        """Why the engine cannot serve, or None."""

    def stats(self) -> dict[str, Any]:
        """Current and cumulative figures."""

    def num_waiting(self) -> int:
        """Sequences submitted but not yet running."""

    def estimated_wait_s(self, extra: int = 0) -> float:
        """Time until a request queued now gets a slot, roughly."""

    def set_limits(self, max_num_seqs: int, max_step_tokens: int) -> None:
        """Applies new scheduling bounds (from reconfigure)."""

    def close(self) -> None:
        """Stops the engine; what it still holds ends with an error."""


class EventStream:
    """One request's events, in order; ends after every sequence's final event.

    ``threadsafe``: the engine calls the sinks from another thread (delivered through
    ``loop.call_soon_threadsafe``, batched per step by the engine); else on this loop.
    ``deadline`` (monotonic): past it the stream ends with ``TimeoutError``, a safety net for
    an engine that stopped reporting (engines time sequences out themselves before it).
    """

    def __init__(
        self,
        seqs: Sequence[GenSequence],
        abort: Callable[[Sequence[GenSequence]], None],
        threadsafe: bool,
        deadline: float | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[SeqEvent | None] = asyncio.Queue()
        self._seqs = list(seqs)
        self._abort = abort
        self._unfinished = len(self._seqs)
        self._closed = False
        for seq in self._seqs:
            seq.sink = self._queue.put_nowait
            seq.loop = loop if threadsafe else None
        self._timer = (
            None
            if deadline is None
            else loop.call_later(
                max(0.0, deadline - time.monotonic()), self._queue.put_nowait, None
            )
        )

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> SeqEvent:
        if self._unfinished == 0:
            self.close()
            raise StopAsyncIteration
        try:
            event = await self._queue.get()
        except BaseException:  # cancelled (the client left) or the loop is closing
            self.close()
            raise
        return self._count(event)

    def ready(self) -> list[SeqEvent]:
        """Events that arrived already, without waiting (to merge several into one message)."""
        events = []
        while self._unfinished and not self._queue.empty():
            events.append(self._count(self._queue.get_nowait()))
        return events

    def close(self) -> None:
        """Aborts the sequences that have not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        left = [seq for seq in self._seqs if not seq.finished]
        if left:
            self._abort(left)

    def _count(self, event: SeqEvent | None) -> SeqEvent:
        if event is None:
            self.close()
            raise TimeoutError("the engine reported nothing before the request's deadline")
        if event.finish_reason is not None:
            self._unfinished -= 1
        return event
