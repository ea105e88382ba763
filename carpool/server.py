"""The plain-Python core every batched model server shares (no Ray).

A server owns a model's blocking ``forward(payloads) -> results`` and a
``LengthAwareExecutor`` around it; requests become ``Job``s. ``reconfigure()`` validates new
batching knobs before touching anything, so a bad ``user_config`` changes nothing.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from carpool.admission import (
    AdmissionLimits,
    PassCostModel,
    QueueState,
    RequestControls,
    deadline_exceeded,
    make_admission_policy,
)
from carpool.autoscaling import CAPACITY_METRIC
from carpool.batching import BatchLimits, Job, LengthAwareExecutor, PassRecord, make_splitter
from carpool.config import CONCURRENT_BATCHES, BatchingConfig
from carpool.models import trim_heap

P = TypeVar("P")
R = TypeVar("R")


class BatchedModelServer(Generic[P, R]):
    """Owns the executor and the batching knobs; subclasses add the request logic."""

    batching: BatchingConfig
    stage = "model"  # what health and error messages call this replica

    def check_health(self) -> None:
        """Serve's health check: raises when the batching worker task died, so Serve
        replaces this replica.

        Every forward pass runs on that task; if something its loop does not catch ends it,
        requests already taken from the queue never get an answer and wait out their
        deadline while the replica still looks healthy.
        """
        failure = self.executor.worker_failure()
        if failure is not None:
            raise RuntimeError(
                f"{self.stage} is unhealthy: its batching worker task ended ({failure}); "
                "requests it held will not be answered"
            )

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: the requests this replica runs at once under
        the knobs in force, which ``carpool.autoscaling`` aims at per replica."""
        return {CAPACITY_METRIC: float(self.batching.max_batch_size)}

    def _init_batching(
        self, forward: Callable[[list[P]], list[R]], batching: BatchingConfig
    ) -> None:
        self.batching = batching
        self._queued_items = 0
        self._queued_tokens = 0
        self._queued_interactive = [0, 0]  # items, tokens of the interactive tier
        # Characters per token, learnt as requests are tokenized; 4 suits English BPE/WordPiece.
        self._chars_per_token = 4.0
        self.limits = BatchLimits(batching.max_batch_size, batching.max_batch_tokens)
        self.executor: LengthAwareExecutor[P, R] = LengthAwareExecutor(
            forward, self._splitter(batching), max_step_items=self._step_items(batching)
        )
        self.cost = PassCostModel(
            max_pass_items=batching.max_batch_size, max_pass_tokens=batching.max_batch_tokens
        )
        self.executor.listeners.append(_CostListener(self.cost))
        self.executor.estimate_ms = self.cost.estimate_ms  # urgency: a job's own cost
        self.executor.listeners.append(_HeapTrimmer())
        self.admission_limits = AdmissionLimits(0, None, 1.0)
        self._apply_admission(batching)

    def _apply_admission(self, b: BatchingConfig) -> None:
        self.admission_limits.max_queued_items = b.max_queued_items
        self.admission_limits.max_queue_delay_ms = b.max_queue_delay_ms
        self.admission_limits.batch_tier_share = b.batch_tier_share
        self.admission_limits.target_queue_delay_ms = b.target_queue_delay_ms
        self.admission_limits.standing_queue_ms = b.standing_queue_ms
        self.admission = make_admission_policy(b.admission_policy, self.admission_limits, self.cost)

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
        self.cost.max_pass_items = b.max_batch_size
        self.cost.max_pass_tokens = b.max_batch_tokens
        self.executor.splitter = self._splitter(b)
        self.executor.max_step_items = self._step_items(b)
        self._apply_admission(b)

    def stats(self) -> dict[str, float]:
        """Cumulative batching figures of this replica, with its pid and current knobs."""
        return {
            **self.executor.stats.snapshot(),
            "pid": os.getpid(),
            "max_batch_size": self.batching.max_batch_size,
            "max_batch_tokens": self.batching.max_batch_tokens,
            "queued_items": self._queued_items,
            "estimated_queue_delay_ms": round(
                self.cost.estimate_ms(self._queued_items, self._queued_tokens), 1
            ),
            "cost_fixed_ms": round(self.cost.fixed_ms, 3),
            "cost_ms_per_token": round(self.cost.ms_per_token, 5),
        }

    def make_job(
        self, payloads: list[P], lengths: list[int], controls: RequestControls | None = None
    ) -> Job[P, R]:
        job: Job[P, R] = Job(payloads, lengths, self.limits)
        if controls is not None:
            job.deadline = controls.monotonic_deadline()
            job.rank = controls.rank
        job.controls = controls
        return job

    def check_deadline(self, controls: RequestControls | None, stage: str, items: int) -> None:
        """504 before any work (tokenizing included) for a request that arrives too late."""
        if controls is not None and controls.expired():
            self.executor.report_drop("deadline", items)
            raise deadline_exceeded(stage)

    def estimate_tokens(self, char_counts: Iterable[int], max_tokens: int) -> int:
        """Tokens of texts with these lengths, from characters: admission before tokenizing.

        Refusing must cost no model time, and tokenizing 16 long texts costs milliseconds of
        the replica's CPU; the ratio is learnt from the requests this replica tokenized.
        """
        ratio = self._chars_per_token
        return sum(min(max_tokens, math.ceil(c / ratio) + 2) for c in char_counts)

    def learn_token_ratio(self, chars: int, tokens: int) -> None:
        if chars > 0 and tokens > 0:
            self._chars_per_token = 0.9 * self._chars_per_token + 0.1 * (chars / tokens)

    @contextlib.contextmanager
    def admitted(
        self, items: int, tokens: int, controls: RequestControls | None
    ) -> Iterator[Admitted]:
        """Admits a job of ``items``/``tokens`` (or refuses it: 503 full, 504 deadline).

        The job counts in the queue until the block ends; ``Admitted.tokens`` may be set to
        the real count once the job is tokenized.
        """
        controls = controls or RequestControls()
        interactive = controls.priority == "interactive"
        state = QueueState(
            self._queued_items,
            self._queued_tokens,
            items,
            tokens,
            ahead_items=self._queued_interactive[0] if interactive else None,
            ahead_tokens=self._queued_interactive[1] if interactive else None,
        )
        refusal = self.admission.refuse(state, controls)
        if refusal is not None:
            self.executor.report_drop(
                "refused" if refusal.status_code == 503 else "deadline", items
            )
            raise refusal
        ticket = Admitted(self, items, tokens, interactive)
        ticket.count(+1)
        try:
            yield ticket
        finally:
            ticket.count(-1)

    async def run_job(self, job: Job[P, R], admitted: Admitted | None = None) -> list[R]:
        """Runs ``job``, admitting it first unless the caller already has (``admitted``)."""
        if admitted is not None:
            admitted.tokens = job.total_tokens
            return await self._dispatch(job)
        with self.admitted(len(job.payloads), job.total_tokens, job.controls):
            return await self._dispatch(job)

    async def _dispatch(self, job: Job[P, R]) -> list[R]:
        """Without Serve, jobs go straight to the executor (which still merges concurrent calls)."""
        return await self.executor.run_one(job)


class Admitted:
    """A job's share of its replica's queue, from admission until it is answered."""

    def __init__(
        self, server: BatchedModelServer[Any, Any], items: int, tokens: int, interactive: bool
    ) -> None:
        self._server = server
        self.items = items
        self._tokens = tokens
        self.interactive = interactive

    @property
    def tokens(self) -> int:
        return self._tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self.count(-1)
        self._tokens = value
        self.count(+1)

    def count(self, sign: int) -> None:
        server = self._server
        server._queued_items += sign * self.items
        server._queued_tokens += sign * self._tokens
        if self.interactive:
            server._queued_interactive[0] += sign * self.items
            server._queued_interactive[1] += sign * self._tokens


class _HeapTrimmer:
    """Returns freed heap to the OS at most every ``interval_s``, after a pass."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()

    def on_pass(self, record: PassRecord) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            trim_heap()


class _CostListener:
    """Feeds every forward pass into the replica's latency model."""

    def __init__(self, cost: PassCostModel) -> None:
        self.cost = cost

    def on_pass(self, record: PassRecord) -> None:
        self.cost.observe(record.real_tokens, record.items, record.forward_ms)
