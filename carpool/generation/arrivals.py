"""How calls reach a generator's engine together: a ticket per call, a collector per batch.

``@serve.batch`` gathers a replica's arrivals of a few ms; without Serve (tests, scripts)
``ArrivalCollector`` does the same. The batch handler admits, tokenises and submits the
batch at once and leaves each call its ``Ticket``: the engine's stream, or the error that
call alone gets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from carpool.errors import RequestError
from carpool.generation.protocol import EventStream
from carpool.generation.schemas import MAX_SEQS_PER_CALL, GenerationCall
from carpool.generation.sequence import GenSequence


@dataclass
class Ticket:
    """One call on its way through a batch; ``stream`` once the engine has it."""

    call: GenerationCall
    stream: EventStream | None = None
    prompt_tokens: int = 0
    error: RequestError | None = None
    abandoned: bool = False  # the caller left before the batch answered
    seqs: list[GenSequence] = field(default_factory=list)

    @property
    def weight(self) -> int:
        """Sequences the call asks for, capped: a call over the cap is refused (400) inside
        the batch, and Serve's batcher must never see an item heavier than its batch."""
        return min(max(1, len(self.call.prompts)) * self.call.n, MAX_SEQS_PER_CALL)

    def abandon(self) -> None:
        """The caller left: a stream that exists, or comes later, is closed (aborted)."""
        self.abandoned = True
        if self.stream is not None:
            self.stream.close()


class ArrivalCollector:
    """Gathers the calls arriving within ``wait_s`` of the first into one batch.

    What ``@serve.batch`` does for the deployment, for the plain server (tests, scripts).
    """

    def __init__(self, run: Any) -> None:
        self._run = run
        self._pending: list[Ticket] = []
        self._done: asyncio.Event | None = None

    async def add(self, ticket: Ticket, wait_s: float) -> None:
        self._pending.append(ticket)
        if self._done is None:
            done = self._done = asyncio.Event()
            asyncio.get_running_loop().call_later(wait_s, self._flush, done)
        else:
            done = self._done
        await done.wait()

    def _flush(self, done: asyncio.Event) -> None:
        tickets, self._pending, self._done = self._pending, [], None

        async def run() -> None:
            try:
                await self._run(tickets)
            finally:
                done.set()

        asyncio.get_running_loop().create_task(run())
