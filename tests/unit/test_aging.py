"""One aging key (carpool.aging) for the router's lanes and vLLM's priority scheduler."""

from __future__ import annotations

import random

import pytest

from carpool.aging import DEFAULT_AGING_TOKENS_PER_S, DEFAULT_TIER_PENALTY_TOKENS, aging_key
from router.config import RouterConfig
from router.lanes import ShortestFirstQueue


def _requests(seed: int, count: int = 300) -> list[tuple[int, float, float, str]]:
    """(id, predicted tokens, arrival s, tier), arriving in order over ~count / 10 s."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        predicted = rng.choice([rng.uniform(1, 64), rng.uniform(64, 2000)])
        arrival = i * 0.1 + rng.random() * 0.05
        out.append((i, predicted, arrival, rng.choice(["interactive", "batch"])))
    return out


def test_key_is_shortest_first_interactive_first_and_ages() -> None:
    assert aging_key(10, 0, 0.0) < aging_key(500, 0, 0.0)
    assert aging_key(900, 0, 0.0) < aging_key(10, 1, 0.0)  # the batch tier's 1000 tokens
    # A 500-token request that waited 500 / 50 = 10 s is ahead of a 1-token newcomer.
    assert aging_key(500, 0, 0.0) < aging_key(1, 0, 10.1)
    assert aging_key(500, 0, 0.0) > aging_key(1, 0, 9.9)
    assert aging_key(-5, 0, 0.0) == aging_key(0, 0, 0.0)  # a negative prediction counts as 0
    assert aging_key(0, 1, 2.0, aging_tokens_per_s=5, tier_penalty_tokens=7) == 17


def test_one_set_of_defaults() -> None:
    assert RouterConfig().aging_tokens_per_s == DEFAULT_AGING_TOKENS_PER_S
    queue: ShortestFirstQueue[int] = ShortestFirstQueue()
    assert queue.aging == DEFAULT_AGING_TOKENS_PER_S
    assert queue.batch_penalty == DEFAULT_TIER_PENALTY_TOKENS


@pytest.mark.parametrize("aging", [5.0, DEFAULT_AGING_TOKENS_PER_S])
def test_router_lanes_and_vllm_priority_order_the_same_requests_the_same(aging: float) -> None:
    from carpool.generation.vllm_engine import vllm_priority

    requests = _requests(seed=int(aging))
    queue: ShortestFirstQueue[int] = ShortestFirstQueue(aging_tokens_per_s=aging)
    keyed = []
    for i, predicted, arrival, tier in requests:
        queue.push(i, predicted, arrival, tier)  # type: ignore[arg-type]
        rank = 1 if tier == "batch" else 0
        # vLLM orders by (priority, arrival).
        keyed.append((vllm_priority(rank, predicted, arrival, aging), arrival, i))
    lane_order = [queue.pop() for _ in range(len(queue))]
    vllm_order = [i for _, _, i in sorted(keyed)]
    # vLLM's integer priority rounds the key; only requests whose keys lie within one token
    # of each other may change places.
    key = {i: aging_key(p, 1 if t == "batch" else 0, a, aging) for i, p, a, t in requests}
    for lane_i, vllm_i in zip(lane_order, vllm_order, strict=True):
        assert abs(key[lane_i] - key[vllm_i]) <= 1.0, (lane_i, vllm_i)


def test_with_whole_token_keys_the_two_orders_are_identical() -> None:
    """No rounding to hide behind: ties go to the earlier arrival in both."""
    from carpool.generation.vllm_engine import vllm_priority

    rng = random.Random(3)
    queue: ShortestFirstQueue[int] = ShortestFirstQueue(aging_tokens_per_s=5.0)
    keyed = []
    for i in range(300):
        predicted, arrival = rng.randrange(1, 400), i * 0.2  # aging * arrival: whole tokens
        tier = rng.choice(["interactive", "batch"])
        queue.push(i, predicted, arrival, tier)  # type: ignore[arg-type]
        keyed.append((vllm_priority(int(tier == "batch"), predicted, arrival, 5.0), arrival, i))
    assert [queue.pop() for _ in range(len(queue))] == [i for _, _, i in sorted(keyed)]
