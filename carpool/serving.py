"""The Serve shell shared by batched model deployments: ``@serve.batch`` plus Ray metrics.

Mixed in ahead of a ``BatchedModelServer`` subclass: ``@serve.batch`` collects jobs (weighted
by ``batch_weight`` so both the item and the token cap hold), and hands each collected batch
to the executor, which merges whatever is waiting when the model frees up.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from carpool.batching import Job, batch_weight
from carpool.config import COLLECTED_BATCHES_IN_FLIGHT
from carpool.server import BatchedModelServer


class _DropWeightedSizeWarning(logging.Filter):
    # With batch_size_fn the Serve cap is items x tokens, so Serve's "max_batch_size exceeds
    # max_ongoing_requests" warning compares unlike units and would fire on every replica.
    def filter(self, record: logging.LogRecord) -> bool:
        return "will never achieve the configured `max_batch_size`" not in record.getMessage()


def make_collector() -> Any:
    """A fresh ``@serve.batch`` collector for one deployment class.

    Serve keeps one batch queue per decorated function, so each class gets its own function
    (``_collect = make_collector()``) rather than sharing one through the mixin.
    """

    @serve.batch(
        max_batch_size=64 * 8192,  # replaced from config by _apply_collection()
        max_concurrent_batches=COLLECTED_BATCHES_IN_FLIGHT,
        batch_size_fn=batch_weight,
    )
    async def _collect(self: Any, jobs: list[Job]) -> list[Any]:
        # Exceptions come back as values per job, so one bad job fails only its own request.
        return await self.executor.run(jobs)

    return _collect


class ServeBatching:
    """Mixin: put it before the server class in the bases, and set ``_collect = make_collector()``."""

    _collect: Any

    def _init_serving(self: Any, model_name: str) -> None:
        from carpool.metrics import RayBatchMetrics

        logging.getLogger("ray.serve").addFilter(_DropWeightedSizeWarning())
        self.executor.listeners.append(RayBatchMetrics(model_name))
        self._apply_collection()

    def reconfigure(self: Any, user_config: dict[str, Any]) -> None:
        BatchedModelServer.reconfigure(self, user_config)
        self._apply_collection()

    def _apply_collection(self: Any) -> None:
        self._collect.set_max_batch_size(self.limits.serve_capacity)
        self._collect.set_batch_wait_timeout_s(self.batching.batch_wait_timeout_s)

    async def _dispatch(self: Any, job: Job) -> list[Any]:
        try:
            outcome = await self._collect(job)
        except asyncio.CancelledError:
            # The client left. Serve drops the request if its batch is not collected yet; if
            # it is already with the executor, cancelling the job skips its items there.
            if job.future is not None:
                job.future.cancel()
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
