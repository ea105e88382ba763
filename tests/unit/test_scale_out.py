"""Several replicas per stage, without Ray: per-replica refusal memory and retries, router caps
that follow live replica counts, and length predictors merged across router replicas."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from carpool.admission import RequestControls, SlotQueue, slot_refusal
from carpool.calls import RefusalMemory, call_retrying
from carpool.errors import RequestError, find_request_error
from carpool.topology import DeploymentView, LiveReplicas, parse_serve_details
from router.config import RouterConfig
from router.core import RouterServer, share_of_cap
from router.features import extract_features
from router.length import LengthPredictor, PredictorStore
from tests.unit.test_router_core import FakeGenerator, _call


def full(replica: str, deployment: str = "generate/small") -> RequestError:
    return RequestError(
        503,
        "full",
        code="overloaded",
        retry_after_s=2.0,
        replica=replica,
        deployment=deployment,
    )


def test_one_full_replica_among_two_does_not_black_out_the_stage() -> None:
    clock = [0.0]
    memory = RefusalMemory(window_s=1.0, clock=lambda: clock[0])
    two = {"generate/small": 2}.get
    memory.record(full("a"), "interactive")
    assert memory.refusal("small", "interactive", two) is None  # b has room
    assert memory.has_room("generate/small", "interactive", two)
    memory.record(full("b"), "interactive")
    local = memory.refusal("small", "interactive", two)
    assert local is not None and local.status_code == 503 and local.code == "overloaded"
    clock[0] = 1.5  # past the window: ask the replicas again
    assert memory.refusal("small", "interactive", two) is None
    # Unknown replica counts behave as one replica (today's single-replica memory).
    memory.record(full("a"), "batch")
    assert memory.refusal("small", "batch") is not None


def _two_replicas_a_full(order: list[str]) -> tuple[str, list[str]]:
    """Serve sends the tries to the replicas in ``order``; a is full, b has room."""
    calls: list[str] = []
    replicas = iter(order)

    async def attempt() -> str:
        replica = next(replicas)
        calls.append(replica)
        if replica == "a":
            raise full("a")
        return f"answered by {replica}"

    live = {"generate/small": 2}.get
    return asyncio.run(call_retrying(attempt, RefusalMemory(), "interactive", live)), calls


def test_a_refused_request_is_tried_on_another_replica_once_each() -> None:
    assert _two_replicas_a_full(["a", "b"]) == ("answered by b", ["a", "b"])
    live = {"generate/small": 2}.get

    # One live replica: nothing else to try, the refusal goes back at once.
    calls: list[str] = []

    async def always_full() -> str:
        calls.append("a")
        raise full("a")

    with pytest.raises(RequestError):
        asyncio.run(call_retrying(always_full, RefusalMemory(), "interactive", {}.get))
    assert calls == ["a"]

    # Two live replicas both full: each tried once, then refused.
    calls.clear()
    names = iter(["a", "b", "c"])

    async def both_full() -> str:
        name = next(names)
        calls.append(name)
        raise full(name)

    with pytest.raises(RequestError):
        asyncio.run(call_retrying(both_full, RefusalMemory(), "interactive", live))
    assert calls == ["a", "b"]


def test_a_replica_started_since_the_last_poll_is_tried_before_giving_up() -> None:
    """The live counts are polled every few seconds. Right after a scale-out they still say one
    replica; a refusal from it must not go back to the client while the new one has room."""
    counts = {"generate/small": 1}
    fetches: list[int] = []
    clock = [10.0]

    def fetch() -> Any:
        fetches.append(1)
        return {k: DeploymentView(running=v, max_ongoing_requests=2) for k, v in counts.items()}

    live = LiveReplicas(fetch, interval_s=3.0, clock=lambda: clock[0])
    assert live.count("generate/small") == 1
    counts["generate/small"] = 2  # scaled out; the poll has not seen it yet
    clock[0] += 1.5  # older than recount's 1 s, younger than the 3 s poll
    names = iter(["a", "b"])

    async def attempt() -> str:
        name = next(names)
        if name == "a":
            raise full("a")
        return f"answered by {name}"

    answer = asyncio.run(
        call_retrying(attempt, RefusalMemory(), "interactive", live.count, recount=live.recount)
    )
    assert answer == "answered by b" and len(fetches) == 2

    # A fresh count that still says one replica: refused after one recount, not more.
    counts["generate/small"] = 1
    fetches.clear()
    live = LiveReplicas(fetch, interval_s=3.0, clock=lambda: clock[0])
    live.refresh_now()
    clock[0] += 1.5
    tries: list[str] = []

    async def only_a() -> str:
        tries.append("a")
        raise full("a")

    with pytest.raises(RequestError):
        asyncio.run(
            call_retrying(only_a, RefusalMemory(), "interactive", live.count, recount=live.recount)
        )
    assert tries == ["a"] and len(fetches) == 2
    # Counts younger than 1 s are not fetched again: sustained refusals cost the controller
    # at most one fetch a second per process.
    with pytest.raises(RequestError):
        asyncio.run(
            call_retrying(only_a, RefusalMemory(), "interactive", live.count, recount=live.recount)
        )
    assert tries == ["a", "a"] and len(fetches) == 2


def test_a_recount_during_the_background_poll_waits_for_what_it_finds() -> None:
    """A refusal that lands while the poll's own fetch is in flight must not give up on the
    old count: it waits for the fetch and retries on what it found."""
    import threading

    counts = {"generate/small": 1}
    release = threading.Event()
    clock = [10.0]

    def fetch() -> Any:
        release.wait(5)
        return {k: DeploymentView(running=v, max_ongoing_requests=2) for k, v in counts.items()}

    live = LiveReplicas(fetch, interval_s=3.0, clock=lambda: clock[0])
    release.set()
    live.refresh_now()
    release.clear()
    counts["generate/small"] = 2
    clock[0] += 5.0  # the poll is due: the next count starts a background fetch

    async def scenario() -> bool:
        assert live.count("generate/small") == 1  # stale; the fetch is now in flight
        asyncio.get_running_loop().call_later(0.1, release.set)
        found = await live.recount()
        return found and live.count("generate/small") == 2

    assert asyncio.run(scenario())


def test_a_replica_that_refused_another_request_moments_ago_is_still_tried() -> None:
    """b refused some other request 100 ms ago and a refuses this one: the memory says both are
    full, but b may have room again; the call tries it (once) before refusing the client."""
    memory = RefusalMemory()
    memory.record(full("b"), "interactive")
    tries: list[str] = []
    names = iter(["a", "b"])

    async def attempt() -> str:
        name = next(names)
        tries.append(name)
        if name == "a":
            raise full("a")
        return f"answered by {name}"

    live = {"generate/small": 2}.get
    assert asyncio.run(call_retrying(attempt, memory, "interactive", live)) == "answered by b"
    assert tries == ["a", "b"]


def test_a_retry_sent_back_to_the_replica_that_refused_goes_on_to_the_other() -> None:
    """Serve picks each try's replica from cached queue lengths, so a retry can reach the
    replica that just refused; the call goes on until every live replica refused it."""
    assert _two_replicas_a_full(["a", "a", "b"]) == ("answered by b", ["a", "a", "b"])


def test_a_refusal_by_count_is_remembered_only_as_long_as_it_says() -> None:
    """Two replicas each full by count a moment apart are not a full stage: a count refusal
    clears when one sequence leaves the line."""
    clock = [0.0]
    memory = RefusalMemory(window_s=1.25, clock=lambda: clock[0])
    two = {"generate/small": 2}.get
    queue = SlotQueue(waiting=4, mean_slot_s=0.4, slots=2)
    controls = RequestControls()
    refusal = slot_refusal(
        "tiny", queue, controls, max_waiting=4, max_queue_delay_ms=60_000, batch_tier_share=0.5
    )
    assert refusal is not None and refusal.code == "overloaded"
    assert refusal.full_for_s == pytest.approx(0.2)  # one sequence out: 0.4 s / 2 slots
    assert refusal.retry_after_s == 1.0  # what a client is told stays whole seconds
    refusal.replica, refusal.deployment = "a", "generate/small"
    memory.record(refusal, "interactive")
    clock[0] = 0.3  # a's line moved on; b refuses now
    memory.record(full("b"), "interactive")
    assert memory.refusal("small", "interactive", two) is None
    # A refusal for queued work past the delay bound stays for the excess to drain.
    slow = SlotQueue(waiting=3, mean_slot_s=2.0, slots=1)
    late = slot_refusal(
        "tiny", slow, controls, max_waiting=10, max_queue_delay_ms=4_000, batch_tier_share=0.5
    )
    assert late is not None and late.full_for_s == pytest.approx(2.0)
    # Unknown slot time (nothing finished yet): not remembered past the call.
    fresh = slot_refusal(
        "tiny",
        SlotQueue(waiting=4, mean_slot_s=0.0, slots=2),
        controls,
        max_waiting=4,
        max_queue_delay_ms=60_000,
        batch_tier_share=0.5,
    )
    assert fresh is not None and fresh.full_for_s == 0.0


def test_a_refusal_expiring_while_the_memory_is_read_is_decided_on_one_reading() -> None:
    """Seen under 3x generate overload (one 500, ``min()`` of nothing): a count refusal
    expired between the memory's "is every replica full?" and its Retry-After reading."""
    ticks = iter([0.0, 0.0, 0.05, 0.2, 0.2, 0.2])  # record, record, then each read later
    memory = RefusalMemory(window_s=1.25, clock=lambda: next(ticks))
    one = {"generate/small": 1}.get
    brief = RequestError(
        503,
        "full",
        code="overloaded",
        retry_after_s=1.0,
        replica="a",
        deployment="generate/small",
        full_for_s=0.1,
    )
    memory.record(brief, "batch")
    local = memory.refusal("small", "batch", one)  # full when read at 0.05, gone by 0.2
    assert local is not None and local.status_code == 503 and local.retry_after_s == 1.0


def test_only_overload_refusals_are_retried() -> None:
    """Anything else may have done work (a generation must never run twice)."""
    for error in (
        RequestError(400, "bad input"),
        RequestError(503, "replica died", code="backend_unavailable", replica="a"),
        RuntimeError("boom"),
    ):
        calls = []

        async def failing(error: Exception = error, calls: list = calls) -> None:
            calls.append(1)
            raise error

        with pytest.raises(type(error)):
            asyncio.run(
                call_retrying(failing, RefusalMemory(), "interactive", {"generate/small": 3}.get)
            )
        assert calls == [1]


def test_a_refusal_says_which_replica_refused_across_a_pickle() -> None:
    error = pickle.loads(pickle.dumps(full("r1")))
    assert (error.replica, error.deployment) == ("r1", "generate/small")
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = error
    assert find_request_error(wrapped).replica == "r1"
    counted = RequestError(503, "x", code="overloaded", replica="r1", full_for_s=0.2)
    assert pickle.loads(pickle.dumps(counted)).full_for_s == 0.2
    assert RequestError(503, "x", code="overloaded").replica is None  # outside Serve


def test_replica_counts_come_from_serve_details() -> None:
    details = {
        "applications": {
            "generate": {
                "deployments": {
                    "small": {
                        "deployment_config": {"max_ongoing_requests": 320},
                        "replicas": [
                            {"state": "RUNNING"},
                            {"state": "RUNNING"},
                            {"state": "STARTING"},
                        ],
                    }
                }
            }
        }
    }
    views = parse_serve_details(details)
    assert views["generate/small"].running == 2
    assert views["generate/small"].max_ongoing_requests == 320
    fetches = []
    clock = [0.0]

    def fetch() -> Any:
        fetches.append(1)
        return views

    live = LiveReplicas(fetch, interval_s=5.0, clock=lambda: clock[0])
    assert live.count("generate/small") == 2 and live.count("generate/large") is None
    assert live.count("generate/small") == 2 and len(fetches) == 1  # cached
    clock[0] = 6.0
    live.count("generate/small")
    assert len(fetches) == 2

    def broken() -> Any:
        raise ConnectionError("no controller")

    assert LiveReplicas(broken).count("generate/small") is None


def test_router_caps_follow_each_models_live_replicas() -> None:
    assert share_of_cap(64, 1, 1) == 64
    assert share_of_cap(64, 4, 1) == 256
    assert share_of_cap(64, 4, 2) == 128  # two router replicas split it
    assert share_of_cap(64, 0, 1) == 64  # scaled to zero: a request still goes, to wake it
    assert share_of_cap(1, 1, 3) == 1

    replicas = {"small": 1}
    small = FakeGenerator("small", delay=0.2)
    router = RouterServer(
        {"policy": "cascade", "lanes_enabled": False, "escalate_on_length": False},
        {"small": small},
        caps=lambda model: share_of_cap(2, replicas[model], 1),
    )
    peak = [0]

    async def main() -> None:
        async def one(i: int) -> None:
            await router.generate(_call(f"q{i}"), requested="small")

        async def watch() -> None:
            for _ in range(40):
                peak[0] = max(peak[0], router.stats()["in_flight"]["small"])
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.05)
        first_peak = peak[0]
        replicas["small"] = 3  # the model scaled out: the next request resizes the gate
        tasks.append(asyncio.create_task(one(99)))
        await asyncio.gather(*tasks)
        await watcher
        assert first_peak == 2

    asyncio.run(main())
    assert peak[0] == 6


def test_the_old_fixed_cap_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="max_in_flight_per_replica"):
        RouterConfig.model_validate({"max_in_flight": {"small": 16}})


def _features(i: int) -> Any:
    return extract_features("word " * (i % 7 + 1), prompt_tokens=i % 7 + 1, max_tokens=256)


def test_router_replicas_merge_what_their_predictors_learn() -> None:
    store = PredictorStore()
    one, two, alone = LengthPredictor(), LengthPredictor(), LengthPredictor()
    epochs: dict[int, str | None] = {id(one): None, id(two): None}

    def sync(p: LengthPredictor) -> None:
        merged = store.sync(epochs[id(p)], *p.take_learned())
        epochs[id(p)] = merged.pop("epoch")
        p.adopt(merged)

    for i in range(60):
        target = one if i % 2 else two
        target.observe(_features(i), 10 + 5 * (i % 7))
        alone.observe(_features(i), 10 + 5 * (i % 7))
        if i % 9 == 0:
            sync(target)
    sync(one)
    sync(two)
    sync(one)
    for p in (one, two):
        assert p.observations == 60
        for i in range(7):
            assert p.predict(_features(i)) == pytest.approx(alone.predict(_features(i)))

    # The store restarts (a new actor): each replica sends all it learned, nothing twice.
    store = PredictorStore()
    one.observe(_features(3), 40)
    alone.observe(_features(3), 40)
    sync(one)
    sync(two)
    sync(one)
    assert store.predictor.observations == 61
    np.testing.assert_allclose(store.predictor._moment, alone._moment)


def test_replica_counts_outside_ray_are_unknown_and_start_no_cluster(monkeypatch) -> None:
    import ray
    from ray.serve import context

    connects = []

    def connect(*args: Any, **kwargs: Any) -> None:
        connects.append(1)  # Serve's client would ray.init() a cluster of its own here
        raise RuntimeError("no cluster")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(context, "_connect", connect)
    assert LiveReplicas().count("generate/small") is None
    assert connects == []
