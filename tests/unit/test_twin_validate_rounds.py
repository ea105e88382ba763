"""The validation report over several rounds, and the twin's costs under load fitted on
calibration runs: each figure's median over the rounds; an embedder pass's cost per padded
token from the 8-client run; a generator's three serving numbers (latency to the engine,
overhead per step and per sequence) recovered from its 1- and 8-client runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.generation_compare import PROMPTS, workload
from benchmarks.twin_common import GEN_CALIB_LOADED_CLIENTS, SEED, embed_requests
from benchmarks.twin_report import (
    _gen_closed,
    combine,
    embed_spec,
    fit_generation,
    gen_spec,
    loaded_pass_scale,
)
from benchmarks.workloads import embed_workload
from carpool_twin.profile import load_profile
from carpool_twin.replicas import GeneratorReplica
from carpool_twin.sim import Overheads
from carpool_twin.topology import TwinSpec

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "profiles" / "cpu-2core.json"


def row(config: str, figure: str, measured: float, twin: float) -> dict:
    return {"config": config, "figure": figure, "measured": measured, "twin": twin, "error": 0.0}


def test_a_figure_is_the_median_of_its_rounds_and_its_error_is_between_the_medians() -> None:
    rounds = [
        [row("default", "items/s", 40.0, 44.0), row("default", "p99 ms", 600.0, 500.0)],
        [row("default", "items/s", 50.0, 46.0), row("default", "p99 ms", 900.0, 520.0)],
        [row("default", "items/s", 45.0, 40.0), row("default", "p99 ms", 700.0, 700.0)],
    ]
    items, p99 = combine(rounds)
    assert (items["measured"], items["twin"]) == (45.0, 44.0)
    assert items["error"] == pytest.approx((44.0 - 45.0) / 45.0, abs=1e-4)
    assert items["measured_rounds"] == [40.0, 50.0, 45.0]
    assert items["spread"] == pytest.approx(10.0 / 45.0, abs=1e-4)
    # Not the median of the rounds' errors (-0.17, -0.42, 0.0 -> -0.17): the medians' error.
    assert p99["error"] == pytest.approx((520.0 - 700.0) / 700.0, abs=1e-4)
    # One round: the figure as it is, no spread.
    (single,) = combine([[row("default", "items/s", 40.0, 44.0)]])
    assert single["error"] == pytest.approx(0.1) and "spread" not in single


def test_the_loaded_scale_is_the_replicas_cost_per_padded_token_over_the_twins() -> None:
    profile = load_profile(PROFILE)
    reqs = embed_requests(embed_workload(200, SEED))
    twin = embed_spec(profile, {}, Overheads()).build()
    twin.run(clients=8, requests=reqs, duration_s=10.0, warmup_s=0)
    stats = twin.pools["embedder"].replicas[0].server.executor.stats  # type: ignore[union-attr]
    per_token = stats.forward_ms / stats.padded_tokens
    # The replica ran its passes 1.3x dearer per padded token than the twin charges.
    replica = {"padded_tokens": 5000, "forward_ms": 1.3 * per_token * 5000}
    base = {"closed_8": {"span_s": 10.0, "replica": replica}}
    assert loaded_pass_scale(profile, base, reqs, Overheads(), 1.0) == pytest.approx(1.3, rel=1e-3)
    # A measurement without the 8-client run (runs 1-9): no scale.
    assert loaded_pass_scale(profile, {"closed_1": {}}, reqs, Overheads(), 1.0) is None


def calibration(
    spec: TwinSpec, calls: list[dict], clients: int, monkeypatch: pytest.MonkeyPatch
) -> dict:
    """What the harness records for a calibration run, with the twin standing in for the
    machine (its engine steps counted as the engine's stats count them)."""
    steps = []
    finish = GeneratorReplica.finish
    monkeypatch.setattr(
        GeneratorReplica,
        "finish",
        lambda self, now, work: steps.append(1) or finish(self, now, work),
    )
    prompts = [20 + i % len(PROMPTS) for i in range(len(calls))]
    r = _gen_closed(spec, prompts, calls, clients, [1] * len(PROMPTS))
    monkeypatch.setattr(GeneratorReplica, "finish", finish)
    return {"requests": len(calls), "wall_s": r.window_s, "ttft_p50_ms": r.ttft_p50_ms,
            "engine_steps": len(steps)}  # fmt: skip


def test_the_generation_fit_recovers_what_the_calibration_runs_ran_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    profile = load_profile(PROFILE)
    knobs = {"max_num_seqs": 64, "max_step_tokens": 512}
    truth = gen_spec(profile, knobs, step_ms=6.0, fixed_ms=30.0, seq_ms=2.5)
    m = {
        "knobs": knobs,
        "calibrate": calibration(truth, workload(4, 32, 32, SEED), 1, monkeypatch),
        "calibrate_8": calibration(
            truth, workload(16, 32, 32, SEED), GEN_CALIB_LOADED_CLIENTS, monkeypatch
        ),
    }
    tokens = [20 + i for i in range(len(PROMPTS))]
    fixed_ms, step_ms, seq_ms = fit_generation(profile, m, tokens, [1] * len(PROMPTS))
    assert fixed_ms == pytest.approx(30.0, abs=3.0)
    assert step_ms == pytest.approx(6.0, abs=1.5)
    assert seq_ms == pytest.approx(2.5, abs=0.4)
    # Without the loaded run, no per-sequence term: the step overhead takes what the
    # 1-client run's one sequence per step cost.
    _, step_only, none = fit_generation(profile, m, tokens, [1] * len(PROMPTS), loaded=False)
    assert none == 0.0 and step_only == pytest.approx(6.0 + 2.5, abs=1.5)


def test_the_plan_checks_sign_test_counts_every_outcome_at_least_as_good() -> None:
    from benchmarks.twin_plan_check import sign_test_p

    assert sign_test_p(5, 6) == pytest.approx(7 / 64)  # 6 of 6 (1 way) + 5 of 6 (6 ways)
    assert sign_test_p(0, 9) == 1.0
    assert sign_test_p(9, 9) == pytest.approx(1 / 512)
