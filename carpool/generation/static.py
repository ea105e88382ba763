"""Static batching, for comparison: one padded transformers ``generate`` per batch."""

from __future__ import annotations

import time
from typing import Any

from carpool.generation.native import ThreadedEngine
from carpool.generation.sampling import (
    apply_penalties,
    chosen_logprobs,
    sample_one,
    top_alternatives,
)
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.sequence import GenSequence, StepRecord, TokenizerInfo


class StaticEngine(ThreadedEngine):
    """One padded transformers ``generate`` per batch (static batching, for comparison).

    Sampling, stops and streaming ride on ``generate``'s hooks: a logits processor picks
    each row's token with the row's own sampler, and a stopping criterion hands every new
    token to the sequence and tells ``generate`` which rows are done. Done rows still run
    (padded) until the batch's longest sequence ends: that is what static batching costs.
    """

    mode = "static"

    def __init__(
        self,
        model: Any,
        tokenizer: TokenizerInfo,
        limits: SchedulerLimits,
        max_seq_len: int,
        block_size: int = 64,
    ) -> None:
        super().__init__(tokenizer, limits, max_seq_len)
        self.model = model
        self.block_size = block_size
        self.waiting: list[GenSequence] = []
        self.batch: list[GenSequence] = []
        self._batch_len = 0

    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.waiting)

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "running": len(self.batch),
            "waiting": self.num_waiting(),
            **self.totals,
        }

    def _loop_once(self) -> None:
        self.waiting.extend(self._take_inbox(block=not self.waiting))
        now = time.monotonic()
        for seq in list(self.waiting):
            reason = self._expired(seq, now)
            if reason is not None:
                self.waiting.remove(seq)
                self._finish_now(seq, reason)
        if not self.waiting:
            return
        # A batch: FCFS while rows x longest prompt stays within the token budget.
        batch: list[GenSequence] = []
        longest = 0
        for seq in self.waiting:
            width = max(longest, seq.num_prompt_tokens)
            if batch and (
                len(batch) >= self.limits.max_num_seqs
                or (len(batch) + 1) * width > self.limits.max_step_tokens
            ):
                break
            batch.append(seq)
            longest = width
        del self.waiting[: len(batch)]
        self.batch = batch
        try:
            self._generate(batch)
        finally:
            self.batch = []

    def _generate(self, batch: list[GenSequence]) -> None:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria

        engine = self
        device = next(self.model.parameters()).device
        width = max(s.num_prompt_tokens for s in batch)
        ids = torch.full((len(batch), width), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, width - seq.num_prompt_tokens :] = torch.tensor(seq.prompt_ids)
            mask[row, width - seq.num_prompt_tokens :] = 1
        done = torch.zeros(len(batch), dtype=torch.bool, device=device)
        clock = {"start": time.perf_counter(), "last": time.perf_counter(), "steps": 0}
        # The sampler hook sees the logits; the stopping hook accepts the tokens a moment later.
        step_logprobs: list[float] = [0.0] * len(batch)
        step_tops: list[list[tuple[int, float]]] = [[] for _ in batch]

        class RowSampler(LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                forced = torch.full_like(scores, float("-inf"))
                scores = apply_penalties(scores, [s.sampler for s in batch])
                grammars = [None if done[r] else s.sampler.grammar for r, s in enumerate(batch)]
                if any(g is not None for g in grammars):
                    from carpool.generation.structured import apply_grammars

                    scores = apply_grammars(scores.float().clone(), grammars)
                greedy = torch.argmax(scores, dim=-1)
                chosen = []
                for row, seq in enumerate(batch):
                    token = int(greedy[row])
                    if not done[row] and not seq.params.greedy:
                        token = sample_one(scores[row], seq.sampler)
                    forced[row, token] = 0.0
                    chosen.append(token)
                states = [s.sampler for s in batch]
                step_logprobs[:] = chosen_logprobs(scores, chosen, states)
                step_tops[:] = top_alternatives(scores, states)
                return forced

        class RowStopper(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                now = time.perf_counter()
                elapsed_ms = (now - clock["last"]) * 1000
                clock["last"] = now
                first = clock["steps"] == 0
                clock["steps"] += 1
                mono = time.monotonic()
                for row, seq in enumerate(batch):
                    if done[row]:
                        continue
                    reason = engine._expired(seq, mono)
                    if reason is not None:
                        engine._finish_now(seq, reason)
                        done[row] = True
                    elif engine._accept(
                        seq, int(input_ids[row, -1]), step_logprobs[row], step_tops[row]
                    ):
                        done[row] = True
                engine._record(
                    StepRecord(
                        running=len(batch),
                        waiting=engine.num_waiting(),
                        decode_seqs=0 if first else len(batch),
                        prefill_seqs=len(batch) if first else 0,
                        prefill_tokens=sum(s.num_prompt_tokens for s in batch) if first else 0,
                        padded_tokens=len(batch) * width if first else 0,
                        prefill_ms=elapsed_ms if first else 0.0,
                        decode_ms=0.0 if first else elapsed_ms,
                        kv_blocks_used=len(batch) * -(-input_ids.shape[1] // engine.block_size),
                    )
                )
                return done.clone()

        # generate() would stop rows at end-of-sequence on its own, even with ignore_eos, and
        # fills an unset eos from the model's config; the stopping criterion decides instead.
        gen_config = self.model.generation_config
        saved_eos, gen_config.eos_token_id = gen_config.eos_token_id, None
        try:
            self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(s.params.max_tokens for s in batch),
                do_sample=False,
                pad_token_id=self.tok.pad_id,
                logits_processor=LogitsProcessorList([RowSampler()]),
                stopping_criteria=[RowStopper()],
            )
        finally:
            gen_config.eos_token_id = saved_eos
        for seq in batch:  # rows generate() ended without the criterion seeing them (none expected)
            if not seq.finished:
                self._finish_now(seq, "length")

    def _fail_all(self, reason: str) -> None:
        for seq in self.batch + self.waiting + self._take_inbox(block=False):
            self._finish_now(seq, "error", reason)
        self.batch, self.waiting = [], []
