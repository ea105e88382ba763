"""``router.gate.Admission`` on its own: plain callbacks and a hand-set clock, no asyncio (as
the twin drives it). The asyncio ``Gate`` over it is tested in test_cancel_races.py and
test_deadlines_and_priority.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from carpool.errors import RequestError
from router.gate import Admission
from router.lanes import ShortestFirstQueue


def grants(order: list[str], name: str, accept: bool = True) -> Callable[[], bool]:
    def grant() -> bool:
        if accept:
            order.append(name)
        return accept

    return grant


def test_waiting_requests_are_admitted_shortest_predicted_first() -> None:
    gate = Admission(1, ShortestFirstQueue(50.0))
    order: list[str] = []
    assert gate.take(10, "interactive", "short", 0.0, grants(order, "first")) is None
    for name, predicted in [("long", 500.0), ("short", 5.0), ("mid", 50.0)]:
        assert gate.take(predicted, "interactive", "x", 0.0, grants(order, name)) is not None
    assert gate.in_flight == 1 and gate.lane_waiting == {"x": 3}
    for predicted in (10, 5, 50):
        gate.leave(predicted)
    assert order == ["short", "mid", "long"]
    assert gate.in_flight == 1 and gate.lane_waiting == {"x": 0}


def test_one_fifo_lane_admits_in_arrival_order() -> None:
    gate = Admission(1, ShortestFirstQueue(50.0), fifo=True)
    order: list[str] = []
    gate.take(10, "interactive", "fifo", 0.0, grants(order, "first"))
    for i, (name, predicted) in enumerate([("long", 500.0), ("short", 5.0)]):
        gate.take(predicted, "interactive", "fifo", float(i), grants(order, name))
    gate.leave(10)
    gate.leave(500)
    assert order == ["long", "short"]


def test_withdrawn_and_declining_waiters_pass_their_slot_on() -> None:
    gate = Admission(1, ShortestFirstQueue(50.0))
    order: list[str] = []
    gate.take(10, "interactive", "a", 0.0, grants(order, "first"))
    gone = gate.take(1, "interactive", "a", 0.0, grants(order, "gone"))
    declining = gate.take(2, "interactive", "a", 0.0, grants(order, "declines", accept=False))
    gate.take(3, "interactive", "a", 0.0, grants(order, "next"))
    assert gone is not None and declining is not None
    gate.withdraw(gone)
    gate.leave(10)  # skips the withdrawn one; the declining one's caller withdraws itself
    gate.withdraw(declining)
    assert order == ["next"] and gate.in_flight == 1
    assert gate.lane_waiting == {"a": 0} and gate.queued_tokens == pytest.approx(3)


def test_a_full_lane_refuses_with_503_and_the_batch_tier_gets_half() -> None:
    gate = Admission(1, ShortestFirstQueue(50.0), max_queued_per_lane=2)
    gate.take(10, "interactive", "short", 0.0, lambda: True)
    gate.take(10, "interactive", "short", 0.0, lambda: True)
    with pytest.raises(RequestError) as info:
        gate.take(10, "batch", "short", 0.0, lambda: True)  # batch: bound 1
    assert info.value.status_code == 503 and info.value.retry_after_s
    gate.take(10, "interactive", "short", 0.0, lambda: True)
    with pytest.raises(RequestError):
        gate.take(10, "interactive", "short", 0.0, lambda: True)
    gate.take(10, "interactive", "long", 0.0, lambda: True)  # another lane has room


def test_completions_teach_the_decode_speed_and_a_larger_cap_admits() -> None:
    gate = Admission(1, ShortestFirstQueue(50.0))
    order: list[str] = []
    gate.take(10, "interactive", "a", 0.0, grants(order, "first"))
    gate.take(10, "interactive", "a", 0.0, grants(order, "second"))
    gate.take(10, "interactive", "a", 0.0, grants(order, "third"))
    gate.resize(2)
    assert order == ["second"] and gate.in_flight == 2
    before = gate.tokens_per_s
    gate.leave(10, tokens=100, elapsed_s=1.0)  # 100 tokens/s
    assert gate.tokens_per_s == pytest.approx(0.8 * before + 0.2 * 100)
    assert order == ["second", "third"]
