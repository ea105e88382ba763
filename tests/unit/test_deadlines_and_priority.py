"""Deadlines, priority tiers and latency-based admission, without Ray."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from carpool.admission import (
    AdmissionLimits,
    DrainAdmission,
    PassCostModel,
    QueueState,
    RequestControls,
    StandingQueueAdmission,
    current_controls,
    parse_controls,
)
from carpool.batching import BatchLimits, Job, LengthAwareExecutor, make_splitter
from carpool.calls import RefusalMemory, call_backend, refuse_if_overloaded
from carpool.errors import RequestError
from carpool.generation.scheduler import PriorityQueue
from carpool.http import make_api
from deployments.embedder import EmbedderConfig, EmbeddingServer
from router.gate import Gate
from router.lanes import ShortestFirstQueue


class _CountingModel:
    """Embeds with a fixed cost per pass and records every text it computed."""

    name = "counting"
    max_length = 64
    dimension = 2

    def __init__(self, pass_s: float = 0.05) -> None:
        self.pass_s = pass_s
        self.computed: list[int] = []

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[int(t)] * 4 for t in texts]

    def truncate(self, text: str) -> list[int]:
        return [1] * 4

    def embed_ids(self, batch: list[list[int]]) -> list[np.ndarray]:
        time.sleep(self.pass_s)
        self.computed.extend(ids[0] for ids in batch)
        return [np.ones(2, dtype=np.float32) for _ in batch]


def test_headers_parse_into_controls_and_bad_values_are_400() -> None:
    now = 1000.0
    c = parse_controls("250", "batch", now=now)
    assert c.deadline == pytest.approx(1000.25) and c.priority == "batch" and c.rank == 1
    assert parse_controls(None, None, default_deadline_ms=1000, now=now).deadline == 1001.0
    assert parse_controls(None, None, now=now) == RequestControls()
    assert parse_controls("0", None, now=now).expired(now)
    for bad_deadline, bad_priority in [("soon", None), ("-5", None), ("nan", None), (None, "vip")]:
        with pytest.raises(RequestError) as info:
            parse_controls(bad_deadline, bad_priority, now=now)
        assert info.value.status_code == 400 and "x-carpool-" in info.value.message


def test_cost_model_recovers_a_linear_pass_cost() -> None:
    cost = PassCostModel()
    assert cost.estimate_ms(10, 1000) == 0.0  # not enough passes seen: no guesses
    for tokens in [100, 400, 200, 800, 50, 600, 300]:
        cost.observe(tokens, items=8, ms=7.0 + 0.2 * tokens)
    assert cost.fixed_ms == pytest.approx(7.0, abs=0.01)
    assert cost.ms_per_token == pytest.approx(0.2, abs=1e-4)
    assert cost.estimate_ms(16, 1000) == pytest.approx(2 * 7.0 + 200, rel=0.05)


def test_a_deep_queue_is_costed_in_full_passes_after_light_load() -> None:
    # Light load ran one item per pass; a 146-item burst still runs in passes of up to 64
    # items (the executor takes everything queued), so its fixed cost is 3 passes, not 146.
    cost = PassCostModel(min_passes=1, max_pass_items=64, max_pass_tokens=8192)
    for tokens in [10, 40, 20, 80, 30, 60]:
        cost.observe(tokens, items=1, ms=20.0 + 0.5 * tokens)
    assert cost.fixed_ms == pytest.approx(20.0, abs=0.01)
    assert cost.estimate_ms(146, 4000) == pytest.approx(3 * 20.0 + 0.5 * 4000, rel=0.01)
    # Token-heavy queues need more passes than the item count alone says.
    assert cost.passes_for(64, 64 * 250) == 2
    # Without limits (a caller that does not know them) the observed pass size rules.
    unbounded = PassCostModel(min_passes=1)
    unbounded.observe(10, items=1, ms=25.0)
    assert unbounded.passes_for(146, 1460) == 146


def test_a_guess_from_small_passes_refuses_nothing_until_a_large_pass_is_seen() -> None:
    # Noisy one-request passes on a busy CPU fit a steep line (4 ms per token): it prices a
    # burst of 9,000 tokens at over 30 s. That is an extrapolation, not a measurement: admit.
    cost = PassCostModel(min_passes=1, max_pass_items=64, max_pass_tokens=8192)
    for tokens, ms in [(20, 60.0), (40, 140.0), (30, 100.0), (60, 220.0), (50, 180.0)]:
        cost.observe(tokens, items=1, ms=ms)
    policy = DrainAdmission(AdmissionLimits(16_384, 30_000.0, 0.5), cost)
    burst = QueueState(queued_items=140, queued_tokens=9_000, items=6, tokens=300)
    assert cost.estimate_ms(140, 9_000) > 30_000
    assert not cost.confident(140, 9_000)
    assert policy.refuse(burst, RequestControls()) is None
    assert policy.refuse(burst, RequestControls(deadline=time.time() + 5)) is None
    # Once a pass of that size has run, the estimate is a measurement and the bound holds.
    cost.observe(4_000, items=64, ms=16_000.0)
    assert cost.confident(140, 9_000)
    refused = policy.refuse(burst, RequestControls())
    assert refused is not None and refused.status_code == 503


def test_drain_admission_keeps_room_for_interactive_and_refuses_unmeetable_deadlines() -> None:
    cost = PassCostModel(min_passes=1)
    cost.observe(100, 10, 100.0)  # ~1 ms per token
    policy = DrainAdmission(AdmissionLimits(10_000, 500.0, 0.5), cost)
    state = QueueState(queued_items=30, queued_tokens=300, items=1, tokens=10)  # ~300 ms ahead
    assert policy.refuse(state, RequestControls()) is None
    batch = policy.refuse(state, RequestControls(priority="batch"))  # its bound is 250 ms
    assert batch is not None and batch.status_code == 503 and batch.retry_after_s
    tight = RequestControls(deadline=time.time() + 0.1)
    refused = policy.refuse(state, tight)
    assert refused is not None and refused.status_code == 504
    assert refused.code == "deadline_unmeetable"
    assert policy.refuse(state, RequestControls(deadline=time.time() + 5)) is None


def test_expired_items_are_dropped_before_the_forward_pass() -> None:
    model = _CountingModel(pass_s=0.2)
    server = EmbeddingServer(EmbedderConfig(), model)

    async def main() -> list:
        first = asyncio.create_task(server.embed(["1"]))
        await asyncio.sleep(0.02)  # the first pass is running now
        late = server.embed(["2"], controls=RequestControls(deadline=time.time() + 0.05))
        fine = server.embed(["3"], controls=RequestControls(deadline=time.time() + 5))
        return await asyncio.gather(first, late, fine, return_exceptions=True)

    first, late, fine = asyncio.run(main())
    assert not isinstance(first, BaseException) and not isinstance(fine, BaseException)
    assert isinstance(late, RequestError) and late.status_code == 504
    assert 2 not in model.computed and sorted(model.computed) == [1, 3]
    assert server.stats()["deadline_dropped_items"] == 1
    with pytest.raises(RequestError) as info:  # already past: refused at the door
        asyncio.run(server.embed(["4"], controls=RequestControls(deadline=time.time() - 1)))
    assert info.value.status_code == 504 and 4 not in model.computed


def test_interactive_jobs_are_taken_before_batch_jobs_that_came_first() -> None:
    order: list[int] = []

    def forward(payloads: list[int]) -> list[int]:
        time.sleep(0.05)
        order.extend(payloads)
        return payloads

    limits = BatchLimits(1, 1024)
    executor: LengthAwareExecutor[int, int] = LengthAwareExecutor(
        forward, make_splitter("optimal", 1024, 1, 0), max_step_items=1
    )

    def job(value: int, rank: int) -> Job[int, int]:
        j: Job[int, int] = Job([value], [4], limits)
        j.rank = rank
        return j

    async def main() -> None:
        running = asyncio.create_task(executor.run([job(0, 0)]))
        await asyncio.sleep(0.01)
        batch = [asyncio.create_task(executor.run([job(v, 1)])) for v in (1, 2)]
        await asyncio.sleep(0)
        interactive = asyncio.create_task(executor.run([job(3, 0)]))
        await asyncio.gather(running, *batch, interactive)

    asyncio.run(main())
    assert order == [0, 3, 1, 2]


def test_priority_queue_admits_interactive_first_then_fcfs() -> None:
    class Seq:
        def __init__(self, name: str, rank: int) -> None:
            self.name, self.rank = name, rank

    q: PriorityQueue = PriorityQueue()
    for name, rank in [("b1", 1), ("i1", 0), ("b2", 1), ("i2", 0)]:
        q.add(Seq(name, rank))
    assert [s.name for s in q] == ["i1", "i2", "b1", "b2"]
    assert q.pop().name == "i1" and len(q) == 3


def test_router_gate_gives_up_at_the_deadline_and_keeps_its_accounting() -> None:
    async def main() -> None:
        gate = Gate(1, ShortestFirstQueue(50.0))
        await gate.enter(10, "interactive")  # holds the only slot
        with pytest.raises(RequestError) as info:
            await gate.enter(10, "interactive", deadline=time.time() + 0.05)
        assert info.value.status_code == 504
        gate.leave(10)
        assert gate.in_flight == 0 and gate.queued_tokens == 0
        await asyncio.wait_for(gate.enter(10, "batch", deadline=time.time() + 1), 1)
        assert gate.in_flight == 1

    asyncio.run(main())


def test_ingress_reads_headers_and_times_out_downstream_calls_with_504() -> None:
    api = make_api("t", "t", 1024)
    cancelled: list[bool] = []

    class SlowCall:
        """Stands in for a DeploymentResponse: awaitable and cancellable."""

        def __await__(self):  # type: ignore[no-untyped-def]
            return asyncio.sleep(5).__await__()

        def cancel(self) -> None:
            cancelled.append(True)

    @api.get("/v1/slow")
    async def slow() -> dict:
        await call_backend("model", SlowCall())
        return {"ok": True}

    @api.get("/v1/echo")
    async def echo() -> dict:
        c = current_controls()
        return {"priority": c.priority, "has_deadline": c.deadline is not None}

    client = TestClient(api)
    assert client.get("/v1/echo").json() == {"priority": "interactive", "has_deadline": False}
    got = client.get("/v1/echo", headers={"x-carpool-priority": "batch"}).json()
    assert got == {"priority": "batch", "has_deadline": False}
    started = time.monotonic()
    r = client.get("/v1/slow", headers={"x-carpool-deadline-ms": "200"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - started < 2 and cancelled == [True]
    assert client.get("/v1/echo", headers={"x-carpool-deadline-ms": "0"}).status_code == 504
    bad = client.get("/v1/echo", headers={"x-carpool-priority": "urgent"})
    assert bad.status_code == 400 and "interactive" in bad.json()["error"]["message"]


def test_router_lanes_are_bounded_per_lane_and_tier() -> None:
    async def main() -> None:
        gate = Gate(1, ShortestFirstQueue(50.0), max_queued_per_lane=2)
        await gate.enter(10, "interactive", lane="short")  # takes the only slot
        waiters = [
            asyncio.create_task(gate.enter(10, "interactive", lane="short")) for _ in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as info:
            await gate.enter(10, "interactive", lane="short")
        assert info.value.status_code == 503 and info.value.retry_after_s
        other = asyncio.create_task(gate.enter(500, "interactive", lane="long"))
        await asyncio.sleep(0)
        assert gate.lane_waiting == {"short": 2, "long": 1}
        with pytest.raises(RequestError):  # the batch tier gets half of a lane
            await gate.enter(500, "batch", lane="long")
        for _ in range(3):  # each leave admits the next waiter
            gate.leave(10)
            await asyncio.sleep(0)
        await asyncio.gather(*waiters, other)
        assert gate.lane_waiting == {"short": 0, "long": 0} and gate.in_flight == 1

    asyncio.run(main())


def test_queued_batch_work_does_not_count_against_interactive_requests() -> None:
    cost = PassCostModel(min_passes=1)
    cost.observe(100, 10, 100.0)  # ~1 ms per token
    policy = DrainAdmission(AdmissionLimits(10_000, 500.0, 0.5), cost)
    # 2 s of batch-tier work queued, nothing interactive: interactive requests go ahead of it.
    interactive = QueueState(200, 2000, 1, 10, ahead_items=0, ahead_tokens=0)
    assert policy.refuse(interactive, RequestControls()) is None
    batch = policy.refuse(QueueState(200, 2000, 1, 10), RequestControls(priority="batch"))
    assert batch is not None and batch.status_code == 503


def test_standing_queue_admission_serves_a_burst_but_refuses_sustained_overload() -> None:
    clock = [0.0]
    cost = PassCostModel(min_passes=1)
    cost.observe(100, 10, 100.0)  # ~1 ms per token, 10 items per pass
    limits = AdmissionLimits(10_000, 5000.0, 0.5, target_queue_delay_ms=500, standing_queue_ms=1000)
    policy = StandingQueueAdmission(limits, cost, clock=lambda: clock[0])

    def offer(queued_tokens: int) -> RequestError | None:
        return policy.refuse(
            QueueState(queued_tokens // 10, queued_tokens, 1, 10), RequestControls()
        )

    # A burst: 64 arrivals within 0.2 s build a ~3 s queue; all are admitted.
    for i in range(64):
        clock[0] = i * 0.003
        assert offer(i * 50) is None
    # The queue drains below target: nothing is standing.
    clock[0] = 3.0
    assert offer(100) is None
    # Sustained overload: the queue stays above target; after 1 s, refusals start.
    refused = []
    for step in range(30):
        clock[0] = 4.0 + step * 0.1
        refused.append(offer(800) is not None)
    assert not any(refused[:9]) and all(refused[11:])
    # Past the hard bound, refusal is immediate even in a fresh burst.
    clock[0] = 100.0
    hard = offer(6000)
    assert hard is not None and hard.status_code == 503


def test_standing_queue_admission_remembers_overload_so_dips_do_not_rearm_the_grace() -> None:
    clock = [0.0]
    cost = PassCostModel(min_passes=1)
    cost.observe(100, 10, 100.0)
    limits = AdmissionLimits(10_000, 5000.0, 0.5, target_queue_delay_ms=500, standing_queue_ms=1000)
    policy = StandingQueueAdmission(limits, cost, clock=lambda: clock[0])

    def offer(queued_tokens: int) -> RequestError | None:
        return policy.refuse(
            QueueState(queued_tokens // 10, queued_tokens, 1, 10), RequestControls()
        )

    for step in range(15):  # sustained overload: refusals start after the 1 s grace
        clock[0] = step * 0.1
        offer(800)
    assert offer(800) is not None
    clock[0] = 2.0
    assert offer(300) is None  # drained below target: admitted
    clock[0] = 2.05
    assert offer(700) is not None  # above target again, overload remembered: no new grace
    clock[0] = 60.0  # long after: a new burst gets its grace again
    assert offer(100) is None and offer(900) is None


def test_drain_admission_serves_a_burst_and_refuses_only_past_the_bound() -> None:
    cost = PassCostModel(min_passes=1)
    cost.observe(100, 10, 100.0)  # ~1 ms per token, 10 items per pass
    policy = DrainAdmission(AdmissionLimits(100_000, 30_000.0, 0.5), cost)
    # A burst that makes a 20 s queue (two bulk clients, 64 requests at once): all admitted.
    for queued in range(0, 20_000, 500):
        assert policy.refuse(QueueState(queued // 10, queued, 16, 500), RequestControls()) is None
    # Past 30 s of queued work: refused at once, Retry-After is the time until there is room.
    over = policy.refuse(QueueState(3_200, 32_000, 16, 500), RequestControls())
    assert over is not None and over.status_code == 503 and over.code == "overloaded"
    assert over.retry_after_s is not None and 2.0 <= over.retry_after_s < 5.0
    # The same queue with a deadline the work ahead cannot meet: 504 at once, not a wait.
    late = policy.refuse(
        QueueState(1_000, 10_000, 1, 10), RequestControls(deadline=time.time() + 2)
    )
    assert late is not None and late.status_code == 504


def test_refusal_memory_refuses_at_the_ingress_for_a_moment_after_an_overload() -> None:
    clock = [0.0]
    memory = RefusalMemory(window_s=0.25, clock=lambda: clock[0])
    assert memory.refusal("embedder", "interactive") is None
    memory.record(RequestError(400, "bad input"), "interactive")  # not an overload: ignored
    memory.record(RequestError(503, "x", code="backend_unavailable"), "interactive")
    assert memory.refusal("embedder", "interactive") is None
    memory.record(RequestError(503, "full", code="overloaded", retry_after_s=3.0), "batch")
    assert memory.refusal("embedder", "interactive") is None  # batch bounds are lower
    local = memory.refusal("embedder", "batch")
    assert local is not None and local.status_code == 503 and local.code == "overloaded"
    assert local.retry_after_s == pytest.approx(3.0)
    clock[0] = 0.1
    memory.record(RequestError(503, "full", code="overloaded", retry_after_s=2.0), "interactive")
    assert memory.refusal("embedder", "interactive") is not None
    assert memory.refusal("embedder", "batch") is not None
    clock[0] = 0.36  # past the window: the backend decides again
    assert memory.refusal("embedder", "interactive") is None


def test_a_refused_request_is_never_tokenized() -> None:
    class _Tokenizing(_CountingModel):
        def __init__(self) -> None:
            super().__init__(pass_s=0.3)
            self.tokenized: list[str] = []

        def tokenize(self, texts: list[str]) -> list[list[int]]:
            self.tokenized.extend(texts)
            return super().tokenize(texts)

    model = _Tokenizing()
    config = EmbedderConfig(batching={"max_queued_items": 4, "admission_policy": "bounded"})
    server = EmbeddingServer(config, model)

    async def main() -> list:
        first = asyncio.create_task(server.embed(["1", "2", "3"]))
        await asyncio.sleep(0.05)  # its pass is running: the replica holds 3 items
        refused = server.embed(["7", "8"])
        return await asyncio.gather(first, refused, return_exceptions=True)

    first, refused = asyncio.run(main())
    assert not isinstance(first, BaseException)
    assert isinstance(refused, RequestError) and refused.status_code == 503
    assert "7" not in model.tokenized and model.tokenized == ["1", "2", "3"]
    assert server.stats()["queued_items"] == 0  # every admitted share was released


def test_estimated_tokens_follow_the_ratio_the_replica_learns() -> None:
    server = EmbeddingServer(EmbedderConfig(), _CountingModel())
    assert server.estimate_tokens([400], max_tokens=10_000) == 102  # 4 chars/token + 2
    assert server.estimate_tokens([400, 4000], max_tokens=256) == 102 + 256  # capped per text
    for _ in range(60):
        server.learn_token_ratio(chars=800, tokens=100)  # this model: 8 chars per token
    assert server.estimate_tokens([400], max_tokens=10_000) == pytest.approx(52, abs=2)


def test_the_ingress_holds_overload_refusals_and_answers_the_next_ones_itself() -> None:
    calls = []

    async def full_backend() -> None:
        calls.append(1)
        raise RequestError(503, "full", code="overloaded", retry_after_s=0.6)

    async def main() -> list[tuple[float, RequestError]]:
        out = []
        for attempt in (lambda: call_backend("held-stage", full_backend()),) + (
            lambda: refuse_if_overloaded("held-stage"),
        ) * 2:
            started = time.monotonic()
            with pytest.raises(RequestError) as info:
                await attempt()
            out.append((time.monotonic() - started, info.value))
        return out

    (first_s, first), *local = asyncio.run(main())
    # The backend's refusal is held (a client that ignores Retry-After cannot resend at
    # once), then the ingress refuses by itself, held too, while it remembers the overload.
    assert calls == [1]
    assert first.status_code == 503 and first_s >= 0.55 and first.retry_after_s == 0.5
    for held_s, exc in local:
        assert exc.status_code == 503 and exc.code == "overloaded" and held_s >= 0.45
        assert exc.message.startswith("the held-stage stage is overloaded")
