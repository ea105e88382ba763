"""The Mooncake conversation trace as the twin replays it: the same requests as the benchmark.

``benchmarks.prefix_replay`` replays these requests against a deployment and the twin replays
the very same ones (same conversations kept, same text per block, same arrival times): the
rules that make the request list live here, since product code may not import the benchmark
harness.

The rules (the benchmark's docstring says why each): requests that share their second
512-token block are one conversation; a deterministic ``keep`` fraction of conversations is
kept (Knuth's multiplicative hash of the conversation key, the slice ``[offset, offset +
keep)``); each block becomes ``block_words`` words drawn from its hash id (equal ids, equal
text); prompts are cut at ``max_blocks``; outputs are the trace's divided by
``output_divisor``; time is scaled so that the kept requests arrive at ``rate`` per second on
average, keeping the trace's gaps' shape.

For clusters larger than the box, ``copies`` replays more conversations than the trace has:
copy ``k`` gives every block id but the first (the system block every prompt shares) a text
of its own and arrives ``k / copies`` of one mean gap after the original, so the copies'
conversations run side by side with the same turns and gaps.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
# The words blocks are made of (as the benchmark draws them): fixed, so that a block's text
# depends on its hash id alone.
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
VOCAB = sorted(
    {"".join(random.Random(i).choice(_SYLLABLES) for _ in range(2 + i % 2)) for i in range(2000)}
)
# Copies renumber block ids above this: the trace's ids stay far below it.
_COPY_STRIDE = 10**9


@dataclass
class TraceRequest:
    """One replayed request: when it arrives (s from the replay's start) and what it asks."""

    at: float
    prompt: str
    max_tokens: int
    conversation: int
    blocks: int


def block_text(hash_id: int, words: int) -> str:
    rng = random.Random(hash_id * 1_000_003 + 7)
    return " ".join(rng.choice(VOCAB) for _ in range(words)) + ".\n"


def kept(key: int, keep: float, offset: float = 0.0) -> bool:
    """The benchmark's deterministic draw per conversation: slices at other offsets are
    disjoint sets of conversations."""
    return offset <= ((key * 2654435761) % 2**32) / 2**32 < offset + keep


def read_rows(path: Path = TRACE) -> list[dict[str, Any]]:
    if not path.exists():
        raise FileNotFoundError(
            f"no Mooncake trace at {path}; put mooncake_conversation_trace.jsonl there "
            "(../shared/traces beside the checkout) or pass its path"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _conversation(row: dict[str, Any], index: int) -> int:
    ids = row["hash_ids"]
    return ids[1] if len(ids) > 1 else -1 - index


def _copied(rows: list[dict[str, Any]], copies: int) -> list[dict[str, Any]]:
    """The rows of ``copies`` copies of the trace (see the module docstring)."""
    if copies == 1:
        return rows
    # Copies keep the trace's timeline (its conversations span most of the hour, so moving
    # them by a share of it would pile their later turns past its end, where they would
    # arrive sparsely), each a fraction of one mean gap after the one before it, so that
    # no two copies' requests arrive at the same instant.
    gap_ms = max(1, rows[-1]["timestamp"] - rows[0]["timestamp"]) / len(rows)
    out = []
    for k in range(copies):
        moved = round(k * gap_ms / copies)
        for row in rows:
            ids = row["hash_ids"]
            if k:
                ids = ids[:1] + [h + k * _COPY_STRIDE for h in ids[1:]]
            out.append({**row, "timestamp": row["timestamp"] + moved, "hash_ids": ids})
    out.sort(key=lambda r: r["timestamp"])
    return out


def mooncake(
    keep: float,
    rate: float,
    block_words: int = 8,
    max_blocks: int = 64,
    output_divisor: float = 8.0,
    path: Path = TRACE,
    offset: float = 0.0,
    copies: int = 1,
    rows: Iterable[dict[str, Any]] | None = None,
) -> tuple[list[TraceRequest], dict[str, Any]]:
    """The replay's requests and its facts (as ``benchmarks.prefix_replay.mooncake``)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    all_rows = _copied(list(rows) if rows is not None else read_rows(path), copies)
    chosen = []
    for i, row in enumerate(all_rows):
        conversation = _conversation(row, i)
        if kept(conversation if conversation >= 0 else i + 10**9, keep, offset):
            chosen.append((row, conversation))
    if not chosen:
        raise ValueError(f"keep {keep} at offset {offset} kept no conversation; raise keep")
    t0 = chosen[0][0]["timestamp"] / 1000
    span = max(1e-9, chosen[-1][0]["timestamp"] / 1000 - t0)
    scale = (len(chosen) / rate) / span
    requests = []
    seen: set[int] = set()
    reused = total = 0
    for row, conversation in chosen:
        ids = row["hash_ids"][:max_blocks]
        prefix_open = True
        for h in ids:
            total += 1
            if prefix_open and h in seen:
                reused += 1
            else:
                prefix_open = False
            seen.add(h)
        requests.append(
            TraceRequest(
                at=(row["timestamp"] / 1000 - t0) * scale,
                prompt="".join(block_text(h, block_words) for h in ids),
                max_tokens=max(1, round(row["output_length"] / output_divisor)),
                conversation=conversation,
                blocks=len(ids),
            )
        )
    facts = {
        "trace": "mooncake_conversation_trace.jsonl (Qin et al., FAST 2025; Apache-2.0)",
        "kept_conversations_fraction": keep,
        "kept_slice_offset": offset,
        "copies": copies,
        "requests": len(requests),
        "conversations": len({r.conversation for r in requests}),
        "time_scale": scale,
        "block": f"512 tokens -> {block_words} words",
        "max_blocks": max_blocks,
        "output_divisor": output_divisor,
        "prefix_blocks_reused_unbounded_cache": reused / total if total else 0.0,
    }
    return requests, facts


def turn_gap_s(requests: list[TraceRequest]) -> float:
    """The median gap between a conversation's consecutive turns, in replay seconds."""
    last: dict[int, float] = {}
    gaps = []
    for r in requests:
        if r.conversation in last:
            gaps.append(r.at - last[r.conversation])
        last[r.conversation] = r.at
    gaps.sort()
    return gaps[len(gaps) // 2] if gaps else 0.0
