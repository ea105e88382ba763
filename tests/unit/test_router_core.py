"""The router over fake generators: decisions, cascades, lanes. No Ray."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncIterator
from typing import Any

import pytest

from carpool.generation.hops import Choice, GenerationEvent, GenerationResult, RouteDecision
from carpool.generation.schemas import GenerationCall
from router.config import RouterConfig
from router.core import RouterServer


class FakeGenerator:
    """Answers after ``delay`` s; ``finish`` and ``text`` say what the answer looks like.

    It takes only what a generator deployment takes: a ``GenerationCall`` that carries the
    router's predicted length."""

    def __init__(
        self, name: str, delay: float = 0.0, finish: str = "stop", text: str = "a fine answer"
    ) -> None:
        self.name, self.delay, self.finish, self.text = name, delay, finish, text
        self.calls: list[GenerationCall] = []
        self.order: list[str] = []

    def _took(self, call: GenerationCall) -> None:
        assert isinstance(call, GenerationCall), type(call)
        assert call.predicted_tokens is not None and call.predicted_tokens > 0
        self.calls.append(call)

    async def generate(self, call: GenerationCall) -> GenerationResult:
        self._took(call)
        await asyncio.sleep(self.delay)
        self.order.append(call.prompts[0])
        return GenerationResult(self.name, [Choice(0, self.text, self.finish)], 5, 7)

    async def stream(self, call: GenerationCall) -> AsyncIterator[GenerationEvent]:
        self._took(call)
        yield GenerationEvent.start(self.name, 5)
        yield GenerationEvent("delta", index=0, text=self.text, finish_reason=self.finish)
        yield GenerationEvent.end(5, 3)


def _call(prompt: str, max_tokens: int = 64) -> GenerationCall:
    return GenerationCall(prompts=[prompt], max_tokens=max_tokens)


def test_explicit_models_are_respected() -> None:
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer({}, {"small": small, "large": large})
    result = asyncio.run(router.generate(_call("hi"), requested="large"))
    assert result.decision is not None
    assert result.decision.model == "large" and len(large.calls) == 1 and not small.calls


def test_the_router_passes_and_returns_typed_objects() -> None:
    """The call goes on as a GenerationCall with the prediction set (the caller's own call
    untouched), and the answer comes back with the decision as a typed field."""
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer({"policy": "threshold"}, {"small": small, "large": large})
    call = _call("Answer yes or no: is ice cold?", 16)
    result = asyncio.run(router.generate(call))
    assert isinstance(result, GenerationResult)
    decision = result.decision
    assert isinstance(decision, RouteDecision)
    assert decision.model == "small" and decision.actual_tokens == 7
    assert small.calls[0].predicted_tokens == pytest.approx(decision.predicted_tokens, abs=0.05)
    assert small.calls[0].prompts == call.prompts and call.predicted_tokens is None
    # The public shape, made at the HTTP edge only.
    assert list(decision.to_dict()) == [
        "model",
        "lane",
        "predicted_tokens",
        "escalated",
        "overflow",
        "reason",
        "queue_ms",
        "actual_tokens",
    ]
    # What crosses a Ray hop pickles whole.
    assert pickle.loads(pickle.dumps(result)) == result


def test_a_stream_start_event_carries_the_decision() -> None:
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer({"policy": "threshold"}, {"small": small, "large": large})

    async def main() -> list[GenerationEvent]:
        return [e async for e in router.stream(_call("hi"))]

    start, delta, end = asyncio.run(main())
    assert start.type == "start" and start.model == "small"
    assert isinstance(start.decision, RouteDecision)
    assert start.decision.actual_tokens is None  # not known before generating
    assert "actual_tokens" not in start.decision.to_dict()
    assert delta.decision is None and end.decision is None
    assert isinstance(small.calls[0], GenerationCall) and small.calls[0].predicted_tokens


def test_cascade_escalates_an_unfinished_small_answer() -> None:
    small = FakeGenerator("small", finish="length")
    large = FakeGenerator("large")
    router = RouterServer({"policy": "cascade"}, {"small": small, "large": large})
    result = asyncio.run(router.generate(_call("Explain relativity")))
    assert result.model == "large"
    record = result.decision
    assert record is not None and record.escalated and record.model == "large"
    assert "max_tokens" in record.reason
    assert len(small.calls) == len(large.calls) == 1
    # Only small's answer is judged, so only its engine is asked for the tokens' logprobs.
    assert small.calls[0].judged and not large.calls[0].judged


def test_only_a_cascades_small_call_asks_for_logprobs() -> None:
    """A model named, a threshold decision or a stream is never judged: the engine may skip
    the logprobs (vLLM computes them only when asked)."""
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer({"policy": "threshold"}, {"small": small, "large": large})
    asyncio.run(router.generate(_call("Answer yes or no: is ice cold?", 16)))
    asyncio.run(router.generate(_call("hi"), requested="small"))

    async def drain() -> None:
        async for _ in router.stream(_call("hi")):
            pass

    asyncio.run(drain())
    assert len(small.calls) == 3 and not any(c.judged for c in small.calls)
    cascade = RouterServer({"policy": "cascade"}, {"small": small, "large": large})
    asyncio.run(cascade.generate(_call("Answer yes or no: is ice cold?")))
    assert small.calls[-1].judged


def test_cascade_keeps_a_good_small_answer() -> None:
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer({"policy": "cascade"}, {"small": small, "large": large})
    result = asyncio.run(router.generate(_call("Answer yes or no: is ice cold?")))
    assert result.decision is not None
    assert result.decision.model == "small" and not large.calls


def test_learned_cascade_skips_small_for_prompts_that_always_escalate() -> None:
    small = FakeGenerator("small", finish="length")
    large = FakeGenerator("large")
    router = RouterServer({"policy": "learned_cascade"}, {"small": small, "large": large})

    async def main() -> list[RouteDecision | None]:
        return [
            (await router.generate(_call("Write python code for a parser"))).decision
            for _ in range(60)
        ]

    decisions = asyncio.run(main())
    assert decisions[0] is not None and decisions[0].escalated
    assert decisions[-1] is not None and decisions[-1].reason.startswith("learned")
    assert len(small.calls) < 60  # later requests went straight to large


def test_overflow_serves_on_small_when_large_is_backed_up() -> None:
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer(
        {"policy": "threshold", "max_small_tokens": 1, "latency_target_ms": 10},
        {"small": small, "large": large},
    )
    router.gates["large"].queued_tokens = 10_000  # a long backlog on large
    result = asyncio.run(router.generate(_call("Write a story about dragons in detail")))
    assert result.decision is not None
    assert result.decision.overflow and result.decision.model == "small"


def test_short_requests_overtake_long_ones_waiting_in_the_same_model() -> None:
    small = FakeGenerator("small", delay=0.05)
    config = {
        "policy": "cascade",
        "max_in_flight_per_replica": {"small": 1},
        "escalate_on_length": False,
    }
    router = RouterServer(config, {"small": small})

    async def main() -> None:
        first = asyncio.create_task(router.generate(_call("Warm up", 8)))
        await asyncio.sleep(0.01)  # the only slot is taken now
        longs = [
            asyncio.create_task(router.generate(_call(f"long-{i} write an essay in detail", 1024)))
            for i in range(3)
        ]
        await asyncio.sleep(0.01)
        shorts = [
            asyncio.create_task(router.generate(_call(f"short-{i} yes or no?", 4)))
            for i in range(3)
        ]
        await asyncio.gather(first, *longs, *shorts)

    asyncio.run(main())
    served = small.order[1:]
    assert served[:3] == [f"short-{i} yes or no?" for i in range(3)], served


def test_single_fifo_lane_keeps_arrival_order() -> None:
    small = FakeGenerator("small", delay=0.05)
    config = {
        "policy": "cascade",
        "max_in_flight_per_replica": {"small": 1},
        "lanes_enabled": False,
        "escalate_on_length": False,
        "aging_tokens_per_s": 1e9,
    }
    router = RouterServer(config, {"small": small})

    async def main() -> None:
        tasks = []
        for prompt, n in [("a", 8), ("long write an essay", 1024), ("short yes or no?", 4)]:
            tasks.append(asyncio.create_task(router.generate(_call(prompt, n))))
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert small.order == ["a", "long write an essay", "short yes or no?"]


def test_single_fifo_lane_ignores_predicted_length_at_default_aging() -> None:
    # The benchmarks' baseline: without lanes, a short request arriving last is served last.
    small = FakeGenerator("small", delay=0.05)
    config = {
        "policy": "cascade",
        "max_in_flight_per_replica": {"small": 1},
        "lanes_enabled": False,
    }
    router = RouterServer({**config, "escalate_on_length": False}, {"small": small})

    async def main() -> None:
        tasks = []
        for prompt, n in [("a", 8), ("long write an essay in detail", 1024), ("yes or no?", 4)]:
            tasks.append(asyncio.create_task(router.generate(_call(prompt, n))))
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert small.order == ["a", "long write an essay in detail", "yes or no?"]


def test_streaming_carries_the_decision_and_learns() -> None:
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer({"policy": "threshold"}, {"small": small, "large": large})

    async def main() -> list[GenerationEvent]:
        return [e async for e in router.stream(_call("hi"))]

    events = asyncio.run(main())
    assert events[0].decision is not None and events[0].decision.model == "small"
    assert router.predictor.observations == 1


def test_config_rejects_unordered_lanes() -> None:
    with pytest.raises(ValueError, match="ordered"):
        RouterConfig.model_validate(
            {
                "lanes": [
                    {"name": "a", "max_predicted_tokens": 100},
                    {"name": "b", "max_predicted_tokens": 10},
                    {"name": "c"},
                ]
            }
        )


@pytest.mark.parametrize("field", ["num_replicas", "resources"])
def test_router_fields_of_a_deployment_it_no_longer_has_are_refused_by_name(field: str) -> None:
    """The router runs in the generate ingress: its old replica knobs are refused, not
    silently ignored, and the message says where the setting went."""
    with pytest.raises(ValueError, match=rf"router\.{field}.*generate_ingress"):
        RouterConfig.model_validate({field: 2 if field == "num_replicas" else {"x": 1}})


def test_the_hosted_routers_client_hands_the_call_on_as_it_is() -> None:
    """``_HandleClient`` (the router's way to a generator handle) sends the GenerationCall
    itself and reads its priority as an attribute."""
    from router.deployment import _HandleClient

    seen: list[GenerationCall] = []

    class Handle:
        def __init__(self) -> None:
            self.generate = self

        def remote(self, call: GenerationCall) -> Any:
            seen.append(call)

            async def answer() -> GenerationResult:
                return GenerationResult("small", [Choice(0, "x", "stop")], 1, 1)

            return answer()

    call = GenerationCall(prompts=["hi"], priority="batch", predicted_tokens=3.0)
    result = asyncio.run(_HandleClient(Handle()).generate(call))
    assert seen == [call] and seen[0] is call
    assert isinstance(result, GenerationResult) and result.choices[0].text == "x"


def test_router_metrics_read_the_typed_decision() -> None:
    from router.deployment import ROUTER_METRICS, RayRouterMetrics

    class Metric:
        def __init__(self) -> None:
            self.seen: list[Any] = []

        def inc(self, tags: dict[str, str]) -> None:
            self.seen.append(tags)

        def observe(self, value: float, tags: dict[str, str]) -> None:
            self.seen.append(value)

    metrics = object.__new__(RayRouterMetrics)  # without Ray's metric objects
    made = {name: Metric() for name in ROUTER_METRICS}
    metrics._m = made  # type: ignore[assignment]
    metrics.on_decision(RouteDecision("large", "short", 3.6, True, False, "why", 1.5, 2))
    tags = {"model": "large", "lane": "short"}
    assert made["carpool_router_decisions_total"].seen == [tags]
    assert made["carpool_router_escalations_total"].seen == [tags]
    assert made["carpool_router_overflows_total"].seen == []
    assert made["carpool_router_predicted_tokens"].seen == [3.6]
    assert made["carpool_router_lane_queue_ms"].seen == [1.5]
    assert len(made["carpool_router_prediction_error_log"].seen) == 1
    # A stream's start decision has no actual length yet: no error observed.
    metrics.on_decision(RouteDecision("small", "short", 3.6, False, False, "why", 0.0))
    assert len(made["carpool_router_prediction_error_log"].seen) == 1
