"""`model: auto` streamed: the router commits to a model before generating, so the first
token goes out as soon as it exists; answered whole, `auto` still cascades. No Ray."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from carpool.generation.hops import Choice, GenerationEvent, GenerationResult
from carpool.generation.schemas import GenerationCall
from router.core import RouterServer

TOKENS = 20
TOKEN_S = 0.02  # each token takes this long, so a whole answer takes TOKENS * TOKEN_S


class SlowGenerator:
    """Emits TOKENS tokens, one every TOKEN_S, streamed or whole."""

    def __init__(self, name: str, finish: str = "stop", logprobs: bool = False) -> None:
        self.name, self.finish, self.logprobs = name, finish, logprobs
        self.generated: list[GenerationCall] = []
        self.streamed: list[GenerationCall] = []

    async def generate(self, call: GenerationCall) -> GenerationResult:
        self.generated.append(call)
        await asyncio.sleep(TOKENS * TOKEN_S)
        return GenerationResult(self.name, [Choice(0, "w " * TOKENS, self.finish)], 5, TOKENS)

    async def stream(self, call: GenerationCall) -> AsyncIterator[GenerationEvent]:
        self.streamed.append(call)
        yield GenerationEvent.start(self.name, 5)
        for i in range(TOKENS):
            await asyncio.sleep(TOKEN_S)
            logprobs = None
            if self.logprobs:
                logprobs = {"tokens": ["w "], "token_logprobs": [-0.1], "top_logprobs": [[]]}
            yield GenerationEvent(
                "delta",
                index=0,
                text="w ",
                finish_reason=self.finish if i == TOKENS - 1 else None,
                logprobs=logprobs,
            )
        yield GenerationEvent.end(5, TOKENS)


def _call(prompt: str, max_tokens: int = 32) -> GenerationCall:
    return GenerationCall(prompts=[prompt], max_tokens=max_tokens)


def _start(router: RouterServer, call: GenerationCall) -> GenerationEvent:
    """The start event of a streamed call (the stream is read to its end)."""

    async def read() -> list[GenerationEvent]:
        return [e async for e in router.stream(call)]

    events = asyncio.run(read())
    assert events[0].decision is not None
    return events[0]


async def _timed(
    events: AsyncIterator[GenerationEvent],
) -> list[tuple[float, GenerationEvent]]:
    started = time.monotonic()
    return [(time.monotonic() - started, event) async for event in events]


def _models() -> tuple[SlowGenerator, SlowGenerator]:
    # small "hits max_tokens": a cascade would escalate every answer to large.
    return SlowGenerator("small", finish="length"), SlowGenerator("large")


@pytest.mark.parametrize("policy", ["cascade", "learned_cascade"])
def test_a_streamed_auto_request_sends_its_first_token_before_small_would_finish(
    policy: str,
) -> None:
    small, large = _models()
    router = RouterServer({"policy": policy}, {"small": small, "large": large})
    timed = asyncio.run(_timed(router.stream(_call("Answer yes or no: is ice cold?"))))
    first_delta = next(t for t, e in timed if e.type == "delta")
    total = timed[-1][0]
    assert total >= TOKENS * TOKEN_S * 0.9
    # Under the cascade the first byte came after small's whole answer (and large's too).
    assert first_delta < total / 4, (first_delta, total)
    start = timed[0][1]
    assert start.type == "start" and start.model == "small"
    record = start.decision
    assert record is not None and record.model == "small" and not record.escalated
    assert record.reason.startswith("streamed, chosen before generating")
    # One model streamed it; nothing was generated whole and judged, nothing escalated.
    assert len(small.streamed) == 1 and not small.generated
    assert not large.streamed and not large.generated
    assert [e.text for _, e in timed if e.type == "delta"] == ["w "] * TOKENS


def test_a_whole_auto_answer_still_cascades() -> None:
    small, large = _models()
    router = RouterServer({"policy": "learned_cascade"}, {"small": small, "large": large})
    result = asyncio.run(router.generate(_call("Answer yes or no: is ice cold?")))
    record = result.decision
    assert record is not None and record.escalated and record.model == "large"
    assert result.model == "large"
    assert len(small.generated) == len(large.generated) == 1
    assert not small.streamed and not large.streamed
    assert router.learner.observations == 1  # the cascade's outcome trains the learner


def test_a_stream_predicted_long_or_with_a_hard_cue_goes_to_large_up_front() -> None:
    small, large = _models()
    router = RouterServer(
        {"policy": "cascade", "max_small_tokens": 16}, {"small": small, "large": large}
    )
    essay = _start(router, _call("Write a long essay about rivers in detail", 2048))
    assert essay.decision is not None
    assert essay.model == "large" and essay.decision.model == "large"
    assert "predicted" in essay.decision.reason
    code = _start(router, _call("Write python code for a parser", 8))
    assert code.decision is not None
    assert code.model == "large" and "cue code" in code.decision.reason
    short = _start(router, _call("Yes or no?", 4))
    assert short.model == "small"
    assert not small.generated and not large.generated  # no cascade on any stream


def test_prompts_the_learner_knows_escalate_stream_from_large() -> None:
    small, large = _models()
    router = RouterServer({"policy": "learned_cascade"}, {"small": small, "large": large})
    router.learner.observations = router.learner.min_observations
    router.learner.weights[:] = 5.0  # confident: every prompt escalates
    start = _start(router, _call("Answer yes or no: is ice cold?"))
    assert start.decision is not None
    assert start.model == "large" and start.decision.reason.startswith("learned")
    assert not small.streamed


def test_a_stream_still_overflows_to_small_when_large_is_backed_up() -> None:
    small, large = _models()
    router = RouterServer(
        {"policy": "cascade", "max_small_tokens": 1, "latency_target_ms": 10},
        {"small": small, "large": large},
    )
    router.gates["large"].queued_tokens = 10_000
    start = _start(router, _call("Write a story about dragons", 512))
    assert start.decision is not None
    assert start.model == "small" and start.decision.overflow


def test_logprobs_stream_through_auto() -> None:
    small = SlowGenerator("small", logprobs=True)
    router = RouterServer({"policy": "cascade"}, {"small": small, "large": SlowGenerator("l")})

    async def deltas() -> list[GenerationEvent]:
        call = _call("Yes or no?", 4).model_copy(update={"logprobs": 0})
        return [e async for e in router.stream(call) if e.type == "delta"]

    events = asyncio.run(deltas())
    assert len(events) == TOKENS
    assert all(e.logprobs is not None and e.logprobs["tokens"] == ["w "] for e in events)


# --- the generate pipeline's SSE over the router ------------------------------------------


class _Events:
    """What ``handle.options(stream=True).stream.remote(call)`` returns: an async iterator
    of the deployment's events that can be cancelled."""

    def __init__(self, events: AsyncIterator[GenerationEvent]) -> None:
        self.events = events
        self.cancelled = False

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> GenerationEvent:
        return await self.events.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class _Whole:
    """``handle.generate``: ``remote(call)`` awaits the target's whole answer."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def remote(self, call: GenerationCall) -> Any:
        assert isinstance(call, GenerationCall), type(call)  # typed across the hop
        return self.target.generate(call)


class _Handle:
    """A deployment handle over a router (or generator) object."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.stream = self
        self.generate = _Whole(target)

    def options(self, **_: Any) -> _Handle:
        return self

    def remote(self, call: GenerationCall) -> _Events:
        assert isinstance(call, GenerationCall), type(call)  # typed across the hop
        return _Events(self.target.stream(call))


def test_streamed_auto_chunks_name_the_model_that_answers_and_carry_logprobs() -> None:
    from carpool.generation.schemas import ChatCompletionRequest
    from pipelines.generate import GenerateArgs, GenerateHandler

    small, large = SlowGenerator("small", logprobs=True), SlowGenerator("large")
    router = RouterServer({"policy": "learned_cascade"}, {"small": small, "large": large})
    handler = GenerateHandler(
        _Handle(small), _Handle(large), GenerateArgs(), router=_Handle(router), created=1
    )
    body = ChatCompletionRequest.model_validate(
        {
            "model": "auto",
            "messages": [{"role": "user", "content": "Yes or no?"}],
            "max_tokens": 4,
            "stream": True,
            "logprobs": True,  # refused for streamed auto while it cascaded
        }
    )

    async def read() -> tuple[Any, list[str]]:
        response = await handler.chat_response(body)
        return response, [piece async for piece in response.body_iterator]

    response, pieces = asyncio.run(read())
    assert response.headers["x-carpool-model"] == "small"
    payloads = [p.removeprefix("data: ").strip() for p in pieces]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["model"] for c in chunks} == {"small"}  # not "auto": the model that answered
    with_logprobs = [c for c in chunks if c["choices"] and c["choices"][0].get("logprobs")]
    assert len(with_logprobs) == TOKENS


def test_a_whole_auto_answer_keeps_the_public_carpool_object_and_headers() -> None:
    """The typed decision becomes the response's ``carpool`` object and ``x-carpool-*``
    headers at the HTTP edge, in the public shape (keys and order)."""
    from carpool.generation.schemas import ChatCompletionRequest
    from pipelines.generate import GenerateArgs, GenerateHandler

    small, large = _models()  # small stops at max_tokens: the cascade escalates
    router = RouterServer({"policy": "cascade"}, {"small": small, "large": large})
    handler = GenerateHandler(
        _Handle(small), _Handle(large), GenerateArgs(), router=_Handle(router), created=1
    )
    body = ChatCompletionRequest.model_validate(
        {"model": "auto", "messages": [{"role": "user", "content": "Yes or no?"}]}
    )
    response = asyncio.run(handler.chat_response(body))
    payload = json.loads(response.body)
    record = payload["carpool"]
    assert list(record) == [
        "model",
        "lane",
        "predicted_tokens",
        "escalated",
        "overflow",
        "reason",
        "queue_ms",
        "actual_tokens",
    ]
    assert record["model"] == payload["model"] == "large" and record["escalated"] is True
    assert record["actual_tokens"] == TOKENS
    headers = {k: v for k, v in response.headers.items() if k.startswith("x-carpool-")}
    assert headers == {
        f"x-carpool-{k.replace('_', '-')}": str(v) for k, v in record.items() if k != "reason"
    }
    assert headers["x-carpool-escalated"] == "True"
