"""The validation harness's side of the pass scale: pass totals from ``/v1/stats`` snapshots,
and the scale fitted on the default configuration's 1-client calibration run."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.twin_common import SEED, embed_requests, replica_passes
from benchmarks.twin_report import embed_pass_scale, embed_spec
from benchmarks.workloads import embed_workload
from carpool_twin.calibrate import priced_pass_ms
from carpool_twin.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]


def stats(passes: int, items: int, mean_forward: float, mean_wait: float) -> dict:
    return {
        "forward_passes": passes,
        "items": items,
        "padded_tokens": 10 * items,
        "mean_forward_ms": mean_forward,
        "mean_queue_wait_ms": mean_wait,
    }


def test_pass_totals_come_from_the_means_the_replica_reports() -> None:
    before, after = stats(10, 30, 50.0, 4.0), stats(30, 90, 60.0, 5.0)
    delta = replica_passes(before, after)
    assert delta["passes"] == 20 and delta["items"] == 60 and delta["padded_tokens"] == 600
    assert delta["forward_ms"] == pytest.approx(30 * 60.0 - 10 * 50.0)
    assert delta["queue_wait_ms"] == pytest.approx(90 * 5.0 - 30 * 4.0)
    assert replica_passes({}, after) == {}  # a replica without pass stats: nothing


def test_the_scale_is_fitted_on_the_default_calibration_run() -> None:
    profile = load_profile(ROOT / "profiles" / "cpu-2core.json")
    reqs = embed_requests(embed_workload(50, SEED))
    priced = priced_pass_ms(embed_spec(profile, {}), "embedder", reqs, 12)
    base = {"closed_1": {"ok": 12, "sent": 12, "replica": {"forward_ms": 1.2 * priced}}}
    assert embed_pass_scale(profile, base, reqs) == pytest.approx(1.2)
    # No pass totals (a measurement from before the harness kept them), or a refusal in the
    # calibration run (its requests would not be the twin's): no scale.
    assert embed_pass_scale(profile, {"closed_1": {"ok": 12, "sent": 12}}, reqs) is None
    base["closed_1"]["ok"] = 11
    assert embed_pass_scale(profile, base, reqs) is None
