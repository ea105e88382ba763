"""The router over fake generators: decisions, cascades, lanes. No Ray."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.config import RouterConfig
from router.core import RouterServer


class FakeGenerator:
    """Answers after ``delay`` s; ``finish`` and ``text`` say what the answer looks like."""

    def __init__(
        self, name: str, delay: float = 0.0, finish: str = "stop", text: str = "a fine answer"
    ) -> None:
        self.name, self.delay, self.finish, self.text = name, delay, finish, text
        self.calls: list[dict[str, Any]] = []
        self.order: list[str] = []

    async def generate(self, call: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(call)
        await asyncio.sleep(self.delay)
        self.order.append(call["prompts"][0])
        return {
            "model": self.name,
            "prompt_tokens": 5,
            "completion_tokens": 7,
            "choices": [{"index": 0, "text": self.text, "finish_reason": self.finish}],
        }

    async def stream(self, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(call)
        yield {"type": "start", "model": self.name, "prompt_tokens": 5}
        yield {"type": "delta", "index": 0, "text": self.text, "finish_reason": self.finish}
        yield {"type": "end", "prompt_tokens": 5, "completion_tokens": 3}


def _call(prompt: str, max_tokens: int = 64) -> dict[str, Any]:
    return {"prompts": [prompt], "max_tokens": max_tokens}


def test_explicit_models_are_respected() -> None:
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer({}, {"small": small, "large": large})
    result = asyncio.run(router.generate(_call("hi"), requested="large"))
    assert result["carpool"]["model"] == "large" and len(large.calls) == 1 and not small.calls


def test_cascade_escalates_an_unfinished_small_answer() -> None:
    small = FakeGenerator("small", finish="length")
    large = FakeGenerator("large")
    router = RouterServer({"policy": "cascade"}, {"small": small, "large": large})
    result = asyncio.run(router.generate(_call("Explain relativity")))
    assert result["model"] == "large"
    record = result["carpool"]
    assert record["escalated"] and record["model"] == "large"
    assert "max_tokens" in record["reason"]
    assert len(small.calls) == len(large.calls) == 1


def test_cascade_keeps_a_good_small_answer() -> None:
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer({"policy": "cascade"}, {"small": small, "large": large})
    result = asyncio.run(router.generate(_call("Answer yes or no: is ice cold?")))
    assert result["carpool"]["model"] == "small" and not large.calls


def test_learned_cascade_skips_small_for_prompts_that_always_escalate() -> None:
    small = FakeGenerator("small", finish="length")
    large = FakeGenerator("large")
    router = RouterServer({"policy": "learned_cascade"}, {"small": small, "large": large})

    async def main() -> list[dict]:
        return [await router.generate(_call("Write python code for a parser")) for _ in range(60)]

    results = asyncio.run(main())
    assert results[0]["carpool"]["escalated"]
    assert results[-1]["carpool"]["reason"].startswith("learned")
    assert len(small.calls) < 60  # later requests went straight to large


def test_overflow_serves_on_small_when_large_is_backed_up() -> None:
    small, large = FakeGenerator("small"), FakeGenerator("large")
    router = RouterServer(
        {"policy": "threshold", "max_small_tokens": 1, "latency_target_ms": 10},
        {"small": small, "large": large},
    )
    router.gates["large"].queued_tokens = 10_000  # a long backlog on large
    result = asyncio.run(router.generate(_call("Write a story about dragons in detail")))
    assert result["carpool"]["overflow"] and result["carpool"]["model"] == "small"


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

    async def main() -> list[dict]:
        return [e async for e in router.stream(_call("hi"))]

    events = asyncio.run(main())
    assert events[0]["carpool"]["model"] == "small"
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
