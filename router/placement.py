"""Which replica of a generator serves a request: the one where it costs least.

A request's cost on a replica is the work that replica must do before this request's
answer is out, in tokens:

- the prompt it must prefill, less the prefix the replica still holds in its KV cache
  (``prefill_weight`` per token);
- the prompts already waiting there, each less what was cached where this router placed it:
  the router's own estimate for the requests it sent (a replica reports how many of its
  sequences still wait for their first token, and those are its latest arrivals, since an
  engine prefills in order of arrival), so a booking ends when its prefill does;
- the output still to decode there (``decode_weight`` per token): the replica's report plus
  what this router sent it since;
- the request's predicted output (the same on every replica of a tier; it ranks tiers).

Counting the output still to decode, not just the sequences decoding, is measured: with one
token per running sequence (a step's share of it) the prefix outweighed load, conversations
piled onto the replicas that held them, and on the Mooncake replay at the default's capacity
TTFT p90 was 2.9x leastconn's (benchmarks/ROUTING.md).

Where a prefix is cached is tracked approximately, as llm-d's approximate scheduler and
Ray's ``PrefixCacheAffinityRouter`` do: the prompt is cut into blocks of ``block_chars``
characters, each block's key hashes it with every block before it (equal keys = equal
prefixes), and each replica keeps the keys of the prompts this router sent it, least
recently used first out, bounded by what its KV cache holds (``capacity_tokens`` from the
replica's report, ``chars_per_token`` to convert). A replica that restarts reports an empty
cache (``generation`` changes) and its keys are dropped.

Pure Python, no Ray: ``router.replica_router`` runs it inside Serve's request router, the
twin and the tests call it directly.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The key of "no blocks before this one".
_ROOT = 0x9E3779B97F4A7C15
# Bookings kept per replica: more than any replica holds waiting.
_MAX_BOOKINGS = 1024

# What a replica reports (``GeneratorServer.routing_stats``) and the router reads.
PENDING_PREFILL_TOKENS = "carpool_pending_prefill_tokens"
PENDING_DECODE_TOKENS = "carpool_pending_decode_tokens"
WAITING_SEQS = "carpool_waiting_seqs"
RUNNING_SEQS = "carpool_running_seqs"
CAPACITY_TOKENS = "carpool_kv_capacity_tokens"
REPORTED_AT = "carpool_reported_at"
GENERATION = "carpool_replica_generation"


def block_keys(text: str, block_chars: int) -> list[int]:
    """Keys of the whole ``block_chars`` blocks of ``text``, each chained to the ones before.

    A partial last block is left out: an engine caches whole KV blocks only, and a prompt
    that grows by a few characters must still match its earlier self.
    """
    keys = []
    key = _ROOT
    for start in range(0, len(text) - block_chars + 1, block_chars):
        key = hash((key, text[start : start + block_chars]))
        keys.append(key)
    return keys


def prompt_text(payload: Any) -> str:
    """The text a request's prompt is built from, in order, from an OpenAI body or a call.

    ``messages`` (chat: role and content of each, as a template lays them out in order),
    else ``prompt`` (completions: a string or a list of them) or ``prompts`` (carpool's
    ``GenerationCall``). Anything else: "" (the request is placed by load alone).
    """
    messages = _field(payload, "messages")
    if isinstance(messages, list) and messages:
        parts = []
        for message in messages:
            if isinstance(message, dict):
                parts.append(f"<{message.get('role', '')}>{_content_text(message.get('content'))}")
        return "".join(parts)
    prompt = _field(payload, "prompt")
    if prompt is None:
        prompt = _field(payload, "prompts")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt[0]  # a batch of prompts: the first one decides
    return ""


def _field(payload: Any, name: str) -> Any:
    if isinstance(payload, dict):
        return payload.get(name)
    return getattr(payload, name, None)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI's content parts: the text ones
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and "text" in part
        )
    return ""


@dataclass(frozen=True)
class PlacementSettings:
    """The cost model's knobs (``pipelines.placement.PlacementArgs`` describes each)."""

    block_chars: int = 64
    chars_per_token: float = 4.0
    prefill_weight: float = 1.0
    decode_weight: float = 1.0
    default_output_tokens: float = 128.0
    # When a replica has not reported its KV size yet.
    default_capacity_tokens: int = 32_768
    # A booking still waiting after this long was lost (its replica's report says so first).
    booking_ttl_s: float = 30.0


@dataclass
class Booking:
    at: float
    prefill_tokens: float  # the prompt less what was cached where it was placed
    output_tokens: float = 0.0


@dataclass
class ReplicaCache:
    """The prefix keys one replica holds, as this router believes, oldest first."""

    keys: OrderedDict[int, None] = field(default_factory=OrderedDict)
    capacity_blocks: int = 1
    generation: Any = None

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many of ``keys``' leading blocks this replica holds (a prefix: stop at a miss)."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def insert(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity_blocks:
            self.keys.popitem(last=False)


@dataclass
class ReplicaState:
    cache: ReplicaCache = field(default_factory=ReplicaCache)
    reported_at: float = 0.0
    waiting_seqs: int = 0  # sequences without a first token, at the report
    running_seqs: int = 0  # sequences decoding, at the report
    decode_tokens: float = 0.0  # output still to decode, at the report
    waiting_prefill_tokens: float = 0.0  # the replica's own count, cached part included
    bookings: deque[Booking] = field(default_factory=lambda: deque(maxlen=_MAX_BOOKINGS))

    def forget_prefilled(self) -> None:
        """Drops the bookings a new report shows done with their prefill: those before it,
        all but the last ``waiting_seqs``. No later report can count them again (what waits
        then arrived later), and ``outstanding`` runs on every request: it scans only what
        may still wait."""
        before = sum(1 for b in self.bookings if b.at <= self.reported_at)
        for _ in range(max(0, before - self.waiting_seqs)):
            self.bookings.popleft()

    def outstanding(self, now: float, s: PlacementSettings) -> float:
        """Tokens this replica still has to prefill and decode, as this router sees it."""
        while self.bookings and now - self.bookings[0].at >= s.booking_ttl_s:
            self.bookings.popleft()
        before = [b for b in self.bookings if b.at <= self.reported_at]
        since = [b for b in self.bookings if b.at > self.reported_at]
        # The report's waiting sequences are its latest arrivals: the router's own last
        # bookings before the report, each with the prefill left after its cached prefix.
        mine = before[len(before) - self.waiting_seqs :] if self.waiting_seqs else []
        waiting = sum(b.prefill_tokens for b in mine)
        if self.waiting_seqs > len(mine):  # sent by another router: the replica's figure
            waiting += (
                self.waiting_prefill_tokens * (self.waiting_seqs - len(mine)) / self.waiting_seqs
            )
        waiting += sum(b.prefill_tokens for b in since)
        decode = self.decode_tokens + sum(b.output_tokens for b in since)
        return waiting * s.prefill_weight + decode * s.decode_weight


@dataclass(frozen=True)
class Placement:
    """One request's choice, and why: the figures a report or a test reads."""

    replica: str
    cost: float
    matched_tokens: float
    prompt_tokens: float
    costs: dict[str, float]


class PlacementPolicy:
    """Cheapest replica by prefill left after the cached prefix, work queued, output."""

    def __init__(
        self,
        settings: PlacementSettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or PlacementSettings()
        self.clock = clock
        self.replicas: dict[str, ReplicaState] = {}
        self.placed = 0
        self.matched_tokens = 0.0
        self.prompt_tokens = 0.0

    def sync(self, reports: dict[str, dict[str, Any]]) -> None:
        """Takes the live replicas and each one's latest report (an empty dict: none yet)."""
        for gone in set(self.replicas) - set(reports):
            del self.replicas[gone]
        s = self.settings
        for replica, report in reports.items():
            state = self.replicas.setdefault(replica, ReplicaState())
            capacity = report.get(CAPACITY_TOKENS) or s.default_capacity_tokens
            state.cache.capacity_blocks = max(1, int(capacity * s.chars_per_token / s.block_chars))
            generation = report.get(GENERATION)
            if generation is not None and generation != state.cache.generation:
                if state.cache.generation is not None:  # restarted: its cache is empty
                    state.cache.keys.clear()
                state.cache.generation = generation
            at = report.get(REPORTED_AT)
            if at is not None and float(at) > state.reported_at:
                state.reported_at = float(at)
                state.waiting_seqs = int(report.get(WAITING_SEQS) or 0)
                state.running_seqs = int(report.get(RUNNING_SEQS) or 0)
                state.decode_tokens = float(report.get(PENDING_DECODE_TOKENS) or 0.0)
                state.waiting_prefill_tokens = float(report.get(PENDING_PREFILL_TOKENS) or 0.0)
                state.forget_prefilled()

    def choose(
        self,
        text: str,
        candidates: Sequence[str],
        predicted_tokens: float | None = None,
    ) -> Placement:
        """The cheapest of ``candidates`` (all known to ``sync``) for a prompt; books it there."""
        if not candidates:
            raise ValueError("no replica to place the request on")
        s = self.settings
        now = self.clock()
        keys = block_keys(text, s.block_chars)
        prompt_tokens = len(text) / s.chars_per_token
        output = predicted_tokens if predicted_tokens is not None else s.default_output_tokens
        costs: dict[str, float] = {}
        matched: dict[str, float] = {}
        for replica in candidates:
            state = self.replicas.setdefault(replica, ReplicaState())
            hit = state.cache.matched_blocks(keys) * s.block_chars / s.chars_per_token
            matched[replica] = min(hit, prompt_tokens)
            prefill = (prompt_tokens - matched[replica]) * s.prefill_weight
            costs[replica] = prefill + state.outstanding(now, s) + output
        best = min(candidates, key=lambda r: (costs[r], -matched[r]))
        chosen = self.replicas[best]
        chosen.cache.insert(keys)
        chosen.bookings.append(Booking(now, prompt_tokens - matched[best], output))
        self.placed += 1
        self.matched_tokens += matched[best]
        self.prompt_tokens += prompt_tokens
        return Placement(best, costs[best], matched[best], prompt_tokens, costs)

    def forget(self, replica: str) -> None:
        """A replica died: its cache and bookings go with it."""
        self.replicas.pop(replica, None)

    def stats(self) -> dict[str, Any]:
        return {
            "placed": self.placed,
            "prefix_hit_rate": self.matched_tokens / self.prompt_tokens
            if self.prompt_tokens
            else 0.0,
            "replicas": {
                r: {
                    "cached_blocks": len(st.cache.keys),
                    "waiting_seqs": st.waiting_seqs,
                    "running_seqs": st.running_seqs,
                }
                for r, st in self.replicas.items()
            },
        }
