"""A client that leaves a stream at any moment has its sequences aborted in the engine.

The engine here is a fake behind the real protocol pieces (``EngineCore``'s submission and
``EventStream``): it emits a token every 0.5 ms from its own thread, like a native engine,
and records every abort. The consumer is ``GeneratorServer.stream``, cancelled at random
points, 1,000 times.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from carpool.generation.native import ThreadedEngine
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.schemas import GenerationCall
from carpool.generation.sequence import GenSequence, TokenizerInfo

EMIT_S = 0.0005


class TickingEngine(ThreadedEngine):
    """Emits one token per running sequence every 0.5 ms; records aborts."""

    mode = "ticking"

    def __init__(self) -> None:
        tok = TokenizerInfo(decode=lambda ids: "x" * len(ids), eos_ids=frozenset({0}), pad_id=0)
        super().__init__(tok, SchedulerLimits(64, 512), 100_000)
        self.running: list[GenSequence] = []
        self.aborted: set[int] = set()
        self.lock = threading.Lock()

    def abort(self, seqs: Sequence[GenSequence]) -> None:
        with self.lock:
            self.aborted.update(seq.id for seq in seqs)
        super().abort(seqs)

    def num_waiting(self) -> int:
        return len(self._inbox)

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.running), **self.totals}

    def _loop_once(self) -> None:
        self.running.extend(self._take_inbox(block=not self.running))
        time.sleep(EMIT_S)
        for seq in list(self.running):
            if seq.cancelled:
                self.running.remove(seq)
                self._finish_now(seq, "cancelled")
            elif self._accept(seq, 5):
                self.running.remove(seq)

    def _fail_all(self, reason: str) -> None:
        for seq in self.running:
            self._finish_now(seq, "error", reason)
        self.running = []


class CharTokenizer:
    """Just enough of a tokenizer for the server: one id per character."""

    chat_template = None

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        return {"input_ids": [[7] * max(len(t), 1) for t in texts]}

    def decode(self, ids: Sequence[int]) -> str:
        return "x" * len(ids)

    def __len__(self) -> int:
        return 32


@pytest.fixture
def server():
    from deployments.generator import GeneratorServer

    engine = TickingEngine()
    config = {
        "source": {"model": "fake", "max_length": 100_000},
        "limits": {"max_tokens_limit": 50_000, "default_max_tokens": 50_000},
        "batching": {
            "batch_wait_timeout_s": 0.0,
            "max_num_seqs": 64,
            "max_step_tokens": 512,
            "max_waiting": 100_000,  # a slow first step (torch import) must not refuse
        },
    }
    server = GeneratorServer(config, tokenizer=CharTokenizer(), engine=engine)
    yield server
    server.close()


def _record_submissions(engine: TickingEngine) -> list[GenSequence]:
    """Every sequence the engine is handed, in order."""
    submitted: list[GenSequence] = []
    real_enqueue = engine._enqueue

    def spy(seqs: list[GenSequence]) -> None:
        submitted.extend(seqs)
        real_enqueue(seqs)

    engine._enqueue = spy  # type: ignore[method-assign]
    return submitted


def test_a_cancelled_stream_always_aborts_its_sequence(server) -> None:
    engine: TickingEngine = server.engine
    submitted = _record_submissions(engine)
    rng = random.Random(0)

    async def consume() -> None:
        async for _ in server.stream(GenerationCall(prompts=["hello"], max_tokens=50_000)):
            pass

    async def main() -> int:
        cancelled_running = 0
        for _ in range(1000):
            task = asyncio.create_task(consume())
            await asyncio.sleep(rng.uniform(0, 0.006))  # before, during or after submission
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            cancelled_running += 1
        return cancelled_running

    assert asyncio.run(main()) == 1000
    # Every sequence that reached the engine and did not finish on its own was aborted.
    assert submitted, "no request reached the engine: the test would prove nothing"
    never_aborted = [s for s in submitted if s.id not in engine.aborted]
    assert never_aborted == []
    deadline = time.monotonic() + 30
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == []  # no slot kept generating


def test_a_local_stream_closed_between_events_aborts_its_sequence(server) -> None:
    """Direct streaming: the HTTP handler reads the replica's own stream in-process
    (``LocalHandle``) and, when the client leaves between messages, closes it."""
    from carpool.calls import open_stream
    from carpool.local_handle import LocalHandle

    engine: TickingEngine = server.engine
    submitted = _record_submissions(engine)
    rng = random.Random(1)
    call = GenerationCall(prompts=["hello"], max_tokens=50_000)

    kept = []  # held, so no stream is closed by the garbage collector instead of cancel()

    async def main() -> None:
        for _ in range(200):
            events, _first = await open_stream(LocalHandle(server), call)
            kept.append(events)
            for _ in range(rng.randrange(0, 4)):
                await events.__anext__()
            events.cancel()
        await asyncio.sleep(0.05)  # the closes run as tasks on this loop
        assert [s for s in submitted if s.id not in engine.aborted] == []

    asyncio.run(main())
    assert len(submitted) == 200
    deadline = time.monotonic() + 30
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == []
