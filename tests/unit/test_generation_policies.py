"""Pure pieces of generation: scheduler, stop matching, incremental decoding, sampling, KV slots."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from carpool.generation.sampling import SamplerState, SamplingParams, sample_one, sample_rows
from carpool.generation.scheduler import Scheduler, SchedulerLimits
from carpool.generation.text import IncrementalDecoder, StopMatcher


@dataclass(eq=False)
class FakeSeq:
    num_prompt_tokens: int
    num_computed: int = 0


def make_seqs(*prompt_lengths: int) -> list[FakeSeq]:
    return [FakeSeq(n) for n in prompt_lengths]


# --- scheduler ---------------------------------------------------------------------------


def test_limits_need_a_token_per_running_sequence() -> None:
    with pytest.raises(ValueError, match=r"max_step_tokens \(4\) must be at least max_num_seqs"):
        SchedulerLimits(max_num_seqs=8, max_step_tokens=4)


def test_a_generators_step_budget_is_not_the_encoders_pass_budget() -> None:
    """Two budgets, two names: max_batch_tokens (encoders, per pass) on a generator is refused
    with a message naming max_step_tokens, in user_config and in the app's args alike."""
    from carpool.generation.config import GeneratorBatching, GeneratorConfig

    assert GeneratorBatching(max_step_tokens=256).max_step_tokens == 256
    with pytest.raises(ValueError, match="rename max_batch_tokens to max_step_tokens"):
        GeneratorBatching.model_validate({"max_batch_tokens": 256})
    with pytest.raises(ValueError, match="rename max_batch_tokens to max_step_tokens"):
        GeneratorConfig.model_validate(
            {"source": {"model": "tiny"}, "batching": {"max_batch_tokens": 256}}
        )


def test_admits_in_arrival_order_up_to_max_num_seqs() -> None:
    sched: Scheduler[FakeSeq] = Scheduler(SchedulerLimits(3, 1000))
    seqs = make_seqs(5, 6, 7, 8)
    for s in seqs:
        sched.add(s)
    plan = sched.schedule([], [])
    assert plan.admitted == seqs[:3]
    assert [(s, n) for s, n in plan.prefill] == [(seqs[0], 5), (seqs[1], 6), (seqs[2], 7)]
    assert len(sched.waiting) == 1


def test_decoding_sequences_take_one_token_each_from_the_budget() -> None:
    sched: Scheduler[FakeSeq] = Scheduler(SchedulerLimits(8, 20))
    running = [FakeSeq(3, 3) for _ in range(4)]
    sched.add(FakeSeq(40))
    plan = sched.schedule(running, [])
    assert plan.decode == running
    # 16 tokens left: the 40-token prompt is prefilled in chunks.
    assert plan.prefill[0][1] == 16
    assert plan.tokens <= 20


def test_padded_prefill_stays_within_the_budget() -> None:
    sched: Scheduler[FakeSeq] = Scheduler(SchedulerLimits(8, 64))
    for s in make_seqs(30, 5, 5, 5):
        sched.add(s)
    plan = sched.schedule([], [])
    # rows x longest chunk never exceeds the budget
    assert plan.prefill_padded_tokens <= 64
    assert len(plan.prefill) == 2  # 30 + a second row padded to 30 fill 60 of 64


def test_partially_prefilled_sequences_continue_first_and_as_a_prefix() -> None:
    sched: Scheduler[FakeSeq] = Scheduler(SchedulerLimits(8, 32))
    a, b = FakeSeq(100, 32), FakeSeq(100, 0)
    sched.add(FakeSeq(4))
    plan = sched.schedule([], [a, b])
    assert plan.prefill[0] == (a, 32)
    assert [s for s, _ in plan.prefill] == [a]  # b gets nothing, so nothing after it either
    assert plan.admitted == []


def test_waiting_requests_get_the_slot_a_finished_sequence_left() -> None:
    sched: Scheduler[FakeSeq] = Scheduler(SchedulerLimits(2, 64))
    first, second, third = make_seqs(4, 4, 4)
    for s in (first, second, third):
        sched.add(s)
    plan = sched.schedule([], [])
    assert plan.admitted == [first, second]
    plan = sched.schedule([first, second], [])
    assert plan.admitted == []  # full
    plan = sched.schedule([second], [])  # first finished
    assert plan.admitted == [third]


def test_removed_waiting_request_is_never_admitted() -> None:
    sched: Scheduler[FakeSeq] = Scheduler(SchedulerLimits(4, 64))
    a, b = make_seqs(3, 3)
    sched.add(a)
    sched.add(b)
    assert sched.remove(a)
    assert not sched.remove(a)
    assert sched.schedule([], []).admitted == [b]


def test_unknown_queue_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        Scheduler(SchedulerLimits(1, 1), policy="lottery")


# --- stop sequences ----------------------------------------------------------------------


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(p) for p in pieces)


def test_stop_sequence_cuts_the_text_and_is_not_shown() -> None:
    m = StopMatcher(["END"])
    shown = feed_all(m, ["hello ", "wor", "ld E", "N", "D and more"])
    assert shown == "hello world "
    assert m.stopped_by == "END"


def test_text_that_may_start_a_stop_sequence_is_held_back_then_released() -> None:
    m = StopMatcher(["</s>"])
    assert m.feed("a <") == "a "
    assert m.feed("/") == ""
    assert m.feed("x") == "</x"
    assert m.finish() == ""
    m2 = StopMatcher(["###"])
    assert m2.feed("ab##") == "ab"
    assert m2.finish() == "##"


def test_earliest_of_several_stop_sequences_wins() -> None:
    m = StopMatcher(["world", "lo"])
    assert feed_all(m, ["hello world"]) == "hel"
    assert m.stopped_by == "lo"


def test_no_stop_sequences_passes_text_through() -> None:
    m = StopMatcher([])
    assert feed_all(m, ["a", "b"]) == "ab"
    assert m.finish() == ""


# --- incremental decoding ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from tests.factories import llama_tokenizer

    return llama_tokenizer()


def test_incremental_decoding_matches_a_full_decode(tokenizer) -> None:
    text = "Grüße aus Köln 🚗🚕 — 東京の天気は晴れ. Done!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(lambda x: tokenizer.decode(list(x), skip_special_tokens=True))
    pieces = [decoder.step(ids[: i + 1]) for i in range(len(ids))]
    pieces.append(decoder.flush(ids))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_decoding_with_prompt_context(tokenizer) -> None:
    prompt = tokenizer("Say", add_special_tokens=False)["input_ids"]
    out = tokenizer(" hello there", add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(
        lambda x: tokenizer.decode(list(x), skip_special_tokens=True), context=len(prompt)
    )
    shown = "".join(decoder.step(prompt + out[: i + 1]) for i in range(len(out)))
    assert shown + decoder.flush(prompt + out) == " hello there"


# --- sampling ----------------------------------------------------------------------------


def test_sampling_params_reject_bad_values_with_the_value() -> None:
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        SamplingParams(max_tokens=0)


def test_greedy_rows_take_the_argmax_and_seeds_repeat() -> None:
    import torch

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    states = [
        SamplerState(SamplingParams(temperature=0)),
        SamplerState(SamplingParams(temperature=1.0, seed=7)),
        SamplerState(SamplingParams(temperature=1.0, seed=7)),
    ]
    picked = sample_rows(logits, states)
    assert picked[0] == int(logits[0].argmax())
    fresh = SamplerState(SamplingParams(temperature=1.0, seed=7))
    assert sample_one(logits[1], fresh) == picked[1]
    draws = [sample_rows(logits[1:2], [SamplerState(SamplingParams(seed=s))])[0] for s in range(8)]
    assert len(set(draws)) > 1  # different seeds, different draws


def test_tiny_top_p_keeps_only_the_best_token() -> None:
    import torch

    logits = torch.randn(200, generator=torch.Generator().manual_seed(3))
    for seed in range(5):
        state = SamplerState(SamplingParams(temperature=1.5, top_p=1e-6, seed=seed))
        assert sample_one(logits, state) == int(logits.argmax())


# --- KV slots ----------------------------------------------------------------------------


def test_kv_cache_grows_keeping_contents_and_moves_rows() -> None:
    import torch

    from carpool.generation.kv import SlotKVCache

    cache = SlotKVCache(
        2, 1, 4, max_rows=8, max_len=64, block_size=16, dtype=torch.float32, device="cpu"
    )
    cache.ensure(2, 10)
    assert (cache.rows, cache.length) == (4, 16)
    cache.keys[0][1, 0, :10] = 1.0
    cache.ensure(6, 40)
    assert (cache.rows, cache.length) == (8, 48)
    assert torch.all(cache.keys[0][1, 0, :10] == 1.0)
    cache.move(1, 5, 10)
    assert torch.all(cache.keys[0][5, 0, :10] == 1.0)
    cache.swap(5, 2, 10)
    assert torch.all(cache.keys[0][2, 0, :10] == 1.0) and torch.all(cache.keys[0][5] == 0)
    with pytest.raises(ValueError, match="holds at most 8 x 64"):
        cache.ensure(9, 10)
    cache.release()
    assert cache.allocated_bytes == 0
