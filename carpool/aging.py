"""The aging priority key: shortest predicted first, interactive ahead of batch, no starvation.

One function for every queue that orders generation requests by predicted length: the
router's lanes (``router.lanes.ShortestFirstQueue``) and vLLM's priority scheduler
(``carpool.generation.vllm_engine.vllm_priority``), so both order the same requests the same
way. Pure: no Ray, no vLLM.

A waiting request's score at time t is ``predicted + rank * tier_penalty - aging * (t -
arrival)``. Every waiting request ages at the same rate, so ordering by ``predicted + rank *
tier_penalty + aging * arrival`` (fixed when it arrives) gives the same order at every t: a
key set once stands for a priority that keeps rising. Lower runs first. A request that waited
``predicted / aging`` seconds is ahead of any newcomer.
"""

from __future__ import annotations

# Predicted tokens a waiting request gains per second: 50 suits a model decoding hundreds of
# tokens/s; a CPU model decoding ~30-45 tokens/s wants ~5 (benchmarks/ROUTER.md), set per
# deployment (router.aging_tokens_per_s, vllm.aging_tokens_per_s).
DEFAULT_AGING_TOKENS_PER_S = 50.0
# Predicted tokens a batch-tier request (rank 1) counts longer than an interactive one (rank
# 0): interactive requests go first unless a batch one waited this long / aging.
DEFAULT_TIER_PENALTY_TOKENS = 1000.0


def aging_key(
    predicted_tokens: float,
    rank: int,
    arrival_s: float,
    aging_tokens_per_s: float = DEFAULT_AGING_TOKENS_PER_S,
    tier_penalty_tokens: float = DEFAULT_TIER_PENALTY_TOKENS,
) -> float:
    """The order key (lower first) of a request predicted ``predicted_tokens`` long.

    ``rank``: 0 interactive, 1 batch (``RequestControls.rank``). ``arrival_s``: when it
    arrived, on any clock the queue's requests share. A negative prediction counts as 0.
    """
    return max(predicted_tokens, 0.0) + rank * tier_penalty_tokens + aging_tokens_per_s * arrival_s
