"""The twin's simulator against what queueing theory says, and on serve.yaml (the CI case).

Costs here are hand-made profile entries (a constant pass, a per-token line), so every
expected figure follows from arithmetic: a closed loop of N clients on one server of
service time C does 1/C requests per second at latency N x C (Little's law), an M/D/1 queue
waits rho / (2 mu (1 - rho)) on average, and so on.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from carpool.config import BatchingConfig
from carpool_twin.profile import load_profile
from carpool_twin.replicas import EncoderReplica, GeneratorReplica, SimRequest
from carpool_twin.sim import (
    Overheads,
    PathStage,
    Pool,
    Twin,
    host_slowdown,
    percentile,
    poisson,
)
from carpool_twin.topology import TwinSpec

ROOT = Path(__file__).resolve().parents[2]


def encoder_entry(const_ms: float, per_token_ms: float = 0.0) -> dict:
    coef = {"const": const_ms, "padded_tokens": per_token_ms}
    return {"kind": "encoder", "pass": {"fits": {"line": {"coef": coef}}, "use": "line"}}


def generator_entry(prefill_ms: float, decode_ms: float) -> dict:
    return {
        "kind": "generator",
        "prefill": {"fits": {"line": {"coef": {"const": prefill_ms, "tokens": 0}}}, "use": "line"},
        "decode": {"fits": {"line": {"coef": {"const": decode_ms, "batch": 0}}}, "use": "line"},
        "kv_bytes_per_token": 1024,
    }


def encoder_twin(replicas: int, const_ms: float, **knobs: object) -> Twin:
    batching = BatchingConfig.model_validate({"max_batch_size": 1, **knobs})
    pool = Pool(
        "embedder",
        [EncoderReplica(f"e{i}", batching, encoder_entry(const_ms)) for i in range(replicas)],
    )
    return Twin({"embedder": pool})


ONE = SimRequest("embed", lengths=(16,))
# A generator whose arrivals reach the engine at once (no @serve.batch window): step costs only.
NO_COLLECT = {"max_num_seqs": 8, "batch_wait_timeout_s": 0}


def test_closed_loop_one_server_follows_littles_law() -> None:
    result = encoder_twin(1, 50.0).run(
        clients=8, requests=[ONE], duration_s=60, warmup_s=10, drain=False
    )
    assert result.items_per_s == pytest.approx(1000 / 50, rel=0.02)
    # Every client waits behind the other seven: latency = N x C.
    assert result.p50_ms == pytest.approx(8 * 50, rel=0.02)


def test_doubling_replicas_doubles_capacity() -> None:
    one = encoder_twin(1, 40.0).run(
        clients=16, requests=[ONE], duration_s=60, warmup_s=10, drain=False
    )
    two = encoder_twin(2, 40.0).run(
        clients=16, requests=[ONE], duration_s=60, warmup_s=10, drain=False
    )
    assert two.items_per_s == pytest.approx(2 * one.items_per_s, rel=0.03)
    assert two.p50_ms == pytest.approx(one.p50_ms / 2, rel=0.1)


def test_executor_merges_waiting_requests_into_one_pass() -> None:
    # A constant 100 ms pass, room for 64 items and a 10 ms collection window: all 32
    # clients ride every pass, one pass per 110 ms.
    twin = encoder_twin(1, 100.0, max_batch_size=64, batch_wait_timeout_s=0.01)
    result = twin.run(clients=32, requests=[ONE], duration_s=30, warmup_s=5, drain=False)
    assert result.items_per_s == pytest.approx(32 * 1000 / 110, rel=0.03)
    assert result.p50_ms == pytest.approx(110, rel=0.03)


def test_without_a_window_closed_clients_lock_into_alternating_passes() -> None:
    # No wait: the first client's request starts a pass alone, the other 31 ride the next,
    # and the two groups alternate: 32 items per two passes, what the executor plans.
    twin = encoder_twin(1, 100.0, max_batch_size=64)
    result = twin.run(clients=32, requests=[ONE], duration_s=30, warmup_s=5, drain=False)
    assert result.items_per_s == pytest.approx(32 * 1000 / 200, rel=0.03)


def test_padding_costs_what_the_line_says() -> None:
    # One replica, items one per pass, 1 ms per padded token: 64-token items take 64 ms.
    batching = BatchingConfig.model_validate({"max_batch_size": 1})
    pool = Pool("embedder", [EncoderReplica("e", batching, encoder_entry(0.0, 1.0))])
    result = Twin({"embedder": pool}).run(
        clients=4, requests=[SimRequest("embed", lengths=(64,))], duration_s=30, warmup_s=5
    )
    assert result.items_per_s == pytest.approx(1000 / 64, rel=0.03)


def test_open_loop_wait_matches_m_d_1() -> None:
    service_s, rate = 0.05, 14.0  # rho = 0.7
    rng = random.Random(3)
    arrivals = [(t, ONE) for t in poisson(rate, 4000, rng)]
    twin = encoder_twin(1, service_s * 1000)
    result = twin.run(arrivals=arrivals, warmup_s=50)
    rho = rate * service_s
    mean_wait = rho / (2 * (1 / service_s) * (1 - rho))  # Pollaczek-Khinchine, deterministic
    latencies = [r.ended - r.sent for r in twin.records if r.sent >= 50]
    assert sum(latencies) / len(latencies) == pytest.approx(mean_wait + service_s, rel=0.08)
    assert result.refused == 0


def test_bounded_admission_refuses_past_its_bound() -> None:
    # 20 requests at once, a bound of 5 queued items: the replica takes 5 and refuses 15.
    twin = encoder_twin(1, 10.0, admission_policy="bounded", max_queued_items=5)
    arrivals = [(1.0 + i * 1e-6, ONE) for i in range(20)]
    result = twin.run(arrivals=arrivals, warmup_s=0)
    assert result.refused == 15
    assert result.answered == 5
    statuses = sorted(r.status for r in twin.records)
    assert statuses == [200] * 5 + [503] * 15


def test_serve_queue_bound_refuses_when_replicas_are_full() -> None:
    batching = BatchingConfig.model_validate({"max_batch_size": 1})
    pool = Pool(
        "embedder",
        [EncoderReplica("e", batching, encoder_entry(10.0))],
        max_ongoing_requests=2,
        max_queued_requests=3,
    )
    twin = Twin({"embedder": pool})
    result = twin.run(arrivals=[(0.5 + i * 1e-6, ONE) for i in range(10)], warmup_s=0)
    assert (result.answered, result.refused) == (5, 5)


def test_generator_ttft_and_tpot_follow_step_costs() -> None:
    # Prefill step 30 ms, decode step 10 ms: the first token at 30 ms, then 10 ms a token.
    entry = generator_entry(30.0, 10.0)
    pool = Pool("small", [GeneratorReplica("g", NO_COLLECT, entry)])
    req = SimRequest("generate", prompt_tokens=20, max_tokens=11, model="small")
    result = Twin({"small": pool}).run(
        clients=1, requests=[req], duration_s=20, warmup_s=2, drain=False
    )
    assert result.ttft_p50_ms == pytest.approx(30.0, rel=0.01)
    assert result.tpot_ms == pytest.approx(10.0, rel=0.01)
    assert result.p50_ms == pytest.approx(30 + 10 * 10, rel=0.01)
    assert result.tokens_per_s == pytest.approx(11 / 0.130, rel=0.05)


def test_generator_slots_bound_concurrency() -> None:
    # Decode cost independent of batch: 4 slots give 4x one slot's tokens per second.
    entry = generator_entry(0.0, 10.0)
    req = SimRequest("generate", prompt_tokens=8, max_tokens=50, model="small")

    def tokens_per_s(slots: int) -> float:
        knobs = {"max_num_seqs": slots, "max_step_tokens": 512}
        pool = Pool("small", [GeneratorReplica("g", knobs, entry)])
        return (
            Twin({"small": pool})
            .run(clients=16, requests=[req], duration_s=60, drain=False)
            .tokens_per_s
        )

    assert tokens_per_s(4) == pytest.approx(4 * tokens_per_s(1), rel=0.08)


def test_router_threshold_sends_long_requests_to_large() -> None:
    entry = generator_entry(5.0, 5.0)
    pools = {
        m: Pool(m, [GeneratorReplica(m, {"max_num_seqs": 8}, entry)]) for m in ("small", "large")
    }
    router = {"policy": "threshold", "max_small_tokens": 100, "predictor_default_tokens": 48}
    twin = Twin(pools, router=router)
    code = SimRequest("generate", prompt_tokens=10, max_tokens=20, model="auto", text="write code")
    chat = SimRequest("generate", prompt_tokens=10, max_tokens=20, model="auto", text="hello")
    twin.run(arrivals=[(0.1, code), (0.2, chat)], warmup_s=0)
    assert [r.model for r in twin.records] == ["large", "small"]


def test_cascade_escalates_a_low_confidence_small_answer() -> None:
    entry = generator_entry(5.0, 5.0)
    pools = {
        m: Pool(m, [GeneratorReplica(m, {"max_num_seqs": 8}, entry)]) for m in ("small", "large")
    }
    twin = Twin(pools, router={"policy": "cascade", "min_mean_logprob": -1.0})
    sure = SimRequest("generate", prompt_tokens=10, max_tokens=20, output_tokens=5, model="auto")
    unsure = SimRequest(
        "generate",
        prompt_tokens=10,
        max_tokens=20,
        output_tokens=5,
        model="auto",
        small_mean_logprob=-3,
    )
    result = twin.run(arrivals=[(0.1, sure), (0.2, unsure)], warmup_s=0)
    assert [r.escalated for r in twin.records] == [False, True]
    assert result.by_model == {"small": 1, "large": 1}


def test_a_path_stage_caps_request_rate_at_its_cores_over_its_cpu_ms() -> None:
    # Two cores, 20 CPU-ms per embed request: 2 x 1000 / 20 = 100 requests/s.
    pools = encoder_twin(4, 1.0).pools
    twin = Twin(pools, Overheads(path=(PathStage("ingress", 2, {"embed": 20.0}),)))
    result = twin.run(clients=64, requests=[ONE], duration_s=20, warmup_s=2, drain=False)
    assert result.items_per_s == pytest.approx(100.0, rel=0.03)


def test_kinds_a_path_stage_does_not_name_skip_it() -> None:
    pools = encoder_twin(4, 1.0).pools
    twin = Twin(pools, Overheads(path=(PathStage("rank ingress", 1, {"rank": 1000.0}),)))
    result = twin.run(clients=64, requests=[ONE], duration_s=5, warmup_s=1, drain=False)
    assert result.items_per_s > 1000  # four 1 ms replicas, nothing in front


def test_closed_loop_with_a_request_budget_drains_like_the_harness() -> None:
    # 10 requests of 50 ms, one pass each on one replica: all answered, over 500 ms.
    twin = encoder_twin(1, 50.0)
    result = twin.run(clients=2, requests=[ONE], max_requests=10, warmup_s=0)
    assert result.answered == 10
    assert result.window_s == pytest.approx(0.5, rel=0.01)
    assert result.items_per_s == pytest.approx(20.0, rel=0.01)


def test_percentile_interpolates() -> None:
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([], 99) != percentile([], 99)  # NaN


def test_serve_yaml_on_the_cpu_profile_runs_in_seconds() -> None:
    """The CI case: serve.yaml's embedder and generators on the shipped CPU profile."""
    profile = load_profile(ROOT / "profiles" / "cpu-2core.json")
    spec = TwinSpec.from_serve_config(ROOT / "serve.yaml", profile)
    assert spec.replicas() == {"embedder": 2, "ranker": 1, "small": 1, "large": 1}
    rng = random.Random(0)
    embeds = [
        SimRequest("embed", lengths=tuple(rng.randint(4, 128) for _ in range(rng.randint(1, 8))))
        for _ in range(200)
    ]
    result = spec.build().run(clients=32, requests=embeds, duration_s=30, warmup_s=5, drain=False)
    # The profile's line, 0.37 ms per padded token on one thread, bounds what the two
    # replicas do: at least one token per item, so under 2 x 2,800 items/s, and far from
    # nothing.
    per_token = profile["models"][0]["pass"]["fits"]["line"]["coef"]["padded_tokens"]
    mean_len = sum(sum(r.lengths) for r in embeds) / sum(r.items for r in embeds)
    assert 0.5 / (per_token * mean_len / 1000) < result.items_per_s < 2 / (per_token / 1000)
    gens = [
        SimRequest("generate", prompt_tokens=32, max_tokens=32, output_tokens=16, model="auto")
    ] * 4
    gen = spec.build().run(clients=4, requests=gens, duration_s=60, warmup_s=5)
    assert gen.answered > 0 and gen.ttft_p50_ms < gen.p50_ms


def test_overlay_changes_replicas_and_knobs() -> None:
    profile = load_profile(ROOT / "profiles" / "cpu-2core.json")
    overlay = {"embedder": {"num_replicas": 2, "user_config": {"max_batch_tokens": 2048}}}
    spec = TwinSpec.from_serve_config(ROOT / "serve.yaml", profile, overlay)
    assert spec.pools["embedder"].replicas == 2
    assert spec.pools["embedder"].knobs["max_batch_tokens"] == 2048
    with pytest.raises(ValueError, match="does not serve"):
        TwinSpec.from_serve_config(ROOT / "serve.yaml", profile, {"retriever": {}})


def test_generator_step_overhead_adds_to_every_step() -> None:
    # 30 ms prefill + 5 ms, then 10 ms decodes + 5 ms each: first token at 35 ms, 15 ms after.
    entry = generator_entry(30.0, 10.0)
    replica = GeneratorReplica("g", NO_COLLECT, entry, step_overhead_ms=5.0)
    req = SimRequest("generate", prompt_tokens=20, max_tokens=11, model="small")
    result = Twin({"small": Pool("small", [replica])}).run(
        clients=1, requests=[req], duration_s=20, warmup_s=2, drain=False
    )
    assert result.ttft_p50_ms == pytest.approx(35.0, rel=0.01)
    assert result.tpot_ms == pytest.approx(15.0, rel=0.01)


def test_host_slowdown_is_processor_sharing_past_the_cores() -> None:
    assert host_slowdown(2.0, 0.5) == 1.0  # pass + serving fit in two cores
    assert host_slowdown(2.0, 1.0) == 1.0
    assert host_slowdown(2.0, 2.0) == pytest.approx(1.5)  # 3 cores wanted of 2
    assert host_slowdown(2.0, 1.0, pass_cores=2) == pytest.approx(1.5)


def test_serving_cpu_on_a_shared_host_slows_passes_under_load() -> None:
    # 100 ms passes, one item each: 10 requests/s. Each request also costs 150 ms of host CPU
    # elsewhere: at 10/s that is 1.5 cores, so pass + serving want 2.5 of 2 cores.
    def twin(cpu_ms: float) -> Twin:
        t = encoder_twin(1, 100.0)
        t.overheads = Overheads(host_cores=2.0, cpu_ms_per_request=cpu_ms)
        return t

    free = twin(0.0).run(clients=8, requests=[ONE], duration_s=60, warmup_s=10, drain=False)
    shared = twin(150.0).run(clients=8, requests=[ONE], duration_s=60, warmup_s=10, drain=False)
    assert free.items_per_s == pytest.approx(10.0, rel=0.02)
    # Fixed point: x = 1 / (0.1 * (1 + 0.15 x) / 2), 0.15 x^2 + x - 20 = 0, x = 8.69/s.
    assert shared.items_per_s == pytest.approx(8.69, rel=0.05)
    # 50 ms a request: 0.5 cores at 10/s, which fit beside the pass: no slowdown.
    light = twin(50.0).run(clients=8, requests=[ONE], duration_s=60, warmup_s=10, drain=False)
    assert light.items_per_s == pytest.approx(10.0, rel=0.02)


def test_a_step_is_priced_padded_as_the_slot_runner_computes_it() -> None:
    # 1 ms per prefill token, 1 ms per decode KV token: prompts of 4 and 16 tokens are one
    # chunk left-padded to 16 (32 tokens); two decodes at contexts 5 and 17 attend 2 x 18.
    entry = {
        "kind": "generator",
        "prefill": {"fits": {"line": {"coef": {"const": 0.0, "tokens": 1.0}}}, "use": "line"},
        "decode": {
            "fits": {"context": {"coef": {"const": 0.0, "batch": 0.0, "kv_tokens": 1.0}}},
            "use": "context",
        },
        "kv_bytes_per_token": 1024,
    }
    replica = GeneratorReplica("g", NO_COLLECT, entry)
    short = SimRequest("generate", prompt_tokens=4, max_tokens=4, model="small")
    long = SimRequest("generate", prompt_tokens=16, max_tokens=4, model="small")
    replica.offer(0.0, short, "a")
    replica.offer(0.0, long, "b")
    work = replica.start(0.0)
    assert work is not None and work.ends == pytest.approx(0.032)
    replica.finish(work.ends, work)
    for seq in replica.decoding:
        seq.num_computed += 1  # contexts 5 and 17
    assert replica.step_ms(replica.decoding, []) == pytest.approx(2 * 18)


def test_first_text_can_wait_for_the_second_token() -> None:
    # Prefill 30 ms, decode 10 ms: a first token whose text is held shows at 40 ms.
    entry = generator_entry(30.0, 10.0)
    pool = Pool("small", [GeneratorReplica("g", NO_COLLECT, entry)])
    req = SimRequest("generate", prompt_tokens=20, max_tokens=11, model="small", first_visible=2)
    result = Twin({"small": pool}).run(
        clients=1, requests=[req], duration_s=20, warmup_s=2, drain=False
    )
    assert result.ttft_p50_ms == pytest.approx(40.0, rel=0.01)


def decode_points_entry() -> dict:
    """Decode measured at batches 1, 4 and 16 (context 128) and batch 1 at 512; a fitted
    plane that misses the small batches, as least squares over big ones does."""
    points = [
        {"batch": 1, "context": 128, "kv_tokens": 129, "ms": 50.0},
        {"batch": 4, "context": 128, "kv_tokens": 516, "ms": 40.0},
        {"batch": 16, "context": 128, "kv_tokens": 2064, "ms": 100.0},
        {"batch": 1, "context": 512, "kv_tokens": 513, "ms": 51.0},
    ]
    fit = {"const": 30.0, "batch": 4.0, "kv_tokens": 0.0}
    return {
        "kind": "generator",
        "prefill": {"fits": {"line": {"coef": {"const": 10.0, "tokens": 0}}}, "use": "line"},
        "decode": {"points": points, "fits": {"context": {"coef": fit}}, "use": "context"},
        "kv_bytes_per_token": 1024,
    }


def test_decode_steps_are_priced_through_the_measured_points() -> None:
    replica = GeneratorReplica("g", NO_COLLECT, decode_points_entry())
    kv = (51.0 - 50.0) / (513 - 129)  # the points' own KV slope (batch 1 at two contexts)
    assert replica.decode.kv_ms == pytest.approx(kv)

    def step(batch: int, context: int) -> float:
        return replica.decode({"batch": batch, "kv_tokens": batch * (context + 1)})

    # On a measured point: its cost, not the fit's (30 + 4 x 4 = 46 at batch 4).
    assert step(4, 128) == pytest.approx(40.0)
    assert step(1, 128) == pytest.approx(50.0)
    # Between points: linear in batch (each point less its KV term), plus the KV term.
    between = ((40.0 - kv * 516) + (100.0 - kv * 2064)) / 2 + kv * 10 * 129
    assert step(10, 128) == pytest.approx(between)
    # The fit, when asked for (the twin's pricing before the points).
    fitted = GeneratorReplica("g", NO_COLLECT, decode_points_entry(), curve="fit")
    assert fitted.decode({"batch": 4, "kv_tokens": 516}) == pytest.approx(46.0)


def test_a_decode_section_without_points_uses_its_fit() -> None:
    replica = GeneratorReplica("g", NO_COLLECT, generator_entry(30.0, 10.0))
    assert replica.decode({"batch": 3, "kv_tokens": 300}) == pytest.approx(10.0)


def test_arrivals_together_reach_the_engine_in_one_batch() -> None:
    # Prefill 30 ms a step whatever its rows, decode 10 ms. Four clients start together:
    # with @serve.batch's 5 ms window all four prompts are one prefill step (first tokens
    # at 35 ms); without it the first arrival starts a step alone and the other three wait
    # for it (30 ms, then 30 + 10 ... their prefill rides the next step: 60 ms).
    reqs = [SimRequest("generate", prompt_tokens=20, max_tokens=3, model="small")]

    def ttfts(knobs: dict) -> list[float]:
        twin = Twin(
            {"small": Pool("small", [GeneratorReplica("g", knobs, generator_entry(30.0, 10.0))])}
        )
        twin.run(clients=4, requests=reqs, max_requests=4, duration_s=100, warmup_s=0)
        return sorted(round((r.first_token - r.sent) * 1000, 3) for r in twin.records)

    assert ttfts({"max_num_seqs": 8, "batch_wait_timeout_s": 0.005}) == pytest.approx(
        [35.0] * 4, abs=0.1
    )
    alone = ttfts(NO_COLLECT)
    assert alone[0] == pytest.approx(30.0) and alone[-1] > 50.0


def test_an_arrival_during_a_step_waits_for_its_window_to_close() -> None:
    # "a" arrives at 0 and reaches the engine when its window closes (5 ms), prefilled by
    # 35 ms. "b" arrives mid-step at 10 ms: the step after "a"'s prefill cannot take it
    # while its window is open (the engine has not been handed it), so it decodes "a" alone.
    replica = GeneratorReplica("g", {"max_num_seqs": 8, "batch_wait_timeout_s": 0.005},
                               generator_entry(30.0, 10.0))  # fmt: skip
    req = SimRequest("generate", prompt_tokens=20, max_tokens=3, model="small")
    assert replica.offer(0.0, req, "a") is None
    assert replica.start(0.0) is None  # not collected yet: the engine sees nothing
    replica.collect()
    work = replica.start(0.005)
    assert work is not None and work.ends == pytest.approx(0.035)
    assert replica.offer(0.01, req, "b") is None
    events = replica.finish(work.ends, work)
    assert events.first == ["a"]
    nxt = replica.start(work.ends)  # "b" is still in its window: a decode step of "a" only
    assert nxt is not None and [s.tag for s in nxt.payload.decode] == ["a"]
    assert not nxt.payload.prefill
