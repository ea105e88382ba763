"""The engine-arguments benchmark compares what it says: vLLM's server defaults against the
arguments carpool's own code builds, with one difference undone per variant."""

from __future__ import annotations

from benchmarks.vllm_engine_args import VARIANTS, variant_args


def test_server_variant_asks_for_nothing_carpool_adds() -> None:
    engine, sampling = variant_args("server", 128)
    assert engine["distributed_executor_backend"] == "uni"
    assert "scheduling_policy" not in engine and "max_num_seqs" not in engine
    assert "logprobs" not in sampling
    assert sampling["max_tokens"] == 128 and sampling["ignore_eos"] is True


def test_carpool_variants_come_from_carpools_builders_with_one_change_each() -> None:
    engine, sampling = variant_args("carpool", 128)
    assert engine["scheduling_policy"] == "priority"
    assert engine["logprobs_mode"] == "processed_logprobs"
    assert engine["max_num_seqs"] == 64
    assert sampling["logprobs"] is None and sampling["temperature"] == 0.0  # a plain stream
    lp_engine, lp = variant_args("carpool-logprobs", 128)
    assert lp["logprobs"] == 0 and lp_engine == engine  # the sampled token's, as judged
    assert {k: v for k, v in lp.items() if k != "logprobs"} == {
        k: v for k, v in sampling.items() if k != "logprobs"
    }
    fcfs_engine, fcfs = variant_args("carpool-fcfs", 128)
    assert fcfs_engine["scheduling_policy"] == "fcfs" and fcfs == sampling
    assert {k: v for k, v in fcfs_engine.items() if k != "scheduling_policy"} == {
        k: v for k, v in engine.items() if k != "scheduling_policy"
    }
    assert set(VARIANTS) == {"server", "carpool", "carpool-logprobs", "carpool-fcfs"}
