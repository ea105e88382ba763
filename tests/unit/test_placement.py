"""router.placement: the cheapest replica by uncached prefill, queued work and output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.placement import (
    CAPACITY_TOKENS,
    GENERATION,
    PENDING_DECODE_TOKENS,
    PENDING_PREFILL_TOKENS,
    REPORTED_AT,
    RUNNING_SEQS,
    WAITING_SEQS,
    PlacementPolicy,
    PlacementSettings,
    block_keys,
    prompt_text,
)

SYSTEM = "You are a helpful assistant. " * 20  # 580 chars: whole blocks at any size here


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(**settings: float) -> tuple[PlacementPolicy, Clock]:
    clock = Clock()
    p = PlacementPolicy(PlacementSettings(**settings), clock=clock)  # type: ignore[arg-type]
    p.sync({"a": {}, "b": {}, "c": {}})
    return p, clock


def conversation(i: int, turns: int) -> str:
    text = SYSTEM
    for t in range(turns):
        text += f"<user>conversation {i} turn {t}: " + f"question {i}-{t} " * 40
        text += "<assistant>" + f"answer {i}-{t} " * 40
    return text


def test_block_keys_chain_the_prefix() -> None:
    a = block_keys("x" * 512 + "y" * 256, 256)
    b = block_keys("x" * 512 + "z" * 256, 256)
    assert len(a) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    # The same block after a different prefix is a different key.
    assert block_keys("y" * 256 + "x" * 256, 256)[1] != a[1]
    # A partial last block is not cached by an engine, so it is not a key.
    assert len(block_keys("x" * 300, 256)) == 1


def test_prompt_text_reads_bodies_and_calls() -> None:
    assert prompt_text(SimpleNamespace(prompt="hello")) == "hello"
    assert prompt_text({"prompt": ["one", "two"]}) == "one"
    assert prompt_text(SimpleNamespace(prompts=["p"], messages=None)) == "p"
    chat = prompt_text(
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    )
    assert chat == "<system>s<user>u"
    parts = prompt_text(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "t"}]}]}
    )
    assert parts == "<user>t"
    assert prompt_text(SimpleNamespace()) == ""


def test_a_follow_up_turn_goes_where_its_history_is() -> None:
    p, _ = policy()
    first = p.choose(conversation(1, 1), ["a", "b", "c"], 64)
    assert first.matched_tokens == 0  # nothing is cached yet
    # Other conversations land on the other replicas (equal prefix, less load there).
    others = {p.choose(conversation(i, 1), ["a", "b", "c"], 64).replica for i in (2, 3)}
    assert first.replica not in others
    again = p.choose(conversation(1, 2), ["a", "b", "c"], 64)
    assert again.replica == first.replica
    assert again.matched_tokens > 0.4 * again.prompt_tokens


def test_load_outweighs_a_small_saving() -> None:
    """A replica far behind loses a request whose cached prefix saves less than its backlog."""
    p, clock = policy()
    text = conversation(1, 1)
    first = p.choose(text, ["a", "b", "c"], 64)
    busy = first.replica
    p.sync(
        {
            r: {
                REPORTED_AT: clock.now + 1,
                # Two more prompts wait there, sent by another router: the replica's count.
                WAITING_SEQS: 3 if r == busy else 0,
                PENDING_PREFILL_TOKENS: 6000 if r == busy else 0,
            }
            for r in ("a", "b", "c")
        }
    )
    clock.now += 2
    assert p.choose(text + "more", ["a", "b", "c"], 64).replica != busy


def test_bookings_spread_new_prompts_until_the_replicas_report() -> None:
    p, _ = policy()
    chosen = [p.choose(f"prompt {i} " * 100, ["a", "b", "c"], 100).replica for i in range(6)]
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]


def test_a_report_replaces_the_bookings_it_covers() -> None:
    p, clock = policy()
    p.choose("x" * 4000, ["a"], 100)
    assert p.replicas["a"].outstanding(clock.now, p.settings) > 100
    # Prefilled since: what it still has to decode is the replica's own figure.
    p.sync({"a": {REPORTED_AT: clock.now + 0.1, RUNNING_SEQS: 1, PENDING_DECODE_TOKENS: 70}})
    assert p.replicas["a"].outstanding(clock.now + 0.2, p.settings) == 70


def test_a_waiting_prompt_counts_what_was_not_cached_where_it_went() -> None:
    """The replica counts a waiting prompt whole (its engine tells what was cached only
    after the prefill); the router counts the part its placement did not find cached."""
    p, clock = policy()
    history = conversation(1, 3)
    p.choose(history, ["a"], 16)
    p.sync({"a": {REPORTED_AT: clock.now + 0.1, WAITING_SEQS: 0}})
    clock.now += 1
    repeat = p.choose(history + " and one more question", ["a"], 16)
    assert repeat.matched_tokens > 0.9 * repeat.prompt_tokens
    p.sync(
        {
            "a": {
                REPORTED_AT: clock.now + 0.1,
                WAITING_SEQS: 1,
                PENDING_PREFILL_TOKENS: repeat.prompt_tokens,
            }
        }
    )
    waiting = p.replicas["a"].outstanding(clock.now + 0.2, p.settings)
    assert waiting == repeat.prompt_tokens - repeat.matched_tokens


def test_eviction_follows_the_reported_cache_size() -> None:
    p, _ = policy(block_chars=256, chars_per_token=4.0)
    p.sync({"a": {CAPACITY_TOKENS: 256}})  # four blocks of 64 tokens
    old = "o" * 1024
    p.choose(old, ["a"], 1)
    p.choose("n" * 1024, ["a"], 1)  # fills the cache: the old prompt's blocks are out
    assert p.choose(old, ["a"], 1).matched_tokens == 0


def test_a_restarted_replica_holds_nothing() -> None:
    p, _ = policy()
    text = conversation(1, 2)
    p.sync({"a": {GENERATION: "pid-1"}})
    p.choose(text, ["a"], 1)
    p.sync({"a": {GENERATION: "pid-2"}})
    assert p.choose(text, ["a"], 1).matched_tokens == 0


def test_gone_replicas_are_forgotten() -> None:
    p, _ = policy()
    p.choose("x" * 1000, ["b"], 1)
    p.sync({"a": {}})
    assert set(p.replicas) == {"a"}
    with pytest.raises(ValueError, match="no replica"):
        p.choose("x", [], 1)
