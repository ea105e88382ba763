"""Autoscaling and replica counts the Serve way (issue 15): they live in the serve config's
deployments[] entries, and carpool's policy aims at what a replica runs at once under the
knobs in force. No Ray cluster: the policy runs inside Serve's own wrapper (bounds, delays)
on Serve's own ``AutoscalingContext``.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from typing import Any

import cloudpickle
import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

import carpool.autoscaling
from carpool.autoscaling import CAPACITY_METRIC, desired_replicas, follow_batch_capacity
from carpool.config import IngressConfig, ReplicaConfig
from deployments.embedder import EmbedderConfig
from pipelines.generate import GenerateArgs


def context(
    total_requests: float, capacities: dict[str, float], current: int, target: int
) -> AutoscalingContext:
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0
    )
    return AutoscalingContext(
        deployment_id=DeploymentID(name="small", app_name="generate"),
        deployment_name="small",
        app_name="generate",
        current_num_replicas=current,
        target_num_replicas=target,
        running_replicas=[],
        total_num_requests=total_requests,
        total_queued_requests=0,
        aggregated_metrics={CAPACITY_METRIC: capacities} if capacities else {},
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )


def test_the_target_is_what_one_replica_runs_under_its_knobs() -> None:
    assert desired_replicas(128, {"a": 64, "b": 64}, current=2) == pytest.approx(2.0)
    assert desired_replicas(200, {"a": 64, "b": 64}, current=2) == pytest.approx(3.125)
    # After `serve deploy` raised max_num_seqs in place, the same load needs fewer replicas.
    assert desired_replicas(200, {"a": 256, "b": 256}, current=2) == pytest.approx(0.78125)
    # Nothing reported yet (replicas just started): no guess.
    assert desired_replicas(200, {}, current=2) is None
    assert desired_replicas(200, {"a": 0}, current=1) is None


@pytest.mark.parametrize(
    ("total", "capacity", "current", "expected"),
    [
        (200, 64, 2, 4),  # 3.1 -> 4 replicas
        (200, 256, 2, 1),  # knobs raised in place: one replica carries it
        (96, 32, 1, 3),
    ],
)
def test_serves_wrapper_turns_the_policy_into_a_decision(
    total: float, capacity: float, current: int, expected: int
) -> None:
    # The wrapper Serve puts around every custom policy (delays, scaling factors); Serve's
    # autoscaling state then rounds up and clamps to min/max_replicas.
    policy = _apply_autoscaling_config(follow_batch_capacity)
    capacities = {f"r{i}": capacity for i in range(current)}
    replicas, _ = policy(context(total, capacities, current=current, target=current))
    assert math.ceil(replicas) == expected


def test_without_reports_the_policy_holds_the_current_target() -> None:
    replicas, _ = follow_batch_capacity(context(500, {}, current=2, target=2))
    assert replicas == 2


def test_serve_can_ship_the_policy_to_a_controller_without_carpool() -> None:
    # Serve pickles a policy's module by value; the controller must not need to import
    # carpool (or anything outside the standard library) to run it.
    cloudpickle.register_pickle_by_value(carpool.autoscaling)
    try:
        blob = cloudpickle.dumps(follow_batch_capacity)
    finally:
        cloudpickle.unregister_pickle_by_value(carpool.autoscaling)
    script = (
        "import pickle, sys, types\n"
        "sys.modules['carpool'] = None  # any import of carpool now fails\n"
        "policy = pickle.loads(sys.stdin.buffer.read())\n"
        "ctx = types.SimpleNamespace(aggregated_metrics={'carpool_capacity_requests': "
        "{'a': 32.0}}, total_num_requests=96.0, current_num_replicas=1, target_num_replicas=1)\n"
        "print(policy(ctx)[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], input=blob, capture_output=True, check=True, timeout=60
    )
    assert float(out.stdout) == pytest.approx(3.0)
    assert pickle.loads(blob) is not None


@pytest.mark.parametrize(
    ("model", "field"),
    [
        (ReplicaConfig, "num_replicas"),
        (ReplicaConfig, "autoscaling"),
        (IngressConfig, "num_replicas"),
    ],
)
def test_replica_counts_in_args_are_refused_with_where_they_go(model: Any, field: str) -> None:
    value = 2 if field == "num_replicas" else {"min_replicas": 1, "max_replicas": 2}
    with pytest.raises(ValidationError) as raised:
        model.model_validate({field: value})
    message = str(raised.value)
    assert f".{field} is not read here" in message
    assert "deployments[]" in message


def test_the_refusal_reaches_a_pipelines_args() -> None:
    with pytest.raises(ValidationError, match=r"ingress\.num_replicas is not read here"):
        GenerateArgs.model_validate({"ingress": {"num_replicas": 2}})
    with pytest.raises(ValidationError, match=r"replica\.autoscaling is not read here"):
        EmbedderConfig.model_validate({"replica": {"autoscaling": {"max_replicas": 2}}})


def test_code_sets_no_replica_count_for_the_config_to_override() -> None:
    options = EmbedderConfig().replica.serve_options("embedder", EmbedderConfig().batching)
    assert "num_replicas" not in options and "autoscaling_config" not in options
