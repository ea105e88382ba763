"""Deadlines and client disconnects reach every stage of the search DAG.

The ranker here is the real ``RankingServer`` + Serve shell over a scorer that takes a fixed
0.3 s per forward pass, so a queue forms on demand: what happens to queued items is then
visible in the ranker's own counters (forward passes, dropped items by reason).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import cloudpickle
import httpx
import pytest
from ray import serve

from carpool.serving import ServeBatching, make_collector
from deployments.ranker import RankerConfig, RankingServer
from pipelines.embed import build_embed_app
from pipelines.search import build_search_app

PASS_S = 0.3


class SlowScorer:
    name = "slow-scorer"
    max_length = 512

    def encode(self, query: str, documents: list[str], truncate: bool) -> list[Any]:
        return [(([1] * (4 + len(d) % 7), None), False) for d in documents]

    def score(self, batch: list[Any]) -> list[float]:
        time.sleep(PASS_S)
        return [float(len(ids)) for ids, _ in batch]


class SlowRankingDeployment(ServeBatching, RankingServer):
    _collect = make_collector()

    def __init__(self) -> None:
        config = RankerConfig.model_validate(
            {"batching": {"max_batch_size": 4, "batch_wait_timeout_s": 0.0}}
        )
        RankingServer.__init__(self, config, SlowScorer())
        self._init_serving("slow-scorer")


@pytest.fixture(scope="module")
def stack(serve_http: str, tiny_models: dict, tmp_path_factory: pytest.TempPathFactory):
    # The replica must find these classes without importing the test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    replica = {"num_cpus": 0.25}
    serve.run(
        build_embed_app(
            {"embedder": {"source": {"model": tiny_models["encoder"]}, "replica": replica}}
        ),
        name="dl-embed",
        route_prefix="/dl-embed",
    )
    ranker = serve.deployment(SlowRankingDeployment).options(
        name="ranker",
        max_ongoing_requests=256,
        ray_actor_options={"num_cpus": 0.25},
        # A deep queue is the point here: admission must not refuse it before it forms.
        user_config={
            "max_batch_size": 4,
            "batch_wait_timeout_s": 0.0,
            "max_queue_delay_ms": 60_000,
        },
    )
    serve.run(ranker.bind(), name="dl-rank", route_prefix=None)
    index = tmp_path_factory.mktemp("dl-index")
    serve.run(
        build_search_app(
            {
                "app_name": "dl-search",
                "retriever": {
                    "index_dir": str(index),
                    "embed_app": "dl-embed",
                    "seed_default_corpus": False,
                },
                "rank_app": "dl-rank",
                "rerank_weight": 0.5,
            }
        ),
        name="dl-search",
        route_prefix="/dl-search",
    )
    base = f"{serve_http}/dl-search/v1"
    docs = {"documents": [{"id": f"d{i}", "text": f"document number {i}"} for i in range(4)]}
    assert httpx.post(f"{base}/documents", json=docs, timeout=120).status_code == 200
    yield base
    for name in ("dl-search", "dl-rank", "dl-embed"):
        serve.delete(name)
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _ranker_stats() -> dict[str, Any]:
    handle = serve.get_deployment_handle("ranker", app_name="dl-rank")
    return handle.stats.remote().result(timeout_s=60)


class _Filler:
    """Rank calls queued to keep the ranker busy; ``result`` waits for all of them."""

    def __init__(self, responses: list[Any]) -> None:
        self.responses = responses

    def result(self, timeout_s: float) -> None:
        for response in self.responses:
            response.result(timeout_s=timeout_s)


def _keep_ranker_busy(seconds: float) -> _Filler:
    """Queues ~``seconds`` of passes on the ranker straight through its handle.

    One call per pass (4 pairs each): the executor runs the most urgent pass first, by
    arrival plus the job's own cost, so one long filler job would let a later short search
    overtake it. Many one-pass jobs that came first stay ahead of it, as a busy queue is.
    """
    handle = serve.get_deployment_handle("ranker", app_name="dl-rank")
    return _Filler(
        [
            handle.rank.remote("filler", [f"filler {i} {j}" for j in range(4)])
            for i in range(round(seconds / PASS_S))
        ]
    )


def test_a_search_within_its_deadline_succeeds(stack: str) -> None:
    r = httpx.post(
        f"{stack}/search",
        json={"query": "document", "top_k": 4, "top_n": 2},
        headers={"x-carpool-deadline-ms": "20000", "x-carpool-priority": "interactive"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 2


def test_a_search_past_its_deadline_gets_504_and_its_rank_work_is_never_computed(
    stack: str,
) -> None:
    busy = _keep_ranker_busy(3.0)
    time.sleep(0.5)  # the filler is queued and running
    before = _ranker_stats()
    started = time.monotonic()
    r = httpx.post(
        f"{stack}/search",
        json={"query": "document", "top_k": 4, "top_n": 2},
        headers={"x-carpool-deadline-ms": "800"},
        timeout=60,
    )
    took = time.monotonic() - started
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] in ("deadline_exceeded", "deadline_unmeetable")
    assert took < 2.5, f"a 504 for an 800 ms deadline took {took:.1f} s"
    busy.result(timeout_s=60)
    after = _ranker_stats()
    # The filler's passes ran; the search's 4 pairs were refused, dropped or cancelled.
    dropped = (
        after["deadline_dropped_items"]
        + after["cancelled_items"]
        - before["deadline_dropped_items"]
        - before["cancelled_items"]
    )
    assert dropped == 4, (before, after)
    filler_items = round(3.0 / PASS_S) * 4
    assert after["items"] - before["items"] <= filler_items


def test_clients_that_leave_cancel_their_queued_rank_work(stack: str) -> None:
    busy = _keep_ranker_busy(3.0)
    time.sleep(0.5)
    before = _ranker_stats()

    async def leave_early() -> int:
        left = 0
        async with httpx.AsyncClient(timeout=0.8) as client:

            async def one(i: int) -> None:
                nonlocal left
                try:
                    await client.post(
                        f"{stack}/search", json={"query": f"document {i}", "top_k": 4}
                    )
                except httpx.TimeoutException:
                    left += 1

            await asyncio.gather(*(one(i) for i in range(5)))
        return left

    assert asyncio.run(leave_early()) == 5
    busy.result(timeout_s=60)
    time.sleep(0.5)
    after = _ranker_stats()
    cancelled = after["cancelled_items"] - before["cancelled_items"]
    computed = after["items"] - before["items"]
    filler_items = round(3.0 / PASS_S) * 4
    # 5 searches x 4 pairs: all left their batch before being scored.
    assert cancelled == 20, (before, after)
    assert computed <= filler_items, (before, after)  # part of the filler ran before
    # And the stack still answers.
    r = httpx.post(f"{stack}/search", json={"query": "document", "top_k": 4}, timeout=60)
    assert r.status_code == 200


def test_interactive_searches_overtake_queued_batch_searches(stack: str) -> None:
    busy = _keep_ranker_busy(1.2)
    time.sleep(0.3)

    async def race() -> tuple[float, list[float]]:
        async with httpx.AsyncClient(timeout=60) as client:

            async def one(i: int, tier: str) -> float:
                r = await client.post(
                    f"{stack}/search",
                    json={"query": f"document {i}", "top_k": 4},
                    headers={"x-carpool-priority": tier},
                )
                assert r.status_code == 200, r.text
                return time.monotonic()

            batch = [asyncio.create_task(one(i, "batch")) for i in range(6)]
            await asyncio.sleep(0.3)  # the batch searches are queued at the ranker
            interactive = await one(99, "interactive")
            return interactive, list(await asyncio.gather(*batch))

    interactive_done, batch_done = asyncio.run(race())
    busy.result(timeout_s=60)
    overtaken = sum(done > interactive_done for done in batch_done)
    # Passes hold 4 pairs (one search): the interactive one runs in the next step, ahead of
    # batch searches that were queued before it.
    assert overtaken >= 2, (interactive_done, sorted(batch_done))


def test_an_ingress_default_deadline_applies_unless_the_client_sends_one(
    serve_http: str, tiny_models: dict
) -> None:
    args = {
        "embedder": {"source": {"model": tiny_models["encoder"]}, "replica": {"num_cpus": 0.25}},
        "ingress": {"num_cpus": 0.05, "default_deadline_ms": 0.001},
    }
    serve.run(build_embed_app(args), name="dl-default", route_prefix="/dl-default")
    try:
        url = f"{serve_http}/dl-default/v1/embeddings"
        r = httpx.post(url, json={"input": "hello"}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        ok = httpx.post(
            url, json={"input": "hello"}, headers={"x-carpool-deadline-ms": "60000"}, timeout=60
        )
        assert ok.status_code == 200, ok.text
    finally:
        serve.delete("dl-default")
