"""The placement twin's engine: vLLM's prefix cache in KV blocks, and its step scheduler.

Hand-made cases whose answers follow from the rules: a block is cached once filled, a prompt
hits its longest run of leading cached blocks (never its last token), free blocks are
overwritten least recently used first and a running sequence's never, and a step serves the
running sequences before the waiting ones, in arrival order, within its token budget.
"""

from __future__ import annotations

from carpool_twin.prefix_engine import Engine, EngineSpec, KVCache, Step, chained_keys
from router.placement import CAPACITY_TOKENS, RUNNING_SEQS, WAITING_SEQS

# 4 tokens a block, 1 character a token: a block is 4 characters.
SPEC = EngineSpec(
    block_tokens=4, num_blocks=64, max_num_seqs=8, max_batched_tokens=64, chars_per_token=1.0
)


def flat_cost(step: Step) -> float:
    return 10.0


def run_to_end(engine: Engine) -> list[object]:
    """Steps until nothing is left; the tags in the order their sequences ended."""
    ended: list[object] = []
    for _ in range(10_000):
        step = engine.plan()
        if step is None:
            return ended
        ended.extend(engine.finish(step).done)
    raise AssertionError("the engine never ran dry")


def test_keys_chain_the_blocks_before_them() -> None:
    a = chained_keys("aaaabbbbcc", 4)
    assert len(a) == 2  # the partial "cc" has no key
    assert chained_keys("aaaabbbb", 4) == a
    # The same second block after another first block is another key: a prefix, not a set.
    assert chained_keys("xxxxbbbb", 4)[1] != a[1]


def test_a_hit_is_the_leading_run_of_cached_blocks() -> None:
    cache = KVCache(8)
    keys = chained_keys("aaaabbbbcccc", 4)
    assert cache.allocate(3)
    for key in keys[:2]:
        assert cache.seal(key)
    assert cache.match(keys) == 2
    other = chained_keys("zzzzbbbbcccc", 4)
    assert cache.match(other) == 0


def test_free_blocks_are_evicted_least_recently_used_and_held_ones_never() -> None:
    cache = KVCache(4)
    old = chained_keys("aaaabbbb", 4)
    new = chained_keys("ccccdddd", 4)
    for keys in (old, new):
        assert cache.allocate(2)
        for key in keys:
            cache.seal(key)
        cache.release(keys, 0)  # both sequences ended: 4 free cached blocks, old first
    assert cache.match(old) == 2 and cache.match(new) == 2
    assert cache.allocate(2)  # needs 2 of the 4: the oldest sequence's go
    assert cache.match(old) == 0
    assert cache.match(new) == 2
    cache.acquire(new)  # a running sequence holds them now
    assert not cache.allocate(1)  # nothing left that may be overwritten
    assert cache.match(new) == 2


def test_a_finished_sequence_frees_its_tail_before_its_head() -> None:
    cache = KVCache(3)
    keys = chained_keys("aaaabbbbcccc", 4)
    assert cache.allocate(3)
    for key in keys:
        cache.seal(key)
    cache.release(keys, 0)
    assert cache.allocate(1)  # one block is overwritten: the last one, not the shared head
    assert cache.match(keys) == 2


def test_a_conversation_on_one_replica_hits_its_history() -> None:
    engine = Engine("r0", SPEC, flat_cost)
    first = "system: be brief. user: hello there, how are you?"
    engine.add("turn1", first, 3, 0.0)
    run_to_end(engine)
    assert engine.cached_tokens == 0
    second = first + " assistant: fine. user: and the weather?"
    seq = engine.add("turn2", second, 3, 1.0)
    run_to_end(engine)
    # Every whole block of the first prompt (50 characters: 12 blocks of 4) is found.
    assert seq.cached_tokens == (len(first) // 4) * 4 == 48
    assert engine.prompt_tokens == len(first) + len(second)


def test_a_prompt_never_hits_its_last_token() -> None:
    engine = Engine("r0", SPEC, flat_cost)
    engine.add("a", "abcdefgh", 2, 0.0)  # exactly two blocks
    run_to_end(engine)
    seq = engine.add("b", "abcdefgh", 2, 1.0)
    run_to_end(engine)
    assert seq.cached_tokens == 4  # the last block is computed again: it samples the token


def test_another_conversation_misses_and_a_small_cache_forgets() -> None:
    spec = EngineSpec(4, num_blocks=6, max_num_seqs=8, max_batched_tokens=64, chars_per_token=1)
    engine = Engine("r0", spec, flat_cost)
    engine.add("a", "a" * 16, 1, 0.0)
    run_to_end(engine)
    engine.add("b", "b" * 16, 1, 1.0)  # 4 blocks: 2 of a's must go
    run_to_end(engine)
    again = engine.add("a2", "a" * 16 + "more", 1, 2.0)
    run_to_end(engine)
    assert again.cached_tokens < 12  # part of a's prefix was overwritten by b
    assert engine.cache.evicted > 0


def test_a_step_decodes_first_then_prefills_in_arrival_order_within_the_budget() -> None:
    spec = EngineSpec(4, num_blocks=64, max_num_seqs=8, max_batched_tokens=10, chars_per_token=1)
    engine = Engine("r0", spec, flat_cost)
    engine.add("short", "abc", 5, 0.0)
    step = engine.plan()
    assert step is not None and [n for _, n in step.chunks] == [3]
    engine.finish(step)  # its first token: it decodes from now on
    engine.add("long", "x" * 20, 5, 1.0)
    engine.add("late", "y" * 4, 5, 2.0)
    step = engine.plan()
    assert step is not None
    # The decode first (1 token), then "long" cut to the 9 tokens the budget leaves; "late"
    # waits behind it (first come, first served).
    assert [(s.tag, n) for s, n in step.chunks] == [("short", 1), ("long", 9)]
    assert step.decode_batch == 1 and step.prefill_tokens == 9


def test_max_num_seqs_bounds_the_running_sequences() -> None:
    spec = EngineSpec(4, num_blocks=64, max_num_seqs=2, max_batched_tokens=64, chars_per_token=1)
    engine = Engine("r0", spec, flat_cost)
    for i in range(3):
        engine.add(i, f"prompt {i}", 4, 0.0)
    step = engine.plan()
    assert step is not None and len(step.chunks) == 2
    assert len(engine.waiting) == 1


def test_kv_exhaustion_preempts_and_every_request_still_ends() -> None:
    # 8 blocks of 4 tokens; four sequences of 8 prompt and 12 output tokens need 5 each.
    spec = EngineSpec(4, num_blocks=8, max_num_seqs=8, max_batched_tokens=64, chars_per_token=1)
    engine = Engine("r0", spec, flat_cost)
    for i in range(4):
        engine.add(i, f"seq{i}----", 12, 0.0)
    ended = run_to_end(engine)
    assert sorted(ended) == [0, 1, 2, 3]  # type: ignore[type-var]
    assert engine.preempted > 0
    assert engine.cache.anonymous == 0 and not engine.cache.held  # everything given back


def test_the_report_carries_what_the_router_reads() -> None:
    engine = Engine("r0", SPEC, flat_cost)
    engine.add("a", "hello", 3, 0.0)
    engine.add("b", "world", 3, 0.0)
    report = engine.report(1.0)
    assert report[WAITING_SEQS] == 2 and report[RUNNING_SEQS] == 0
    assert report[CAPACITY_TOKENS] == SPEC.num_blocks * SPEC.block_tokens
    step = engine.plan()
    assert step is not None
    engine.finish(step)
    report = engine.report(2.0)
    assert report[WAITING_SEQS] == 0 and report[RUNNING_SEQS] == 2
