"""One owner per concern: one retry loop per generator call, one queue order. No Ray.

A request for ``auto`` reaches a generator through the ingress's handler, the router it hosts
(in-process, a ``LocalHandle``) and the router's generator client; only that client retries
(``carpool.calls.call_retrying``), as ``call_idempotent`` does for a named model. A fake
handle plays Serve sending each call to the next replica; the process's live replica counts
say two.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError

from carpool import calls, topology
from carpool.errors import RequestError
from carpool.generation.hops import Choice, GenerationEvent, GenerationResult
from carpool.generation.schemas import ChatCompletionRequest, GenerationCall
from carpool.local_handle import LocalHandle
from carpool.topology import DeploymentView, LiveReplicas
from pipelines.generate_handler import GenerateArgs, GenerateHandler
from router.core import RouterServer
from router.deployment import _HandleClient

DEPLOYMENT = "generate/small"


def refusal(replica: str) -> RequestError:
    """A replica's overload refusal, stamped as a Serve replica stamps it (short hold)."""
    return RequestError(
        503,
        f"replica {replica} is full",
        code="overloaded",
        retry_after_s=0.05,
        replica=replica,
        deployment=DEPLOYMENT,
    )


class _Events:
    """A streamed call on one replica: its first event fails as the replica's did."""

    def __init__(self, replicas: Replicas, replica: str) -> None:
        self._replicas, self._replica = replicas, replica
        self._events = self._generate()

    async def _generate(self) -> AsyncIterator[GenerationEvent]:
        behaviour = self._replicas.behaviour[self._replica]
        self._replicas.fail(self._replica, behaviour)
        yield GenerationEvent.start(f"small@{self._replica}", 5)
        if behaviour == "lost_mid_stream":
            raise ActorUnavailableError(f"replica {self._replica} died", None)
        yield GenerationEvent("delta", text=f"from {self._replica}", finish_reason="stop")
        yield GenerationEvent.end(5, 3)

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> GenerationEvent:
        return await self._events.__anext__()

    def cancel(self) -> None:
        self._replicas.cancelled.append(self._replica)


class _Method:
    def __init__(self, replicas: Replicas, stream: bool) -> None:
        self._replicas, self._stream = replicas, stream

    def remote(self, call: GenerationCall) -> Any:
        assert isinstance(call, GenerationCall)
        replica = self._replicas.next_replica()
        if self._stream:
            return _Events(self._replicas, replica)
        return self._replicas.answer(replica)


class Replicas:
    """A generator deployment's handle as Serve drives it: each call goes to the next replica
    in turn, which answers (``ok``), refuses for overload (``full``) or has died (``lost``;
    ``lost_mid_stream`` after a stream's first event). ``calls`` says which replica each call
    reached."""

    def __init__(self, behaviour: dict[str, str]) -> None:
        self.behaviour = behaviour
        self.calls: list[str] = []
        self.cancelled: list[str] = []
        self.generate = _Method(self, stream=False)
        self.stream = _Method(self, stream=True)

    def options(self, **_: Any) -> Replicas:
        return self

    def next_replica(self) -> str:
        names = list(self.behaviour)
        replica = names[len(self.calls) % len(names)]
        self.calls.append(replica)
        return replica

    @staticmethod
    def fail(replica: str, behaviour: str) -> None:
        if behaviour == "full":
            raise refusal(replica)
        if behaviour == "lost":
            raise ActorUnavailableError(f"replica {replica} died", None)

    async def answer(self, replica: str) -> GenerationResult:
        self.fail(replica, self.behaviour[replica])
        return GenerationResult(f"small@{replica}", [Choice(0, f"from {replica}", "stop")], 5, 3)


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> LiveReplicas:
    """Two live replicas of small, as the ingress and the router both read them; the
    ingress's refusal memory starts empty."""
    counts = LiveReplicas(lambda: {DEPLOYMENT: DeploymentView(2, 8)}, interval_s=3600)
    counts.refresh_now()
    monkeypatch.setattr(topology, "_shared", counts)
    monkeypatch.setattr(calls, "_REFUSALS", {})
    return counts


def _router(small: Replicas, live: LiveReplicas) -> RouterServer:
    return RouterServer({}, {"small": _HandleClient(small, live.count, live.recount)})


def _handler(small: Replicas, live: LiveReplicas) -> GenerateHandler:
    """The ingress's handler over small and the router it hosts, as ``GenerateIngress``."""
    args = GenerateArgs(large=None)
    return GenerateHandler(small, None, args, LocalHandle(_router(small, live)), created=1)


def _ask(handler: GenerateHandler, model: str, stream: bool) -> tuple[str, list[str]]:
    """The answer's text (streamed: its deltas, joined) and, streamed, the SSE payloads."""
    body = ChatCompletionRequest.model_validate(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )

    async def ask() -> tuple[str, list[str]]:
        response = await handler.chat_response(body)
        if not stream:
            return json.loads(response.body)["choices"][0]["message"]["content"], []
        payloads = [p.removeprefix("data: ").strip() async for p in response.body_iterator]
        chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
        )
        return text, payloads

    return asyncio.run(ask())


# --- one retry loop ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["auto", "small"])
def test_a_refused_replica_is_retried_once_elsewhere_and_that_one_answers(
    live: LiveReplicas, model: str, stream: bool
) -> None:
    small = Replicas({"a": "full", "b": "ok"})
    text, _ = _ask(_handler(small, live), model, stream)
    assert text == "from b"
    assert small.calls == ["a", "b"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_auto_request_every_replica_refuses_is_tried_by_one_loop_only(
    live: LiveReplicas, stream: bool
) -> None:
    """The router's client tries each live replica once, then the refusal goes back. With a
    second loop around the router (the ingress retrying ``auto`` too), every outer try re-ran
    the router's two: 16 calls (8 outer tries) instead of 2."""
    small = Replicas({"a": "full", "b": "full"})
    with pytest.raises(RequestError) as refused:
        _ask(_handler(small, live), "auto", stream)
    assert refused.value.status_code == 503 and refused.value.code == "overloaded"
    tries_of_one_loop = live.count(DEPLOYMENT)  # each live replica once
    assert len(small.calls) == tries_of_one_loop == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_lost_before_the_first_event_is_retried_once_by_the_routers_client(
    live: LiveReplicas, stream: bool
) -> None:
    small = Replicas({"a": "lost", "b": "ok"})
    router = _router(small, live)
    call = GenerationCall(prompts=["hi"], max_tokens=8)

    async def ask() -> str:
        if not stream:
            return (await router.generate(call)).choices[0].text
        return "".join([e.text async for e in router.stream(call) if e.type == "delta"])

    assert asyncio.run(ask()) == "from b"
    assert small.calls == ["a", "b"]
    assert small.cancelled == (["a"] if stream else [])  # the lost stream is let go

    # Lost again on the retry: once only, then the client gets a 503.
    small = Replicas({"a": "lost", "b": "lost"})
    with pytest.raises(RequestError) as failed:
        _ask(_handler(small, live), "auto", stream)
    assert failed.value.status_code == 503 and failed.value.code == "backend_unavailable"
    assert small.calls == ["a", "b"]


def test_a_stream_under_way_is_never_restarted(live: LiveReplicas) -> None:
    small = Replicas({"a": "lost_mid_stream", "b": "ok"})
    text, payloads = _ask(_handler(small, live), "auto", stream=True)
    assert small.calls == ["a"] and text == ""  # the start event went out: no retry
    assert "backend_unavailable" in payloads[-1]  # the break is reported in the stream


# --- one queue order ----------------------------------------------------------------------


def _vllm(priority: bool) -> dict[str, Any]:
    return {"mode": "vllm", "vllm": {"priority_scheduling": priority}}


@pytest.mark.parametrize("tier", ["small", "large"])
def test_router_lanes_and_vllm_priority_scheduling_are_refused_together(tier: str) -> None:
    with pytest.raises(ValidationError) as refused:
        GenerateArgs.model_validate({tier: _vllm(True), "router": {"lanes_enabled": True}})
    message = str(refused.value)
    assert "router.lanes_enabled" in message
    assert f"{tier}.vllm.priority_scheduling: false" in message
    assert "router.lanes_enabled: false" in message


def test_one_queue_order_is_accepted_whichever_owns_it() -> None:
    both = {"small": _vllm(True), "large": _vllm(True)}
    GenerateArgs.model_validate({**both, "router": {"lanes_enabled": False}})  # vLLM orders
    GenerateArgs.model_validate({**both, "router": None})  # no router, no lanes
    lanes = {"small": _vllm(False), "large": _vllm(False)}
    GenerateArgs.model_validate({**lanes, "router": {"lanes_enabled": True}})  # lanes order
    # The field means nothing to carpool's own engine (mode continuous): nothing to refuse.
    GenerateArgs.model_validate({"small": {"vllm": {"priority_scheduling": True}}})
