"""What crosses a Ray hop on the way to a generator and back, as typed objects.

A request travels ingress -> (router) -> generator as a ``GenerationCall``
(``carpool.generation.schemas``); its answer comes back as one ``GenerationResult``, or as
``GenerationEvent``s when streamed. When the router chose the model (``model: "auto"``), its
``RouteDecision`` rides in the answer's ``decision`` field (on a stream, the start event's);
``RouteDecision.to_dict()`` is the public ``carpool`` object and ``x-carpool-*`` headers, made
only at the HTTP edge.

These cross a hop per request and per streamed message: plain slotted dataclasses, built
without validation (the generator builds them from its own values) and pickled field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """What the router decided for one request (``router.core.Route.record``)."""

    model: str  # the model that answered (large once escalated)
    lane: str
    predicted_tokens: float  # rounded to 0.1
    escalated: bool
    overflow: bool  # served on small because large was backed up
    reason: str
    queue_ms: float  # time waited at the model's gate (the last call's, when escalated)
    actual_tokens: int | None = None  # set once the whole answer is in; None on a stream start

    def to_dict(self) -> dict[str, Any]:
        """The response's ``carpool`` object (and, but for ``reason``, the ``x-carpool-*``
        headers): public API, keys in this order."""
        out: dict[str, Any] = {
            "model": self.model,
            "lane": self.lane,
            "predicted_tokens": self.predicted_tokens,
            "escalated": self.escalated,
            "overflow": self.overflow,
            "reason": self.reason,
            "queue_ms": self.queue_ms,
        }
        if self.actual_tokens is not None:
            out["actual_tokens"] = self.actual_tokens
        return out


@dataclass(slots=True)
class Choice:
    """One choice of a whole answer."""

    index: int
    text: str
    finish_reason: str
    # The endpoint-neutral logprobs record (``carpool.generation.logprobs``), only when asked.
    logprobs: dict[str, Any] | None = None


@dataclass(slots=True)
class GenerationResult:
    """A generator's whole answer (``GeneratorServer.generate``)."""

    model: str
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    # Choice 0's tokens, for Python callers (the router's cascade judges small's confidence);
    # the HTTP API leaves them out. The logprobs are there when the call asked for them or is
    # ``judged`` (vLLM computes them only then; carpool's own engines always do).
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    decision: RouteDecision | None = None  # set by the router (model "auto")


EventType = Literal["start", "delta", "end"]


@dataclass(slots=True)
class GenerationEvent:
    """One message of a streamed answer (``GeneratorServer.stream``): a ``start``, then
    ``delta``s as text arrives, then ``end``. Fields a type does not use keep their defaults.
    """

    type: EventType
    model: str = ""  # start: the model that answers
    prompt_tokens: int = 0  # start, end
    index: int = 0  # delta: the choice
    text: str = ""  # delta
    finish_reason: str | None = None  # delta: set on the choice's last
    logprobs: dict[str, Any] | None = None  # delta, when asked (as Choice.logprobs)
    completion_tokens: int = 0  # end
    decision: RouteDecision | None = None  # start, when the router chose the model

    @classmethod
    def start(cls, model: str, prompt_tokens: int) -> GenerationEvent:
        return cls("start", model=model, prompt_tokens=prompt_tokens)

    @classmethod
    def end(cls, prompt_tokens: int, completion_tokens: int) -> GenerationEvent:
        return cls("end", prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
