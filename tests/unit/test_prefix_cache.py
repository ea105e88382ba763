"""Prefix reuse in carpool's continuous engine (carpool/generation/prefix_cache.py): the cache
itself, and the engine on a tiny random model, whose greedy tokens with reused prefixes must
be those it computes without them."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.generation.factory import make_engine
from carpool.generation.prefix_cache import PrefixCache, block_hashes
from carpool.generation.sampling import SamplingParams
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.sequence import GenSequence, TokenizerInfo
from tests.unit.test_generation_engine import Collect, Steps, tiny  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")


def _kv(length: int, layers: int = 2) -> tuple[list[Any], list[Any]]:
    """Per-layer [1 head, length, 2] tensors whose values say their position."""
    rows = [torch.arange(length, dtype=torch.float32).view(1, length, 1).expand(1, length, 2)]
    return [r.clone() for r in rows * layers], [r.clone() + 0.5 for r in rows * layers]


def test_block_hashes_chain_so_one_hash_names_a_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # whole blocks only
    assert block_hashes([1, 2, 3, 4], 2) == a[:2]
    assert block_hashes([9, 2, 3, 4], 2)[1] != a[1]  # same second block, other first one


def test_lookup_finds_the_longest_prefix_and_leaves_a_token_to_compute() -> None:
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=4)
    tokens = list(range(12))
    cache.store(tokens, _kv)
    entry, length = cache.lookup([*tokens[:10], 99])
    assert length == 8 and entry.tokens == 12
    # The whole of a cached prompt: one token is left for its logits.
    assert cache.lookup(tokens)[1] == 8
    assert cache.lookup([*tokens, 5])[1] == 12
    assert cache.lookup([0, 1, 2, 9, 4, 5]) is None
    assert cache.stats()["prefix_cache_hits"] == 3


def test_a_longer_prefix_replaces_the_one_it_contains_and_eviction_is_lru() -> None:
    per_token = 2 * 2 * 2 * 4  # keys and values, 2 layers, 2 floats of 4 bytes
    cache = PrefixCache(max_bytes=19 * per_token, block_tokens=4)
    cache.store(list(range(8)), _kv)
    cache.store(list(range(12)), _kv)  # holds the 8-token prefix too
    assert cache.stats()["prefix_cache_entries"] == 1 and cache.bytes == 12 * per_token
    cache.store(list(range(100, 108)), _kv)  # 20 tokens > budget: the oldest goes
    assert cache.bytes == 8 * per_token
    assert cache.lookup(list(range(9))) is None
    assert cache.lookup(list(range(100, 109)))[1] == 8
    cache.store(list(range(200, 300)), _kv)  # larger than the whole budget: not kept
    assert cache.bytes == 8 * per_token


def test_reading_a_prefix_already_held_copies_nothing() -> None:
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=4)
    cache.store(list(range(12)), _kv)
    reads = []
    cache.store(list(range(9)), lambda n: reads.append(n) or _kv(n))
    assert reads == []


def _engine(tiny, prefix_bytes: int, block: int = 16):  # noqa: F811 (the fixture)
    model, tokenizer = tiny
    tok = TokenizerInfo.from_tokenizer(tokenizer, model.generation_config)
    limits = SchedulerLimits(4, 64)  # prefill in chunks, beside decoding sequences
    return make_engine(
        "continuous", model, tok, limits, 512, block, prefix_cache_bytes=prefix_bytes
    )


def _run(engine, prompts: list[list[int]], waves: list[list[int]]) -> tuple[Collect, Steps]:
    collect, steps = Collect(), Steps()
    engine.listeners.append(steps)
    done = 0
    for wave in waves:
        engine.submit(
            [
                GenSequence(
                    prompts[i],
                    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    collect.sink(i),
                    index=i,
                )
                for i in wave
            ]
        )
        done += len(wave)
        collect.wait(done)
    return collect, steps


def test_reused_prefixes_give_the_tokens_computed_without_them(tiny) -> None:  # noqa: F811
    _, tokenizer = tiny
    system = tokenizer("the carpool system prompt says " * 14)["input_ids"]
    first = system + tokenizer("hello there")["input_ids"]
    prompts = [
        first,
        system + tokenizer("a b c d e f g")["input_ids"],  # the system prompt again
        system + tokenizer("rain " * 9)["input_ids"],
        tokenizer("paris is the capital of france")["input_ids"],  # nothing shared
    ]
    waves = [[0], [1, 2, 3]]  # the second wave arrives after the first finished
    plain = _engine(tiny, 0)
    cached = _engine(tiny, 1 << 24)
    try:
        expected, _ = _run(plain, prompts, waves)
        got, steps = _run(cached, prompts, waves)
        stats = cached.stats()
    finally:
        plain.close()
        cached.close()
    for i in range(len(prompts)):
        assert got.tokens(i) == expected.tokens(i), f"prompt {i}"
    shared = len(system) // 16 * 16
    assert shared >= 64
    assert stats["prefix_cache_hits"] == 2 and stats["prefix_cache_hit_tokens"] >= 2 * shared
    # Only what was not cached was prefilled in the second wave.
    computed = sum(r.prefill_tokens for r in steps.records)
    assert computed <= sum(len(p) for p in prompts) - 2 * shared


def test_the_next_turn_reuses_the_previous_answer_too(tiny) -> None:  # noqa: F811
    _, tokenizer = tiny
    turn1 = tokenizer("rain " * 40)["input_ids"]
    cached = _engine(tiny, 1 << 24)
    plain = _engine(tiny, 0)
    try:
        first, _ = _run(cached, [turn1], [[0]])
        turn2 = turn1 + first.tokens(0) + tokenizer("and then")["input_ids"]
        got, _ = _run(cached, [turn1, turn2], [[1]])
        expected, _ = _run(plain, [turn1, turn2], [[1]])
        stats = cached.stats()
    finally:
        cached.close()
        plain.close()
    assert got.tokens(1) == expected.tokens(1)
    # Prompt and all but the last output token were cached after turn 1.
    hit = stats["prefix_cache_hit_tokens"]
    assert hit == (len(turn1) + len(first.tokens(0)) - 1) // 16 * 16 > len(turn1) // 16 * 16 - 16
