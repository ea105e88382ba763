"""Routing policies on their own: prediction, lanes, model choice. No Ray, no model."""

from __future__ import annotations

import math
import random

import pytest

from router.choice import (
    LARGE,
    SMALL,
    CascadePolicy,
    Decision,
    EscalationLearner,
    LargeLoad,
    SmallOutcome,
    ThresholdChoice,
    overflow,
    repetition_ratio,
)
from router.features import extract_features
from router.lanes import Lane, LanePolicy, ShortestFirstQueue, single_lane
from router.length import LengthPredictor

PROMPTS = [
    ("Answer yes or no: is water wet?", 3),
    ("What is 17 + 25? Give just the number.", 4),
    ("Name the capital of Peru in one word.", 3),
    ("List five fruits.", 30),
    ("Explain why the sky is blue.", 120),
    ("Write a story about a dragon and a knight.", 400),
    ("Explain in detail how a compiler works, step by step.", 600),
    ("Briefly, what is a tensor?", 40),
]


def _kendall_tau(a: list[float], b: list[float]) -> float:
    concordant = discordant = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            s = (a[i] - a[j]) * (b[i] - b[j])
            concordant += s > 0
            discordant += s < 0
    return (concordant - discordant) / max(concordant + discordant, 1)


def _sample(rng: random.Random):
    text, base = rng.choice(PROMPTS)
    prompt_tokens = rng.randint(5, 400)
    # The truth: cue-driven base length, noisy, and longer prompts ask for a bit more.
    true = max(1, int(base * math.exp(rng.gauss(0, 0.3)) * (1 + prompt_tokens / 800)))
    features = extract_features(text, prompt_tokens, max_tokens=1024)
    return features, true


def test_the_prior_already_orders_obvious_cases() -> None:
    predictor = LengthPredictor()
    yes_no = predictor.predict(extract_features("Answer yes or no: is it?", 10, 512))
    story = predictor.predict(extract_features("Write a story about cats in detail", 10, 512))
    assert yes_no < 20 < story


def test_learning_online_reaches_a_good_ranking() -> None:
    rng = random.Random(0)
    predictor = LengthPredictor(default_tokens=48)
    for _ in range(200):
        features, true = _sample(rng)
        predictor.observe(features, true)
    held_out = [_sample(rng) for _ in range(200)]
    predicted = [predictor.predict(f) for f, _ in held_out]
    assert _kendall_tau(predicted, [t for _, t in held_out]) >= 0.5
    mae_log = (
        sum(
            abs(math.log1p(p) - math.log1p(t))
            for p, (_, t) in zip(predicted, held_out, strict=True)
        )
        / 200
    )
    assert mae_log < 0.6


def test_predictions_stay_within_one_and_max_tokens() -> None:
    predictor = LengthPredictor(default_tokens=5000)
    features = extract_features("Write an essay in detail", 100, max_tokens=64)
    assert predictor.predict(features) == 64
    predictor = LengthPredictor(default_tokens=1)
    assert predictor.predict(extract_features("yes or no?", 1, 8)) >= 1


def test_learned_state_survives_a_restart(tmp_path) -> None:
    path = tmp_path / "predictor.json"
    rng = random.Random(1)
    first = LengthPredictor(snapshot_path=path, snapshot_every=10)
    for _ in range(30):
        first.observe(*_sample(rng))
    probe = extract_features("Explain why the sky is blue.", 50, 1024)
    restarted = LengthPredictor(snapshot_path=path)
    assert restarted.observations == 30
    assert restarted.predict(probe) == pytest.approx(first.predict(probe))
    assert LengthPredictor().predict(probe) != pytest.approx(first.predict(probe))


def test_a_snapshot_of_another_shape_is_ignored(tmp_path) -> None:
    path = tmp_path / "p.json"
    LengthPredictor(embedding_dims=8).save(path)
    fresh = LengthPredictor(snapshot_path=path)
    assert fresh.observations == 0


def test_embeddings_feed_the_predictor() -> None:
    predictor = LengthPredictor(embedding_dims=4, embedding_source_dims=6)
    long_vec = [1.0, 0, 0, 0, 0, 0]
    short_vec = [0, 1.0, 0, 0, 0, 0]
    for _ in range(50):
        predictor.observe(extract_features("Tell me", 10, 1024, embedding=long_vec), 500)
        predictor.observe(extract_features("Tell me", 10, 1024, embedding=short_vec), 5)
    long_p = predictor.predict(extract_features("Tell me", 10, 1024, embedding=long_vec))
    short_p = predictor.predict(extract_features("Tell me", 10, 1024, embedding=short_vec))
    assert long_p > 10 * short_p


def test_lanes_assign_by_predicted_length_and_validate() -> None:
    policy = LanePolicy([Lane("short", 64), Lane("medium", 256), Lane("long", None)])
    assert [policy.assign(p).name for p in (1, 64, 65, 256, 5000)] == [
        "short",
        "short",
        "medium",
        "medium",
        "long",
    ]
    assert single_lane().assign(10_000).name == "fifo"
    with pytest.raises(ValueError, match="ordered"):
        LanePolicy([Lane("a", 256), Lane("b", 64), Lane("c", None)])
    with pytest.raises(ValueError, match="last lane"):
        LanePolicy([Lane("a", None), Lane("b", 64)])


def test_shortest_first_with_aging_never_starves_long_requests() -> None:
    queue: ShortestFirstQueue[str] = ShortestFirstQueue(aging_tokens_per_s=100)
    queue.push("long", 500, now=0.0)
    queue.push("short", 10, now=0.0)
    assert queue.pop() == "short"
    # New short requests keep coming; after 5 s of waiting the long one is ahead of them.
    queue.push("short-at-4s", 10, now=4.0)
    assert queue.pop() == "short-at-4s"
    queue.push("short-at-6s", 10, now=6.0)
    assert queue.pop() == "long"


def test_interactive_goes_ahead_of_batch() -> None:
    queue: ShortestFirstQueue[str] = ShortestFirstQueue(batch_tier_penalty=1000)
    queue.push("batch-short", 5, now=0.0, tier="batch")
    queue.push("interactive-long", 300, now=0.0)
    assert queue.pop() == "interactive-long"


def test_threshold_choice() -> None:
    policy = ThresholdChoice(max_small_tokens=100)
    assert policy.choose(extract_features("hi", 3, 512), 20).model == SMALL
    assert policy.choose(extract_features("hi", 3, 512), 300).model == LARGE
    assert policy.choose(extract_features("write python code", 3, 512), 20).model == LARGE


def test_cascade_escalation_rules() -> None:
    cascade = CascadePolicy(min_mean_logprob=-1.0, max_repetition=0.3)
    fine = SmallOutcome(list(range(20)), [-0.2] * 20, "stop")
    assert cascade.should_escalate(fine) == (False, "small answer accepted")
    assert cascade.should_escalate(SmallOutcome(list(range(20)), [-0.2] * 20, "length"))[0]
    assert cascade.should_escalate(SmallOutcome(list(range(20)), [-2.5] * 20, "stop"))[0]
    loop = [1, 2, 3, 4] * 10
    assert repetition_ratio(loop) > 0.8
    assert cascade.should_escalate(SmallOutcome(loop, [-0.1] * 40, "stop"))[0]


def test_escalation_learner_learns_which_prompts_escalate() -> None:
    hard = extract_features("Write python code for a parser", 40, 512)
    easy = extract_features("Answer yes or no: is it raining?", 12, 512)
    learner = EscalationLearner(dims=len(hard.vector()), min_observations=20)
    assert not learner.skip_small(hard)
    for _ in range(100):
        learner.observe(hard, True)
        learner.observe(easy, False)
    assert learner.skip_small(hard)
    assert not learner.skip_small(easy)


def test_overflow_serves_on_small_when_large_is_backed_up() -> None:
    wants_large = Decision(LARGE, "long")
    busy = LargeLoad(queued_tokens=5000, tokens_per_s=10)
    idle = LargeLoad(queued_tokens=10, tokens_per_s=10)
    moved = overflow(wants_large, busy, latency_target_ms=2000)
    assert moved.model == SMALL and moved.overflow
    assert overflow(wants_large, idle, latency_target_ms=2000) is wants_large
    assert overflow(Decision(SMALL, "short"), busy, 2000).model == SMALL
