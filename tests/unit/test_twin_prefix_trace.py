"""The placement twin's Mooncake replay (``benchmarks.prefix_replay`` replays the same
requests, built by ``carpool_twin.mooncake``), and its check command, run end to end on a tiny
made-up result file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carpool_twin import mooncake as twin_trace
from carpool_twin.prefix import main
from carpool_twin.prefix_check import rounds_of

needs_trace = pytest.mark.skipif(
    not twin_trace.TRACE.exists(), reason=f"no Mooncake trace at {twin_trace.TRACE}"
)


def rows() -> list[dict]:
    # Two conversations (second block 10 and 20), one single-block request.
    return [
        {"timestamp": 0, "output_length": 80, "hash_ids": [0, 10, 11]},
        {"timestamp": 1000, "output_length": 80, "hash_ids": [0, 20]},
        {"timestamp": 2000, "output_length": 80, "hash_ids": [0]},
        {"timestamp": 4000, "output_length": 80, "hash_ids": [0, 10, 11, 12]},
    ]


def test_copies_replay_more_conversations_with_their_own_text() -> None:
    one, _ = twin_trace.mooncake(1.0, 1.0, rows=rows())
    two, facts = twin_trace.mooncake(1.0, 1.0, rows=rows(), copies=2)
    assert len(two) == 2 * len(one)
    assert facts["conversations"] == 2 * len({r.conversation for r in one})
    system = twin_trace.block_text(0, 8)
    assert all(r.prompt.startswith(system) for r in two)  # the shared block stays shared
    # Every other block has its own text in each copy: no two longer prompts are equal.
    longer = [r.prompt for r in two if r.blocks > 1]
    assert len(set(longer)) == len(longer) == 6
    # A copied conversation keeps its turns' order and gap.
    for conversation in {r.conversation for r in two if r.conversation >= 0}:
        times = [r.at for r in two if r.conversation == conversation]
        assert times == sorted(times) and len(times) in (1, 2)


def test_turn_gap_is_the_median_between_a_conversations_turns() -> None:
    requests, _ = twin_trace.mooncake(1.0, 4 / 4, rows=rows())  # 4 requests over 4 s: scale 1
    assert twin_trace.turn_gap_s(requests) == pytest.approx(4.0)


def test_rounds_of_reads_one_rate_and_a_sweep() -> None:
    facts = {"rate": 0.8}
    one = {"workload": facts, "systems": {"default": {"a": 1}, "carpool": {"a": 2}}}
    assert [(n, f["rate"]) for n, _, f in rounds_of(one)] == [("default", 0.8), ("carpool", 0.8)]
    sweep = {
        "workload": [{"rate": 0.6}, {"rate": 1.2}],
        "systems": {"default@0.6": {}, "default@1.2": {}, "carpool@1.2": {}},
    }
    got = [(n, f["rate"]) for n, _, f in rounds_of(sweep)]
    assert got == [("default", 0.6), ("default", 1.2), ("carpool", 1.2)]


@needs_trace
def test_the_check_command_prints_errors_for_a_result_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = {
        "kept_conversations_fraction": 0.002,
        "kept_slice_offset": 0.0,
        "block": "512 tokens -> 8 words",
        "max_blocks": 64,
        "output_divisor": 8.0,
        "rate": 0.2,
        "replicas": 2,
    }
    requests, _ = twin_trace.mooncake(0.002, 0.2)
    measured = {
        "requests": len(requests),
        "ttft_ms": {"p50": 400.0, "p90": 900.0},
        "tpot_ms_mean": 150.0,
        "replica_prefix_hit_rate": {"a": 0.2, "b": 0.3},
    }
    result = {"workload": workload, "systems": {"default": measured, "carpool": measured}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "check.json"
    args = ["--check", str(path), "--seeds", "1", "--prefill-ratio", "1", "--out", str(out)]
    assert main(args) == 0
    assert "median relative error" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [r["system"] for r in doc["runs"]] == ["default", "carpool"]
    default = doc["runs"][0]
    # The run's speed is fitted on default's TPOT: the twin lands near it.
    assert default["tpot_ms_mean"]["twin"] == pytest.approx(150.0, rel=0.25)
    assert default["hit_rate_mean"]["measured"] == pytest.approx(0.25)


@needs_trace
def test_the_floor_is_below_the_run_it_is_set_against(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = {
        "kept_conversations_fraction": 0.004,
        "kept_slice_offset": 0.0,
        "block": "512 tokens -> 8 words",
        "max_blocks": 64,
        "output_divisor": 8.0,
        "rate": 2.0,
        "replicas": 2,
    }
    requests, _ = twin_trace.mooncake(0.004, 2.0)
    measured = {
        "requests": len(requests),
        "ttft_ms": {"mean": 3000.0, "p50": 2000.0, "p90": 6000.0, "p99": 9000.0},
        "tpot_ms_mean": 150.0,
        "replica_prefix_hit_rate": {"a": 0.2, "b": 0.3},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"workload": workload, "systems": {"default": measured}}))
    out = tmp_path / "floor.json"
    args = ["--floor", str(path), "--seeds", "1", "--prefill-ratio", "1", "--out", str(out)]
    assert main(args) == 0
    assert "floor / default" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["runs"]
    # Nothing waits and every turn meets its history: below leastconn at the run's arrivals
    # (2 requests/s of long prompts on 2 replicas queue), and above nothing.
    for figure in ("mean", "p90"):
        ttft = row[f"ttft_{figure}_ms"]
        assert 0 < ttft["floor"] < ttft["twin_default"]
        assert ttft["floor_vs_measured_default"] == pytest.approx(
            ttft["floor"] / measured["ttft_ms"][figure]
        )
    assert row["floor_hit_rate_mean"] > 0
