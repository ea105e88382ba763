"""The placement twin's policies: carpool's router (the real class), load-only and affinity.

A small synthetic multi-turn workload (users whose every turn repeats their history) on four
replicas with a flat step cost: carpool's router must keep more of each history cached than
HAProxy's leastconn, which is blind to prompts; Ray's prefix-affinity rule alone must send
every request to one replica when every prompt starts with one shared block that is at least
10% of it.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from carpool_twin.mooncake import TraceRequest
from carpool_twin.prefix_engine import Engine, EngineSpec, Step
from carpool_twin.prefix_policies import (
    CarpoolPlacement,
    LeastConn,
    PrefixAffinity,
    make_policy,
    placement_settings,
)
from carpool_twin.prefix_sim import PrefixCluster, SimClock, replay
from router.placement import REPORTED_AT, PlacementSettings

SPEC = EngineSpec(
    block_tokens=16, num_blocks=4096, max_num_seqs=16, max_batched_tokens=512, chars_per_token=4
)
SYSTEM = "You are a helpful assistant who answers briefly and well. " * 2  # 116 characters


def cost(step: Step) -> float:
    """A prompt token costs 1 ms, a step 20 ms: prefill dominates, as on CPU."""
    return 20.0 + step.prefill_tokens * 1.0


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(n))


def multi_turn(users: int = 12, turns: int = 4, gap_s: float = 4.0) -> list[TraceRequest]:
    """Each user's turn k sends the system block, the earlier turns and a new question;
    users start at random times, turns follow ``gap_s`` apart."""
    rng = random.Random(7)
    out = []
    for u in range(users):
        history = SYSTEM + words(rng, 120)  # a long first prompt: a document
        start = rng.uniform(0, 20)
        for k in range(turns):
            history += f"\nuser {u} turn {k}: " + words(rng, 10)
            out.append(TraceRequest(start + k * gap_s, history, 8, u, 0))
            history += "\nassistant: " + words(rng, 10)
    return sorted(out, key=lambda r: r.at)


def test_carpool_reuses_more_than_leastconn_on_multi_turn_traffic() -> None:
    requests = multi_turn()
    carpool = replay(requests, "carpool", 4, SPEC, cost)
    leastconn = replay(requests, "leastconn", 4, SPEC, cost)
    assert carpool.answered == leastconn.answered == len(requests)
    # Turns after the first can hit; carpool keeps most of them on their history's replica.
    assert carpool.prefix_hit_rate > leastconn.prefix_hit_rate + 0.2
    assert carpool.ttft_ms["p50"] < leastconn.ttft_ms["p50"]


def test_affinity_alone_hot_spots_when_every_prompt_shares_a_first_block() -> None:
    rng = random.Random(3)
    # Every prompt: the shared block (116 characters) and 500 of its own, so the shared
    # block alone is 19% of it, past Ray's 10% threshold.
    requests = [TraceRequest(i * 0.5, SYSTEM + words(rng, 83), 8, i, 0) for i in range(40)]
    affinity = replay(requests, "affinity", 4, SPEC, cost)
    spread = replay(requests, "leastconn", 4, SPEC, cost)
    assert max(affinity.placed.values()) == len(requests)
    assert max(spread.placed.values()) < len(requests) / 2


def test_affinity_balances_new_prompts_by_the_smallest_tenant() -> None:
    rng = random.Random(4)
    # No shared start: every prompt matches under 10%, so each goes to the replica that was
    # sent the fewest characters.
    requests = [TraceRequest(i * 0.5, words(rng, 100), 8, i, 0) for i in range(40)]
    result = replay(requests, "affinity", 4, SPEC, cost)
    assert max(result.placed.values()) - min(result.placed.values()) <= 2


def test_affinity_as_haproxys_pick_only_path_asks_it_sends_all_to_the_first() -> None:
    rng = random.Random(5)
    requests = [TraceRequest(i * 0.5, words(rng, 100), 8, i, 0) for i in range(20)]
    result = replay(requests, "affinity-pick-only", 4, SPEC, cost)
    assert result.placed == {"r0": 20, "r1": 0, "r2": 0, "r3": 0}


def test_leastconn_takes_the_fewest_requests_and_rotates_among_equals() -> None:
    engines = [Engine(f"r{i}", SPEC, cost) for i in range(3)]
    policy = LeastConn()
    picks = [policy.choose("x", 1, engines).name for _ in range(3)]
    assert picks == ["r0", "r1", "r2"]  # all idle: round robin
    engines[0].add("busy", "hello", 4, 0.0)
    assert policy.choose("x", 1, engines).name != "r0"


def test_carpool_reads_each_replicas_report_at_the_configured_period() -> None:
    clock = SimClock()
    policy = CarpoolPlacement(PlacementSettings(), clock, period_s=0.5)
    polls: dict[str, list[float]] = {"r0": [], "r1": []}
    read = policy.poll

    def poll(replica: str, report: dict[str, Any]) -> None:
        polls[replica].append(report[REPORTED_AT])
        read(replica, report)

    policy.poll = poll  # type: ignore[method-assign]
    engines = [Engine(f"r{i}", SPEC, cost) for i in range(2)]
    requests = [TraceRequest(0.1 * i, SYSTEM + f" question {i}", 50, i, 0) for i in range(10)]
    PrefixCluster(engines, policy, clock=clock).run(requests)
    # Every 0.5 s from each replica's own phase (Serve polls each on its own timer), and the
    # real router class saw the reports and made every choice.
    assert polls["r0"][:3] == pytest.approx([0.0, 0.5, 1.0])
    assert polls["r1"][:3] == pytest.approx([0.25, 0.75, 1.25])
    # The last choice (at 0.9 s) read the reports of 0.5 s (r0) and 0.75 s (r1).
    assert policy.policy.replicas["r0"].reported_at == pytest.approx(0.5)
    assert policy.policy.replicas["r1"].reported_at == pytest.approx(0.75)
    assert policy.policy.placed == len(requests)


def test_settings_come_from_a_serve_configs_placement_args() -> None:
    settings, period = placement_settings(
        {"policy": "cost", "block_chars": 128, "prefill_weight": 0.5, "stats_period_s": 1.0}
    )
    assert settings.block_chars == 128 and settings.prefill_weight == 0.5
    assert period == 1.0
    with pytest.raises(ValueError, match="unknown placement policy 'nope'"):
        make_policy("nope", SimClock())


def test_prefix_affinity_counts_the_characters_each_replica_was_sent() -> None:
    policy = PrefixAffinity()
    engines = [Engine(f"r{i}", SPEC, cost) for i in range(2)]
    first = policy.choose("abcdefghij", 1, engines)
    second = policy.choose("zzzzzzzzzz", 1, engines)  # no match: the emptier replica
    assert first.name != second.name
    # "abcdefgh.." shares 8 of 12 characters with the first prompt: its replica
    assert policy.choose("abcdefghXYZW", 1, engines).name == first.name
    assert policy.tenants[first.name].chars == 10 + 4
