"""Part ``predictor``: ``LengthPredictor`` trained online on a split of the prompts, scored
on the rest against the small model's true lengths."""

from __future__ import annotations

import random
from typing import Any

from benchmarks.router_eval.metrics import (
    bucket,
    bucket_accuracy,
    kendall_tau,
    mae_log,
)
from benchmarks.router_eval.models import _bare_router, _features, load_jsonl, true_lengths
from benchmarks.router_eval.settings import BUCKETS, LENGTH_MAX_TOKENS, PROMPTS_PATH, TRAIN_MAX
from benchmarks.stats import percentile


def part_predictor(refresh: bool, seed: int = 0) -> dict[str, Any]:
    prompts = load_jsonl(PROMPTS_PATH)
    lengths = true_lengths(refresh)
    rng = random.Random(seed)
    order = prompts[:]
    rng.shuffle(order)
    n_train = min(TRAIN_MAX, int(len(order) * 0.6))
    train, test = order[:n_train], order[n_train:]
    router = _bare_router()
    prior_preds = [
        router.predictor.predict(_features(router, p["prompt"], LENGTH_MAX_TOKENS)) for p in test
    ]
    for p in train:  # online, one completion at a time, as the router learns in service
        router.predictor.observe(
            _features(router, p["prompt"], LENGTH_MAX_TOKENS), lengths[str(p["id"])]
        )
    preds = [
        router.predictor.predict(_features(router, p["prompt"], LENGTH_MAX_TOKENS)) for p in test
    ]
    actual = [float(lengths[str(p["id"])]) for p in test]
    per_kind: dict[str, list[float]] = {}
    for p, a in zip(test, actual, strict=True):
        per_kind.setdefault(p["kind"], []).append(a)
    result = {
        "prompts": len(prompts),
        "train": len(train),
        "test": len(test),
        "buckets": f"<= {BUCKETS[0]}, <= {BUCKETS[1]}, > {BUCKETS[1]} tokens",
        "kendall_tau": kendall_tau(preds, actual),
        "mae_log": mae_log(preds, actual),
        "bucket_accuracy": bucket_accuracy(preds, actual),
        "prior_only": {
            "kendall_tau": kendall_tau(prior_preds, actual),
            "mae_log": mae_log(prior_preds, actual),
            "bucket_accuracy": bucket_accuracy(prior_preds, actual),
        },
        "true_length_by_kind": {
            k: {"n": len(v), "median": percentile(v, 50), "max": max(v)}
            for k, v in sorted(per_kind.items())
        },
        "bucket_shares": [
            sum(bucket(a) == b for a in actual) / len(actual) for b in range(len(BUCKETS) + 1)
        ],
    }
    print("\n== predictor (held-out) ==")
    print(f"{'':<14}{'tau':>8}{'MAE log':>10}{'bucket acc':>12}")
    prior = result["prior_only"]
    print(
        f"{'prior only':<14}{prior['kendall_tau']:>8.3f}{prior['mae_log']:>10.3f}"
        f"{prior['bucket_accuracy']:>12.3f}"
    )
    print(
        f"{f'after {n_train}':<14}{result['kendall_tau']:>8.3f}{result['mae_log']:>10.3f}"
        f"{result['bucket_accuracy']:>12.3f}"
    )
    return result
