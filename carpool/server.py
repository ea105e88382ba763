"""The plain-Python core every batched model server shares (no Ray).

A server owns a model's blocking ``forward(payloads) -> results`` and a
``LengthAwareExecutor`` around it; requests become ``Job``s. ``reconfigure()`` validates new
batching knobs before touching anything, so a bad ``user_config`` changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from carpool.batching import BatchLimits, Job, LengthAwareExecutor, make_splitter
from carpool.config import CONCURRENT_BATCHES, BatchingConfig
from carpool.errors import RequestError

P = TypeVar("P")
R = TypeVar("R")


class BatchedModelServer(Generic[P, R]):
    """Owns the executor and the batching knobs; subclasses add the request logic."""

    batching: BatchingConfig

    def _init_batching(
        self, forward: Callable[[list[P]], list[R]], batching: BatchingConfig
    ) -> None:
        self.batching = batching
        self._queued_items = 0
        self.limits = BatchLimits(batching.max_batch_size, batching.max_batch_tokens)
        self.executor: LengthAwareExecutor[P, R] = LengthAwareExecutor(
            forward, self._splitter(batching), max_step_items=self._step_items(batching)
        )

    @staticmethod
    def _splitter(b: BatchingConfig) -> Any:
        return make_splitter(
            b.split_policy, b.max_batch_tokens, b.max_batch_size, b.pass_overhead_tokens
        )

    @staticmethod
    def _step_items(b: BatchingConfig) -> int:
        return b.max_batch_size * CONCURRENT_BATCHES

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies new batching knobs (Serve calls this with the deployment's user_config)."""
        b = BatchingConfig.model_validate(user_config)
        self.batching = b
        self.limits.max_batch_size = b.max_batch_size
        self.limits.max_batch_tokens = b.max_batch_tokens
        self.executor.splitter = self._splitter(b)
        self.executor.max_step_items = self._step_items(b)

    def stats(self) -> dict[str, float]:
        """Cumulative batching figures of this replica, with its pid and current knobs."""
        return {
            **self.executor.stats.snapshot(),
            "pid": os.getpid(),
            "max_batch_size": self.batching.max_batch_size,
            "max_batch_tokens": self.batching.max_batch_tokens,
        }

    def make_job(self, payloads: list[P], lengths: list[int]) -> Job[P, R]:
        return Job(payloads, lengths, self.limits)

    async def run_job(self, job: Job[P, R]) -> list[R]:
        """Admits ``job`` (or refuses it fast with 503) and returns its results."""
        items = len(job.payloads)
        queued = self._queued_items
        if queued and queued + items > self.batching.max_queued_items:
            stats = self.executor.stats
            per_item_ms = stats.forward_ms / stats.items if stats.items else 50.0
            raise RequestError(
                503,
                f"this replica already has {queued} items queued (limit "
                f"{self.batching.max_queued_items}); retry later or send fewer items",
                code="overloaded",
                retry_after_s=queued * per_item_ms / 1000,
            )
        self._queued_items = queued + items
        try:
            return await self._dispatch(job)
        finally:
            self._queued_items -= items

    async def _dispatch(self, job: Job[P, R]) -> list[R]:
        """Without Serve, jobs go straight to the executor (which still merges concurrent calls)."""
        return await self.executor.run_one(job)
