"""A vLLM-like engine for the twin: a prefix cache in KV blocks and vLLM's step scheduler.

The placement twin (``carpool_twin.prefix_sim``) asks what a replica's prefix cache holds
when a request lands there, and how long the request then waits for its first token. Both
follow vLLM's v1 engine, which the small generator runs on:

- **The cache** (``KVCache``): the KV cache is ``num_blocks`` blocks of ``block_tokens``
  tokens (vLLM's CPU backend: 128; CUDA: 16). A block that a sequence has filled gets a key
  that hashes its tokens and every block's before it (a chain: equal keys, equal prefixes),
  so a later prompt finds the longest run of leading blocks already computed. Blocks a running
  sequence holds are never evicted; a finished sequence's blocks stay cached but free, least
  recently used first out, its tail blocks before its head (vLLM frees them in reverse).
  A prompt's hit is its leading full blocks found, at most its length less one token (the
  last position is always computed: it samples the first token).
- **The step** (``Engine.plan``): every running sequence first (a decode is one token, a
  prompt part-way through prefill its next chunk), then waiting prompts in arrival order
  (vLLM's first come, first served, as serve-replicas.yaml sets it), each less its cached
  prefix, while the step's token budget (``max_batched_tokens``) and ``max_num_seqs`` last
  and the KV cache has room; a prompt is cut to what the budget leaves (chunked prefill).
  When a running sequence needs a block and none is free, the last admitted one is
  preempted: its blocks are freed and it is computed again later (vLLM's recompute).

Text becomes tokens at ``chars_per_token`` (a property of the tokenizer and the text, stated
where it is set); block keys chain over ``block_tokens x chars_per_token`` characters, so two
prompts share a cached block exactly when they share that much leading text.

What a step costs is the caller's (``StepCost``): the twin prices it from a cost profile.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.placement import (
    CAPACITY_TOKENS,
    GENERATION,
    PENDING_DECODE_TOKENS,
    PENDING_PREFILL_TOKENS,
    REPORTED_AT,
    RUNNING_SEQS,
    WAITING_SEQS,
)

# The key of "no blocks before this one" (any constant: keys only compare with each other).
_ROOT = 0x5BD1E995


def chained_keys(text: str, block_chars: int) -> list[int]:
    """Keys of ``text``'s whole ``block_chars`` blocks, each hashing every block before it.

    A partial last block has no key: an engine caches whole blocks only."""
    keys = []
    key = _ROOT
    for start in range(0, len(text) - block_chars + 1, block_chars):
        key = hash((key, text[start : start + block_chars]))
        keys.append(key)
    return keys


class KVCache:
    """One replica's KV blocks: keyed blocks in use, keyed free ones (LRU), and unkeyed ones.

    A block in use is counted once however many sequences share it (``held``: key ->
    references). ``free`` holds blocks no sequence uses that still hold a prefix, oldest
    first: the first to be overwritten when a block is needed. ``anonymous``: blocks in use
    without a key (a sequence's partial last block, or a full one whose key another block
    already has).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.held: dict[Hashable, int] = {}
        self.free: OrderedDict[Hashable, None] = OrderedDict()
        self.anonymous = 0
        self.evicted = 0

    def match(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``' leading blocks are cached (in use or free): a prefix."""
        n = 0
        for key in keys:
            if key not in self.held and key not in self.free:
                break
            n += 1
        return n

    def acquire(self, keys: Sequence[Hashable]) -> None:
        """A sequence takes cached blocks (``match`` found them): free ones leave the LRU."""
        for key in keys:
            if key in self.free:
                del self.free[key]
                self.held[key] = 1
            else:
                self.held[key] += 1

    def room(self) -> int:
        """Blocks that can be handed out now: never used, or free and evictable."""
        return self.num_blocks - len(self.held) - self.anonymous

    def allocate(self, n: int) -> bool:
        """``n`` new (unkeyed) blocks, evicting the least recently used free ones if needed."""
        if n > self.room():
            return False
        spare = self.num_blocks - len(self.held) - self.anonymous - len(self.free)
        for _ in range(max(0, n - spare)):
            self.free.popitem(last=False)
            self.evicted += 1
        self.anonymous += n
        return True

    def seal(self, key: Hashable) -> bool:
        """A sequence filled one of its blocks: it takes ``key``, unless a block has it."""
        if key in self.held or key in self.free:
            return False  # vLLM keeps such a duplicate too; only one answers lookups
        self.anonymous -= 1
        self.held[key] = 1
        return True

    def release(self, keys: Sequence[Hashable], anonymous: int) -> None:
        """A sequence ends (or is preempted): its keyed blocks become free, tail first, so
        that its head (the prefix others share) is the last of them to be evicted."""
        for key in reversed(keys):
            refs = self.held[key] - 1
            if refs:
                self.held[key] = refs
            else:
                del self.held[key]
                self.free[key] = None
        self.anonymous -= anonymous


@dataclass(frozen=True)
class EngineSpec:
    """One engine's shape: its KV cache, step bounds and how its text becomes tokens."""

    block_tokens: int
    num_blocks: int
    max_num_seqs: int
    max_batched_tokens: int
    chars_per_token: float

    @property
    def block_chars(self) -> int:
        return max(1, round(self.block_tokens * self.chars_per_token))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens


@dataclass(eq=False)
class Seq:
    """A request inside an engine."""

    tag: Any
    prompt_tokens: int
    output_tokens: int
    keys: list[Hashable]  # the prompt's full blocks
    arrived: float
    computed: int = 0
    generated: int = 0
    cached_tokens: int = 0
    admitted: bool = False  # scheduled once (its cache hit is counted then)
    blocks: int = 0  # blocks it holds
    sealed: list[Hashable] = field(default_factory=list)  # the keyed ones, in order
    anonymous: int = 0

    @property
    def target(self) -> int:
        """Tokens whose KV must exist for the next token to be sampled."""
        return self.prompt_tokens + self.generated


@dataclass
class Step:
    """One engine step: what it computes, and its features for a cost model."""

    chunks: list[tuple[Seq, int]]
    decode_batch: int = 0
    decode_kv_tokens: int = 0
    prefill_tokens: int = 0
    prefill_rows: int = 0
    prefill_attention: int = 0


# (step) -> milliseconds
StepCost = Callable[[Step], float]


@dataclass
class StepEvents:
    first: list[Any] = field(default_factory=list)
    done: list[Any] = field(default_factory=list)


class Engine:
    """vLLM's scheduler over a ``KVCache`` (see the module docstring); no clock of its own."""

    def __init__(self, name: str, spec: EngineSpec, cost: StepCost) -> None:
        self.name = name
        self.spec = spec
        self.cost = cost
        self.cache = KVCache(spec.num_blocks)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.busy = False
        self.prompt_tokens = 0  # over admitted requests, as the replica's counters
        self.cached_tokens = 0
        self.preempted = 0

    def tokens(self, text: str) -> int:
        return max(1, round(len(text) / self.spec.chars_per_token))

    def add(self, tag: Any, text: str, output_tokens: int, now: float) -> Seq:
        """A request arrives: it waits at the back of the line (``tag`` names it in events)."""
        keys: list[Hashable] = list(chained_keys(text, self.spec.block_chars))
        seq = Seq(tag, self.tokens(text), max(1, output_tokens), keys, now)
        self.waiting.append(seq)
        return seq

    @property
    def ongoing(self) -> int:
        return len(self.waiting) + len(self.running)

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.spec.block_tokens)

    def _preempt(self, victim: Seq) -> None:
        """Frees a running sequence's blocks; it waits first in line to be computed again."""
        self.running.remove(victim)
        self._release(victim)
        victim.computed = 0
        self.waiting.appendleft(victim)
        self.preempted += 1

    def _admit(self, seq: Seq, budget: int) -> int:
        """Tokens a waiting sequence gets this step (0: no room), its cached prefix taken."""
        limit = (seq.target - 1) // self.spec.block_tokens  # the last token is computed
        hit = self.cache.match(seq.keys[:limit])
        n = min(seq.target - hit * self.spec.block_tokens, budget)
        new = self._blocks_for(hit * self.spec.block_tokens + n) - hit
        # Taking a free cached block uses room as much as a new one does.
        if new > self.cache.room() - self._free_hits(seq.keys[:hit]):
            return 0
        self.cache.acquire(seq.keys[:hit])
        if not self.cache.allocate(new):  # cannot happen after the room check above
            raise RuntimeError("KV room check and allocation disagree")
        seq.sealed = list(seq.keys[:hit])
        seq.blocks, seq.anonymous = hit + new, new
        seq.computed = hit * self.spec.block_tokens
        if not seq.admitted:
            seq.admitted = True
            seq.cached_tokens = seq.computed
            self.prompt_tokens += seq.prompt_tokens
            self.cached_tokens += seq.computed
        return n

    def _free_hits(self, keys: Sequence[Hashable]) -> int:
        """How many of the hit blocks are free now: taking them uses room."""
        return sum(1 for k in keys if k in self.cache.free)

    def plan(self) -> Step | None:
        """The next step, or None when nothing is left to compute."""
        budget = self.spec.max_batched_tokens
        chunks: list[tuple[Seq, int]] = []
        preempted = self.preempted
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted for an earlier one this step
                continue
            n = min(seq.target - seq.computed, budget)
            need = self._blocks_for(seq.computed + n) - seq.blocks
            # No block free: the last admitted sequence gives its blocks back (vLLM's
            # recompute preemption), this one itself when it is the last.
            while need > 0 and not self.cache.allocate(need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seq.blocks += max(0, need)
                seq.anonymous += max(0, need)
                chunks.append((seq, n))
                budget -= n
        # As vLLM: no new prompt joins a step that had to preempt.
        while (
            self.preempted == preempted
            and budget > 0
            and self.waiting
            and len(self.running) < self.spec.max_num_seqs
        ):
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n <= 0:
                break  # first come, first served: nothing overtakes the head
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append((seq, n))
            budget -= n
        if not chunks:
            return None
        step = Step(chunks)
        for seq, n in chunks:
            if seq.generated and n == 1 and seq.computed == seq.target - 1:
                step.decode_batch += 1
                step.decode_kv_tokens += seq.computed + 1
            else:
                step.prefill_tokens += n
                step.prefill_rows += 1
                step.prefill_attention += n * (seq.computed + n)
        self.busy = True
        return step

    def finish(self, step: Step) -> StepEvents:
        """The step ran: tokens computed, blocks filled, first tokens and ends."""
        events = StepEvents()
        size = self.spec.block_tokens
        for seq, n in step.chunks:
            seq.computed += n
            for i in range(len(seq.sealed), seq.computed // size):
                # Past the prompt's full blocks a block holds output: a key of its own.
                key: Hashable = seq.keys[i] if i < len(seq.keys) else (id(seq), i)
                if self.cache.seal(key):
                    seq.sealed.append(key)
                    seq.anonymous -= 1
                else:
                    # A duplicate stays unkeyed; a placeholder keeps ``sealed`` in step with
                    # the blocks filled, and is never released as a key.
                    seq.sealed.append(_Dup(key))
            if seq.computed >= seq.target:
                seq.generated += 1
                if seq.generated == 1:
                    events.first.append(seq.tag)
                if seq.generated >= seq.output_tokens:
                    events.done.append(seq.tag)
                    self.running.remove(seq)
                    self._release(seq)
        self.busy = False
        return events

    def _release(self, seq: Seq) -> None:
        # A duplicate block is counted in ``anonymous`` already.
        keyed = [k for k in seq.sealed if not isinstance(k, _Dup)]
        self.cache.release(keyed, seq.anonymous)
        seq.sealed, seq.anonymous, seq.blocks = [], 0, 0

    def report(self, now: float) -> dict[str, Any]:
        """What the replica tells request routers (``GeneratorServer.record_routing_stats``):
        a sequence waits until its first token, whether queued or part-way through prefill."""
        live = [*self.running, *self.waiting]
        waiting = [s for s in live if s.generated == 0]
        return {
            PENDING_PREFILL_TOKENS: sum(s.prompt_tokens for s in waiting),
            PENDING_DECODE_TOKENS: sum(max(0, s.output_tokens - s.generated) for s in live),
            WAITING_SEQS: len(waiting),
            RUNNING_SEQS: len(live) - len(waiting),
            CAPACITY_TOKENS: self.spec.capacity_tokens,
            REPORTED_AT: now,
            GENERATION: 0,
        }

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached / prompt tokens (0 with none), as the replica counts."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class _Dup:
    """A filled block whose key another block holds: in use, unkeyed."""

    key: Hashable
