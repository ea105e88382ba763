"""Splitters, the weighted batch size, and the executor, with no Ray and no model."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from carpool.batching import (
    BatchLimits,
    GreedyTokenBudgetSplitter,
    Job,
    LengthAwareExecutor,
    OptimalSplitter,
    PadToLongestSplitter,
    batch_weight,
    make_splitter,
    padded_tokens,
)


def _check_partition(passes: list[list[int]], n: int) -> None:
    flat = sorted(i for p in passes for i in p)
    assert flat == list(range(n)), "every item must run exactly once"


@pytest.mark.parametrize("name", ["optimal", "greedy"])
def test_length_aware_splitters_respect_budget_and_cover_every_item(name: str) -> None:
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 120))]
        splitter = make_splitter(name, max_tokens=2048, max_items=32)
        passes = splitter.split(lengths)
        _check_partition(passes, len(lengths))
        for p in passes:
            assert len(p) <= 32
            # A single item over the budget must still run (alone).
            assert len(p) * max(lengths[i] for i in p) <= 2048 or len(p) == 1


def test_sorting_cuts_padding_against_arrival_order() -> None:
    rng = random.Random(2)
    lengths = [int(rng.paretovariate(1.1) * 8) % 256 + 4 for _ in range(256)]
    plain = PadToLongestSplitter(max_items=32).split(lengths)
    optimal = OptimalSplitter(max_tokens=8192, max_items=64, pass_overhead_tokens=64).split(lengths)
    real = sum(lengths)
    plain_waste = 1 - real / padded_tokens(lengths, plain)
    optimal_waste = 1 - real / padded_tokens(lengths, optimal)
    assert optimal_waste < 0.25
    assert optimal_waste < plain_waste / 2


def test_optimal_split_is_never_costlier_than_greedy() -> None:
    rng = random.Random(3)
    overhead = 64
    for _ in range(30):
        lengths = [rng.randint(1, 256) for _ in range(rng.randint(1, 80))]
        cost = {}
        for splitter in (
            OptimalSplitter(4096, 64, overhead),
            GreedyTokenBudgetSplitter(4096, 64),
        ):
            passes = splitter.split(lengths)
            cost[splitter.name] = len(passes) * overhead + padded_tokens(lengths, passes)
        assert cost["optimal"] <= cost["greedy"]


def test_optimal_split_prefers_one_pass_when_overhead_dominates() -> None:
    passes = OptimalSplitter(10_000, 64, pass_overhead_tokens=10_000).split([5, 6, 7, 100])
    assert len(passes) == 1


def test_unknown_split_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="optimal"):
        make_splitter("fastest", 100, 10)


def test_batch_weight_enforces_both_caps_exactly() -> None:
    limits = BatchLimits(max_batch_size=4, max_batch_tokens=100)
    cap = limits.serve_capacity

    def job(*lengths: int) -> Job:
        return Job([None] * len(lengths), list(lengths), limits)

    two = [job(30, 30), job(40)]  # 3 items, 100 tokens: fits
    assert batch_weight(two) <= cap
    assert batch_weight([*two, job(1)]) > cap  # 101 tokens
    assert batch_weight([job(1, 1, 1), job(1, 1)]) > cap  # 5 items
    # A single oversized job is clamped so Serve runs it alone instead of failing it.
    assert batch_weight([job(500, 500)]) == cap


class _RecordingModel:
    """Doubles each payload; records the shape of every pass. Thread-safe enough for asserts."""

    def __init__(self, delay: float = 0.0, fail_on: object = None) -> None:
        self.calls: list[list[int]] = []
        self.delay = delay
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def __call__(self, payloads: list[int]) -> list[int]:
        with self.lock:
            self.calls.append(list(payloads))
        if self.fail_on is not None and self.fail_on in payloads:
            raise ValueError("poisoned input")
        time.sleep(self.delay)
        return [p * 2 for p in payloads]


def _job(values: list[int], limits: BatchLimits) -> Job:
    return Job(list(values), [v for v in values], limits)


def test_executor_returns_results_in_request_order_and_merges_concurrent_jobs() -> None:
    model = _RecordingModel(delay=0.05)
    limits = BatchLimits(64, 4096)
    executor = LengthAwareExecutor(model, OptimalSplitter(4096, 64, 64))

    async def main() -> list[list[int]]:
        jobs = [_job([30 - i, 3, 17], limits) for i in range(10)]
        return await asyncio.gather(*(executor.run_one(j) for j in jobs))

    results = asyncio.run(main())
    assert results == [[2 * (30 - i), 6, 34] for i in range(10)]
    # The first job runs alone (the model was idle); the other nine wait and merge.
    assert len(model.calls) <= 4
    assert executor.stats.items == 30
    assert executor.stats.real_tokens == sum(sum(c) for c in model.calls)


def test_a_failing_item_fails_only_its_own_job() -> None:
    model = _RecordingModel(fail_on=13)
    limits = BatchLimits(64, 4096)
    executor = LengthAwareExecutor(model, OptimalSplitter(4096, 64, 1000))

    async def main() -> list:
        jobs = [_job([5, 6], limits), _job([13, 7], limits), _job([8], limits)]
        return await executor.run(jobs)

    good1, bad, good2 = asyncio.run(main())
    assert good1 == [10, 12]
    assert isinstance(bad, ValueError)
    assert good2 == [16]


def test_cancelled_job_is_skipped_before_compute() -> None:
    model = _RecordingModel(delay=0.1)
    limits = BatchLimits(64, 4096)
    executor = LengthAwareExecutor(model, OptimalSplitter(4096, 64, 64))

    async def main() -> None:
        first = asyncio.create_task(executor.run_one(_job([1], limits)))
        await asyncio.sleep(0.02)  # the first pass is running now
        doomed = asyncio.create_task(executor.run_one(_job([99], limits)))
        await asyncio.sleep(0.01)
        doomed.cancel()
        await first
        with pytest.raises(asyncio.CancelledError):
            await doomed
        await asyncio.sleep(0.2)

    asyncio.run(main())
    assert all(99 not in call for call in model.calls)


def test_oversized_job_is_split_into_budgeted_passes() -> None:
    model = _RecordingModel()
    limits = BatchLimits(8, 100)
    executor = LengthAwareExecutor(model, GreedyTokenBudgetSplitter(100, 8))

    async def main() -> list[int]:
        return await executor.run_one(_job([40] * 10, limits))

    assert asyncio.run(main()) == [80] * 10
    assert all(len(c) * max(c) <= 100 for c in model.calls)


def _half_ms_per_token(items: int, tokens: int) -> float:
    return 0.5 * tokens


def test_a_short_job_arriving_mid_plan_runs_before_a_long_jobs_later_passes() -> None:
    """Re-planned after every pass: the newcomer waits for one pass, not the long job's rest."""
    model = _RecordingModel(delay=0.05)
    limits = BatchLimits(64, 4096)
    executor = LengthAwareExecutor(
        model, OptimalSplitter(4096, 1, 0), estimate_ms=_half_ms_per_token
    )

    async def main() -> None:
        long = asyncio.create_task(executor.run_one(_job([100, 101, 102, 103], limits)))
        await asyncio.sleep(0.02)  # the long job's first pass is running
        short = asyncio.create_task(executor.run_one(_job([4], limits)))
        await asyncio.gather(long, short)

    asyncio.run(main())
    assert [c[0] for c in model.calls] == [100, 4, 101, 102, 103]


def test_a_long_job_that_waited_its_own_cost_goes_before_newer_short_ones() -> None:
    """No starvation: urgency is arrival + own cost, so waiting makes any job urgent."""

    def order(long_waited_s: float) -> list[int]:
        model = _RecordingModel()
        limits = BatchLimits(64, 4096)
        executor = LengthAwareExecutor(
            model, OptimalSplitter(4096, 1, 0), estimate_ms=_half_ms_per_token
        )
        now = time.monotonic()
        long = Job([200], [200], limits, created=now - long_waited_s)  # costs 100 ms alone
        short = [Job([v], [v], limits, created=now) for v in (4, 5)]
        asyncio.run(executor.run([*short, long]))
        return [c[0] for c in model.calls]

    assert order(long_waited_s=0.0) == [4, 5, 200]
    assert order(long_waited_s=0.3) == [200, 4, 5]


def test_a_client_deadline_tighter_than_the_own_cost_rule_moves_a_job_up() -> None:
    def order(deadline_in_s: float | None) -> list[int]:
        model = _RecordingModel()
        limits = BatchLimits(64, 4096)
        executor = LengthAwareExecutor(
            model, OptimalSplitter(4096, 1, 0), estimate_ms=lambda items, tokens: tokens
        )
        now = time.monotonic()
        other = Job([150], [150], limits, created=now)  # due at now + 150 ms
        job = Job([200], [200], limits, created=now)  # due at now + 200 ms by its own cost
        if deadline_in_s is not None:
            job.deadline = now + deadline_in_s  # must start by the deadline - 200 ms
        asyncio.run(executor.run([other, job]))
        return [c[0] for c in model.calls]

    assert order(None) == [150, 200]
    assert order(0.3) == [200, 150]


def test_cancelling_one_job_of_a_collected_batch_spares_the_others() -> None:
    model = _RecordingModel(delay=0.1)
    limits = BatchLimits(64, 4096)
    executor = LengthAwareExecutor(model, OptimalSplitter(4096, 64, 64))

    async def main() -> list:
        blocker = asyncio.create_task(executor.run_one(_job([1], limits)))
        await asyncio.sleep(0.02)  # the model is busy; the next batch waits
        jobs = [_job([2], limits), _job([77], limits), _job([3], limits)]
        batch = asyncio.create_task(executor.run(jobs))
        await asyncio.sleep(0.01)
        jobs[1].future.cancel()  # what the Serve shell does when that client disconnects
        await blocker
        return await batch

    first, dropped, last = asyncio.run(main())
    assert first == [4] and last == [6]
    assert isinstance(dropped, asyncio.CancelledError)
    assert all(77 not in call for call in model.calls)
