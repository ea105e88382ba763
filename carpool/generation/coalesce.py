"""Stream messages of a few tokens or a few ms: fewer, larger deltas per choice.

Every message of a stream crosses the replica, the ingress and the proxy; sending each token
on its own is what kept carpool behind vLLM's server. A choice's first text goes out at once
(time to first token is untouched), its end at once, and between them text waits until
``tokens`` have gathered or ``ms`` have passed since its last message (vLLM's
``stream_interval``, with a clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from carpool.generation.sequence import SeqEvent


class StreamCoalescer:
    """Per choice, the events not sent yet; lets them out by the stream interval."""

    def __init__(self, tokens: int, ms: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokens = tokens
        self.s = ms / 1000
        self._clock = clock
        self._held: dict[int, list[SeqEvent]] = {}
        self._sent_at: dict[int, float] = {}

    def add(self, events: list[SeqEvent]) -> list[SeqEvent]:
        now = self._clock()
        for event in events:
            self._held.setdefault(event.index, []).append(event)
        out = []
        for index in {e.index: None for e in events}:
            held = self._held[index]
            last = held[-1]
            first = index not in self._sent_at
            count = sum(len(e.token_ids) for e in held)
            if (
                last.finish_reason is not None
                or first
                or count >= self.tokens
                or now - self._sent_at[index] >= self.s
            ):
                out.append(merge_events(held))
                self._held[index] = []
                self._sent_at[index] = now
        return out


def merge_events(events: list[SeqEvent]) -> SeqEvent:
    """One event standing for several consecutive ones of a choice."""
    if len(events) == 1:
        return events[0]
    last = events[-1]
    return SeqEvent(
        index=last.index,
        text="".join(e.text for e in events),
        token_ids=[t for e in events for t in e.token_ids],
        token_logprobs=[x for e in events for x in e.token_logprobs],
        top_logprobs=[x for e in events for x in e.top_logprobs],
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        error=last.error,
    )
