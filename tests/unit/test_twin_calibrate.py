"""Fitting the twin's serving costs on a calibration run (``carpool_twin.calibrate``)."""

from __future__ import annotations

import random

import pytest

from carpool.config import BatchingConfig
from carpool_twin.calibrate import priced_pass_ms, serving_pass_scale
from carpool_twin.replicas import SimRequest
from carpool_twin.sim import Overheads, poisson
from carpool_twin.topology import PoolSpec, TwinSpec


def encoder_spec(const_ms: float, per_token_ms: float = 0.0, **knobs: object) -> TwinSpec:
    coef = {"const": const_ms, "padded_tokens": per_token_ms}
    entry = {"kind": "encoder", "pass": {"fits": {"line": {"coef": coef}}, "use": "line"}}
    batching = BatchingConfig.model_validate({"max_batch_size": 1, **knobs}).model_dump()
    return TwinSpec({"embedder": PoolSpec("embedder", 1, batching, entry, 512, 512)})


ONE = SimRequest("embed", lengths=(16,))


def test_the_calibration_run_is_priced_one_request_at_a_time() -> None:
    # Two items per request at one item per pass: two 40 ms passes each.
    two = SimRequest("embed", lengths=(16, 16))
    assert priced_pass_ms(encoder_spec(40.0), "embedder", [two], 5) == pytest.approx(400.0)


def test_pass_scale_is_the_replicas_pass_time_over_the_profiles_price() -> None:
    spec = encoder_spec(50.0)
    # 10 requests, one 50 ms pass each, that took 650 ms of passes in the replica.
    assert serving_pass_scale(spec, "embedder", [ONE], 10, 650.0) == pytest.approx(1.3)
    # The spec's own overheads and any scale already set do not enter the price.
    spec.overheads = Overheads(fixed_ms=30.0, host_cores=2.0, cpu_ms_per_request=500.0)
    spec.pools["embedder"].pass_scale = 2.0
    assert serving_pass_scale(spec, "embedder", [ONE], 10, 650.0) == pytest.approx(1.3)


def test_pass_scale_needs_a_calibration_run_with_passes() -> None:
    with pytest.raises(ValueError, match="answered"):
        serving_pass_scale(encoder_spec(50.0), "embedder", [ONE], 0, 650.0)
    with pytest.raises(ValueError, match="pass time"):
        serving_pass_scale(encoder_spec(50.0), "embedder", [ONE], 10, 0.0)


def test_a_scaled_pass_holds_the_replica() -> None:
    """Serving's extra pass time is occupancy: capacity falls by the scale, and an open loop
    queues as at the higher utilisation, where the same time as fixed latency would only
    shift every request by a constant."""
    plain, scaled = encoder_spec(50.0), encoder_spec(50.0)
    scaled.pools["embedder"].pass_scale = 1.5
    closed = {"clients": 8, "requests": [ONE], "duration_s": 60, "warmup_s": 10, "drain": False}
    assert plain.build().run(**closed).items_per_s == pytest.approx(20.0, rel=0.02)
    assert scaled.build().run(**closed).items_per_s == pytest.approx(20.0 / 1.5, rel=0.02)

    arrivals = [(t, ONE) for t in poisson(10.0, 600.0, random.Random(1))]
    # M/D/1: mean wait rho / (2 mu (1 - rho)); service 50 ms (rho 0.5) against 75 (rho 0.75).
    mean_wait = {}
    for name, spec in (("plain", plain), ("scaled", scaled)):
        twin = spec.build()
        twin.run(arrivals=arrivals, warmup_s=0)
        service = 50.0 * spec.pools["embedder"].pass_scale
        lat = [1000 * (r.ended - r.sent) for r in twin.records if r.ended is not None]
        mean_wait[name] = sum(lat) / len(lat) - service
    assert mean_wait["plain"] == pytest.approx(0.5 * 50 / (2 * 0.5), rel=0.15)
    assert mean_wait["scaled"] == pytest.approx(0.75 * 75 / (2 * 0.25), rel=0.15)
