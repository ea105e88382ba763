"""Model choice: which generator answers, and when the small model's answer is not enough.

- ``ThresholdChoice``: large for requests predicted long or carrying "hard" cues.
- ``CascadePolicy``: small answers first; escalate to large when its mean token log-probability
  is low, it hit ``max_tokens`` unfinished, or it degenerated into repetition.
- ``EscalationLearner``: learns from cascade outcomes which prompts escalate, so they can go
  straight to large and skip the wasted small attempt.
- ``commit_up_front``: a streamed request cannot be escalated once its first token is out, so
  a cascade's small-first decision becomes a choice made before generating.
- ``overflow``: when the large model's queue would break the latency target, serve on small
  and say so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.features import RequestFeatures

SMALL = "small"
LARGE = "large"


@dataclass(frozen=True)
class Decision:
    model: str
    reason: str
    cascade: bool = False  # the small answer may still be escalated
    overflow: bool = False  # large was wanted but its queue was too long


@dataclass(frozen=True)
class SmallOutcome:
    """What the cascade looks at in the small model's answer."""

    token_ids: Sequence[int]
    token_logprobs: Sequence[float]
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class LargeLoad:
    """The large model's backlog, as the router sees it."""

    queued_tokens: float
    tokens_per_s: float

    @property
    def expected_wait_ms(self) -> float:
        return 1000 * self.queued_tokens / max(self.tokens_per_s, 1e-9)


def repetition_ratio(token_ids: Sequence[int], n: int = 4) -> float:
    """Share of n-grams that already occurred earlier in the sequence (0 = no repetition)."""
    if len(token_ids) < 2 * n:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
    for gram in grams:
        if gram in seen:
            repeated += 1
        seen.add(gram)
    return repeated / len(grams)


class ThresholdChoice:
    """Large when the predicted answer is long or the request carries a hard cue."""

    def __init__(
        self, max_small_tokens: float = 128.0, hard_cues: frozenset[str] = frozenset({"code"})
    ) -> None:
        self.max_small_tokens = max_small_tokens
        self.hard_cues = hard_cues

    def choose(self, features: RequestFeatures, predicted_tokens: float) -> Decision:
        if features.cues & self.hard_cues:
            return Decision(LARGE, f"cue {sorted(features.cues & self.hard_cues)[0]}")
        if predicted_tokens > self.max_small_tokens:
            return Decision(
                LARGE, f"predicted {predicted_tokens:.0f} > {self.max_small_tokens:.0f}"
            )
        return Decision(SMALL, f"predicted {predicted_tokens:.0f} <= {self.max_small_tokens:.0f}")


class CascadePolicy:
    """Small first; ``should_escalate`` judges its answer."""

    def __init__(
        self,
        min_mean_logprob: float = -1.0,
        max_repetition: float = 0.3,
        escalate_on_length: bool = True,
    ) -> None:
        self.min_mean_logprob = min_mean_logprob
        self.max_repetition = max_repetition
        self.escalate_on_length = escalate_on_length

    def choose(self, features: RequestFeatures, predicted_tokens: float) -> Decision:
        return Decision(SMALL, "cascade: small first", cascade=True)

    def should_escalate(self, outcome: SmallOutcome) -> tuple[bool, str]:
        if self.escalate_on_length and outcome.finish_reason == "length":
            return True, "small hit max_tokens unfinished"
        if outcome.token_logprobs:
            mean = sum(outcome.token_logprobs) / len(outcome.token_logprobs)
            if mean < self.min_mean_logprob:
                return True, f"small mean logprob {mean:.2f} < {self.min_mean_logprob:.2f}"
        ratio = repetition_ratio(outcome.token_ids)
        if ratio > self.max_repetition:
            return True, f"small repeated itself ({ratio:.0%} repeated 4-grams)"
        return False, "small answer accepted"


class EscalationLearner:
    """Online logistic regression: P(the small answer will be escalated | features).

    Trained by every cascade outcome. Once it has seen ``min_observations`` and is confident
    (P > ``skip_threshold``), the request goes straight to large.
    """

    def __init__(
        self,
        dims: int,
        learning_rate: float = 0.1,
        l2: float = 1e-3,
        skip_threshold: float = 0.7,
        min_observations: int = 30,
    ) -> None:
        self.weights = np.zeros(dims)
        self.learning_rate = learning_rate
        self.l2 = l2
        self.skip_threshold = skip_threshold
        self.min_observations = min_observations
        self.observations = 0

    def probability(self, features: RequestFeatures) -> float:
        z = float(np.asarray(features.vector()) @ self.weights)
        return 1 / (1 + math.exp(-max(min(z, 30), -30)))

    def observe(self, features: RequestFeatures, escalated: bool) -> None:
        x = np.asarray(features.vector())
        error = self.probability(features) - (1.0 if escalated else 0.0)
        self.weights -= self.learning_rate * (error * x + self.l2 * self.weights)
        self.observations += 1

    def skip_small(self, features: RequestFeatures) -> bool:
        return (
            self.observations >= self.min_observations
            and self.probability(features) > self.skip_threshold
        )


def commit_up_front(
    decision: Decision, threshold: ThresholdChoice, features: RequestFeatures, predicted: float
) -> Decision:
    """For a streamed request: the model chosen before generating, never a cascade.

    A cascade judges small's whole answer, so streaming it would hold the first byte back for
    a whole generation. Instead the threshold policy decides at once from the learned length
    prediction and the prompt's cues (``EscalationLearner``'s confident prompts have already
    gone to large by then); the answer streams as it is generated and is not escalated.
    """
    if not decision.cascade:
        return decision
    chosen = threshold.choose(features, predicted)
    return Decision(chosen.model, f"streamed, chosen before generating: {chosen.reason}")


def overflow(decision: Decision, load: LargeLoad | None, latency_target_ms: float) -> Decision:
    """Serve on small when the large model's backlog would break the latency target."""
    if decision.model != LARGE or load is None or load.expected_wait_ms <= latency_target_ms:
        return decision
    return Decision(
        SMALL,
        f"large backlog {load.expected_wait_ms:.0f} ms > target {latency_target_ms:.0f} ms",
        overflow=True,
    )
