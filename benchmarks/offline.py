"""The offline limit: the model's own throughput with no serving at all.

The same ``TextEmbedder`` the replicas use, called directly in the benchmark process with the
replicas' torch thread count, on the same texts the load generator sends. Inputs are sorted
by length (least padding any batching could achieve: a server only ever sees a window of
them) and run at each candidate batch size; the best one is the ceiling no server on this
machine can beat. Tokenisation is done before timing: it is not the model's work.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.workloads import EmbedRequest, Request

DEFAULT_BATCH_SIZES = (1, 4, 16, 32, 64, 128)


@dataclass
class OfflinePoint:
    batch_size: int
    order: str  # "sorted" (by length) or "arrival" (as sent)
    seconds: float
    items_per_s: float
    tokens_per_s: float  # real tokens
    padded_tokens_per_s: float
    passes: int = 0
    padded_tokens: int = 0


@dataclass
class OfflineResult:
    items: int
    real_tokens: int
    torch_threads: int
    points: list[OfflinePoint] = field(default_factory=list)

    @property
    def best(self) -> OfflinePoint:
        return max((p for p in self.points if p.order == "sorted"), key=lambda p: p.items_per_s)

    def cost_model(self) -> dict[str, float] | None:
        """Least-squares fit of ``seconds = per_pass * passes + per_token * padded_tokens``.

        The ratio ``per_pass / per_token`` is what carpool's ``pass_overhead_tokens`` knob
        stands for: the fixed cost of a forward pass in tokens' worth of compute.
        """
        pts = [p for p in self.points if p.passes and p.padded_tokens]
        if len({p.passes for p in pts}) < 2:
            return None
        import numpy as np

        a = np.array([[p.passes, p.padded_tokens] for p in pts], dtype=float)
        y = np.array([p.seconds for p in pts])
        (per_pass, per_token), *_ = np.linalg.lstsq(a, y, rcond=None)
        return {
            "per_pass_ms": float(per_pass * 1000),
            "per_padded_token_ms": float(per_token * 1000),
            "pass_overhead_tokens": float(per_pass / per_token) if per_token > 0 else 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "real_tokens": self.real_tokens,
            "torch_threads": self.torch_threads,
            "points": [asdict(p) for p in self.points],
            "best": asdict(self.best) if self.points else None,
            "cost_model": self.cost_model(),
        }


def texts_of(requests: Sequence[Request], limit: int) -> list[str]:
    """The first ``limit`` texts the load generator would send, in order."""
    out: list[str] = []
    for r in requests:
        if not isinstance(r, EmbedRequest):
            raise ValueError(f"the offline limit is for embedding workloads, not {r.kind!r}")
        out.extend(r.texts)
        if len(out) >= limit:
            break
    return out[:limit]


def time_passes(forward: Any, batches: list[list[list[int]]]) -> float:
    started = time.perf_counter()
    for batch in batches:
        forward(batch)
    return time.perf_counter() - started


def measure_offline_limit(
    texts: Sequence[str],
    model: str = "packaged:all-MiniLM-L6-v2",
    torch_threads: int = 1,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    arrival_batch_sizes: Sequence[int] = (),
    progress: bool = True,
) -> OfflineResult:
    """Items/s of the bare model at each batch size (sorted), and optionally in arrival order."""
    import torch
    from tqdm import tqdm

    from carpool.threads import size_torch_threads
    from deployments.embedder import EmbedderConfig, TextEmbedder

    previous = torch.get_num_threads()
    threads = size_torch_threads(None, torch_threads)
    try:
        embedder = TextEmbedder(EmbedderConfig.model_validate({"source": {"model": model}}))
        ids = [
            seq if len(seq) <= embedder.max_length else embedder.truncate(text)
            for seq, text in zip(embedder.tokenize(list(texts)), texts, strict=True)
        ]
        result = OfflineResult(len(ids), sum(len(s) for s in ids), threads)
        runs = [("sorted", b) for b in batch_sizes] + [("arrival", b) for b in arrival_batch_sizes]
        embedder.embed_ids(ids[:8])  # warm-up: first calls allocate and pick kernels
        for order, size in tqdm(runs, desc="offline limit", disable=not progress, leave=False):
            seq = sorted(ids, key=len) if order == "sorted" else ids
            batches = [seq[i : i + size] for i in range(0, len(seq), size)]
            seconds = time_passes(embedder.embed_ids, batches)
            padded = sum(len(b) * max(len(s) for s in b) for b in batches)
            result.points.append(
                OfflinePoint(
                    batch_size=size,
                    order=order,
                    seconds=seconds,
                    items_per_s=len(ids) / seconds,
                    tokens_per_s=result.real_tokens / seconds,
                    padded_tokens_per_s=padded / seconds,
                    passes=len(batches),
                    padded_tokens=padded,
                )
            )
        return result
    finally:
        torch.set_num_threads(previous)
