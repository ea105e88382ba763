"""Paired rounds of the prefix replay (``benchmarks.prefix_paired``): ratios round by round."""

from __future__ import annotations

import pytest

from benchmarks.prefix_paired import ratio_table, ratios


def summary(ttft_mean: float, tpot: float) -> dict:
    return {
        "ttft_ms": {"mean": ttft_mean, "p50": ttft_mean, "p90": 2 * ttft_mean, "p99": None},
        "tpot_ms_mean": tpot,
        "e2e_s": {"mean": ttft_mean / 100},
    }


def test_ratios_are_taken_per_round_then_the_median() -> None:
    # The box is twice as slow in round 2: pooled means would mix that into the ratio.
    rounds = [
        {"default": summary(1000, 100), "carpool": summary(500, 100)},
        {"default": summary(4000, 200), "carpool": summary(3000, 300)},
        {"default": summary(2000, 150), "carpool": summary(1200, 150)},
    ]
    got = ratios(rounds)
    assert set(got) == {"carpool"}
    ttft = got["carpool"]["ttft_mean"]
    assert ttft["rounds"] == pytest.approx([0.5, 0.75, 0.6])
    assert ttft["median"] == pytest.approx(0.6)
    assert (ttft["min"], ttft["max"]) == pytest.approx((0.5, 0.75))
    assert got["carpool"]["tpot_mean"]["median"] == pytest.approx(1.0)
    # A figure no round has is reported as missing, not as zero.
    assert got["carpool"]["ttft_p99"]["median"] is None
    table = ratio_table({"ratios_to_default": got})
    assert "| carpool | 0.60x (0.50-0.75)" in table
