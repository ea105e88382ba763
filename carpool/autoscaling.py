"""A Serve autoscaling policy whose target follows the batching knobs in force.

Serve's own policy aims at ``target_ongoing_requests`` per replica, a number written in the
serve config. How many requests one carpool replica runs at once is a ``user_config`` knob
(``max_batch_size``, ``max_num_seqs``) that ``serve deploy`` changes in place, so a fixed
target drifts from it: a generator running 64 sequences with a target of 16 scales out at a
quarter of its load. Each model replica reports what it runs at once under the knobs it has
(``record_autoscaling_stats``, metric ``CAPACITY_METRIC``); this policy aims at that many
ongoing requests per replica. Serve still applies the config's bounds, delays and factors.

Chosen by name in a deployment's ``autoscaling_config`` (serve-gpu.yaml does)::

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      policy: {policy_function: carpool.autoscaling:follow_batch_capacity}

This module imports nothing from carpool or Ray: Serve pickles the policy by value into its
controller, which need not have carpool installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CAPACITY_METRIC = "carpool_capacity_requests"
POLICY = "carpool.autoscaling:follow_batch_capacity"


def desired_replicas(
    total_requests: float, capacities: Mapping[Any, float], current: int
) -> float | None:
    """Replicas that would carry ``total_requests`` at each replica's reported capacity.

    ``None`` while no running replica has reported yet (a fresh replica reports within
    Serve's metrics interval): the policy then holds the current count rather than guess.
    """
    reported = [c for c in capacities.values() if c and c > 0]
    if not reported or current <= 0:
        return None
    per_replica = sum(reported) / len(reported)
    return total_requests / per_replica


def follow_batch_capacity(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve custom autoscaling policy (``AutoscalingContext`` -> replicas, policy state)."""
    metrics = ctx.aggregated_metrics or {}
    wanted = desired_replicas(
        ctx.total_num_requests, metrics.get(CAPACITY_METRIC, {}), ctx.current_num_replicas
    )
    if wanted is None:
        return ctx.target_num_replicas, {}
    return wanted, {}
