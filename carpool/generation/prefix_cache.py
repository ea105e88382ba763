"""Prefix reuse for carpool's continuous engine: a prompt whose beginning an earlier sequence
already computed copies those keys and values instead of computing them again.

A repeated prefix is the common case of chat and agent traffic (a system prompt, a
conversation's earlier turns, a RAG context), and prefill is the expensive part of a request
on a CPU: Qwen2.5-0.5B took seconds for 1,500 tokens here. vLLM caches prefixes in its own KV
blocks; this is the same idea over carpool's slot cache, whose rows are freed when a sequence
leaves:

- Tokens are cut into blocks of ``block_tokens``; a block's hash covers its tokens and every
  block before it (a chain), so one hash names one whole prefix, as vLLM's block hashes do.
- When a sequence leaves, the keys and values of its whole blocks (prompt and output: the
  next turn of a conversation repeats both) are copied out of its row into one entry, indexed
  under each of its block hashes. A longer entry re-points the hashes a shorter one held, and
  an entry no hash points to any more is dropped.
- A new prompt looks up its longest indexed prefix, leaving at least one token to compute
  (its logits pick the first output token); the engine copies those values into the row it
  admits the prompt to and starts its prefill after them.
- Entries are evicted least recently used under ``max_bytes``.

Pure Python over opaque tensors: the engine reads and writes rows (``SlotKVCache``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# (keys, values): one tensor per layer, [kv_heads, tokens, head_dim].
KVPair = tuple[list[Any], list[Any]]


def block_hashes(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """One hash per whole block; hash ``i`` covers blocks ``0..i`` (a chain)."""
    hashes, previous = [], 0
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        previous = hash((previous, tuple(tokens[start : start + block_tokens])))
        hashes.append(previous)
    return hashes


def _nbytes(pair: KVPair) -> int:
    return sum(t.numel() * t.element_size() for tensors in pair for t in tensors)


@dataclass(eq=False)
class CachedPrefix:
    """The keys and values of ``tokens`` positions, and the block hashes they answer to."""

    keys: list[Any]
    values: list[Any]
    tokens: int
    hashes: list[int]
    nbytes: int
    pointers: int = field(default=0)  # index entries that point here


class PrefixCache:
    """Least-recently-used prefixes under a byte budget (see the module docstring)."""

    def __init__(self, max_bytes: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, not {block_tokens}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self._index: dict[int, CachedPrefix] = {}
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # id: entry, LRU first
        self.bytes = 0
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

    def lookup(self, tokens: Sequence[int]) -> tuple[CachedPrefix, int] | None:
        """The entry holding the longest cached prefix of ``tokens`` and that prefix's length
        (at most ``len(tokens) - 1``), or None."""
        self.lookups += 1
        self.lookup_tokens += len(tokens)
        hashes = block_hashes(tokens[: len(tokens) - 1], self.block_tokens)
        for i in range(len(hashes) - 1, -1, -1):
            entry = self._index.get(hashes[i])
            if entry is not None:
                self._entries.move_to_end(id(entry))
                length = (i + 1) * self.block_tokens
                self.hits += 1
                self.hit_tokens += length
                return entry, length
        return None

    def store(self, tokens: Sequence[int], read: Callable[[int], KVPair]) -> None:
        """Keeps the whole blocks of ``tokens`` (whose values ``read(n)`` copies out),
        unless they are cached already or cannot fit the budget at all."""
        length = len(tokens) // self.block_tokens * self.block_tokens
        if length == 0 or self.max_bytes <= 0:
            return
        hashes = block_hashes(tokens[:length], self.block_tokens)
        known = self._index.get(hashes[-1])
        if known is not None:  # this whole prefix is held (maybe inside a longer one)
            self._entries.move_to_end(id(known))
            return
        keys, values = read(length)
        entry = CachedPrefix(keys, values, length, hashes, _nbytes((keys, values)))
        if entry.nbytes > self.max_bytes:
            return
        for h in hashes:
            old = self._index.get(h)
            self._index[h] = entry
            entry.pointers += 1
            if old is not None:
                old.pointers -= 1
                if old.pointers == 0:  # wholly inside the new one
                    self._drop(old)
        self._entries[id(entry)] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            _, oldest = next(iter(self._entries.items()))
            for h in oldest.hashes:
                if self._index.get(h) is oldest:
                    del self._index[h]
            self._drop(oldest)

    def _drop(self, entry: CachedPrefix) -> None:
        if self._entries.pop(id(entry), None) is not None:
            self.bytes -= entry.nbytes

    def stats(self) -> dict[str, int]:
        return {
            "prefix_cache_bytes": self.bytes,
            "prefix_cache_entries": len(self._entries),
            "prefix_cache_lookups": self.lookups,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_lookup_tokens": self.lookup_tokens,
        }
