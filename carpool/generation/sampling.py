"""Per-request sampling: the parameters a request carries and the sampler that applies them.

Every sequence samples on its own: greedy rows take the argmax of their own logits, sampled
rows draw from their own ``torch.Generator`` seeded from the request. So a sequence's tokens
do not depend on what it was batched with (up to floating-point noise in the logits), and a
request with a ``seed`` repeats itself.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows, and the
# distribution is a point mass on the argmax anyway.
GREEDY_TEMPERATURE = 1e-5
# Most alternatives a sequence may ask for with each token (OpenAI's chat limit).
MAX_TOP_LOGPROBS = 20
# OpenAI's range for presence_penalty and frequency_penalty.
MAX_PENALTY = 2.0


@dataclass(frozen=True)
class SamplingParams:
    """What one sequence asks of the sampler and the stop logic."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # Keep generating past end-of-sequence tokens (benchmarks need exact output lengths).
    ignore_eos: bool = False
    # How many of the most likely tokens to report beside each sampled one (OpenAI's
    # top_logprobs); 0 reports only the sampled token's logprob, which is always computed.
    top_logprobs: int = 0
    # Whether anyone reads the sampled tokens' logprobs: the client asked for them, or the
    # router's cascade judges the answer by them. vLLM's sampler pays a log-softmax and a rank
    # pass over the whole vocabulary each step for them, so its engine asks only when read;
    # carpool's own engines get them from the softmax they sample with and report them anyway.
    logprobs_wanted: bool = True
    # OpenAI's penalties, on tokens this sequence has generated (as vLLM applies them):
    # each logit drops by presence_penalty once the token appeared, plus frequency_penalty
    # per time it appeared.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop sequences must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class SamplerState:
    """Per-sequence sampler state: the random generator, created on first use."""

    params: SamplingParams
    generator: Any = field(default=None, repr=False)
    # How often each token was generated so far; kept only when a penalty needs it.
    counts: dict[int, int] = field(default_factory=dict, repr=False)
    # The sequence's structured-output grammar (structured.GrammarState), or None: masks
    # the logits before sampling and advances with every accepted token.
    grammar: Any = field(default=None, repr=False)

    def observe(self, token: int) -> None:
        """Records a generated token (the engine calls it for every accepted token)."""
        if self.params.penalized:
            self.counts[token] = self.counts.get(token, 0) + 1

    def torch_generator(self, device: Any) -> Any:
        if self.generator is None:
            import torch

            self.generator = torch.Generator(device=device)
            seed = self.params.seed
            self.generator.manual_seed(seed if seed is not None else random.getrandbits(63))
        return self.generator


def apply_penalties(logits: Any, states: list[SamplerState]) -> Any:
    """``logits`` with each row's presence and frequency penalties applied.

    Returns ``logits`` itself when no row is penalized (the common case costs nothing);
    otherwise a float32 copy where, for every token a row generated ``c`` times, the logit
    drops by ``presence_penalty + c * frequency_penalty``. Applied before sampling, so the
    sampled token, its logprob and the alternatives all come from the penalized distribution.
    """
    rows = [i for i, s in enumerate(states) if s.params.penalized and s.counts]
    if not rows:
        return logits
    import torch

    out = logits.float().clone()
    for i in rows:
        state = states[i]
        ids = torch.tensor(list(state.counts), dtype=torch.long, device=out.device)
        counts = torch.tensor(list(state.counts.values()), dtype=out.dtype, device=out.device)
        p = state.params
        out[i, ids] -= p.presence_penalty + p.frequency_penalty * counts
    return out


def apply_constraints(logits: Any, states: list[SamplerState]) -> Any:
    """``logits`` with each constrained row masked to what its grammar allows (in place).

    Returns ``logits`` untouched when no row carries a grammar (xgrammar is not even
    imported then); rows without one are never changed.
    """
    grammars = [s.grammar for s in states]
    if all(g is None for g in grammars):
        return logits
    from carpool.generation.structured import apply_grammars

    return apply_grammars(logits, grammars)


def sample_rows(logits: Any, states: list[SamplerState]) -> list[int]:
    """Picks one token per row of ``logits`` ([rows, vocab], float32) by each row's params."""
    import torch

    if logits.shape[0] != len(states):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(states)} sequences")
    chosen = torch.argmax(logits, dim=-1).tolist()
    for row, state in enumerate(states):
        if state.params.greedy:
            continue
        chosen[row] = sample_one(logits[row], state)
    return chosen


def chosen_logprobs(logits: Any, tokens: list[int], states: list[SamplerState]) -> list[float]:
    """Log-probability of each row's chosen token under the distribution it was drawn from.

    Greedy rows: log_softmax of the raw logits; sampled rows: after temperature (top-p's
    renormalisation is left out, so a filtered draw reads slightly lower). One gather and
    one logsumexp over the batch, so it costs little next to the forward pass.
    """
    import torch

    temps = torch.tensor(
        [1.0 if s.params.greedy else s.params.temperature for s in states],
        dtype=torch.float32,
        device=logits.device,
    )
    scaled = logits.float() / temps[:, None]
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
    picked = scaled.gather(1, index).squeeze(1) - torch.logsumexp(scaled, dim=-1)
    return picked.tolist()


def top_alternatives(logits: Any, states: list[SamplerState]) -> list[list[tuple[int, float]]]:
    """Each row's ``top_logprobs`` most likely tokens, best first, as (token, logprob).

    Under the same distribution as ``chosen_logprobs`` (after temperature), so the sampled
    token's entry, when it is among them, carries the same value. Rows that ask for none get
    ``[]``; when no row asks, nothing is computed, so the common case costs nothing.
    """
    wanted = [s.params.top_logprobs for s in states]
    k = max(wanted, default=0)
    if k == 0:
        return [[] for _ in states]
    import torch

    rows = [i for i, n in enumerate(wanted) if n > 0]
    temps = torch.tensor(
        [1.0 if states[i].params.greedy else states[i].params.temperature for i in rows],
        dtype=torch.float32,
        device=logits.device,
    )
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float() / temps[:, None], dim=-1)
    values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    out: list[list[tuple[int, float]]] = [[] for _ in states]
    for j, (row_values, row_ids) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
        n = wanted[rows[j]]
        # Tokens a grammar masked out have logprob -inf: not alternatives (and not JSON).
        out[rows[j]] = [
            (t, v) for t, v in zip(row_ids[:n], row_values[:n], strict=True) if v != -math.inf
        ]
    return out


def sample_one(logits: Any, state: SamplerState) -> int:
    """Temperature, then nucleus (top-p) filtering, then a draw from the sequence's generator."""
    import torch

    params = state.params
    scaled = logits.float() / params.temperature
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
        cut = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        # The best token stays even when top_p rounds to 0 in float32 (5e-324 did): cutting
        # every token left only -inf, and softmax of that is NaN.
        cut[0] = False
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(scaled, dim=-1)
    token = torch.multinomial(probs, 1, generator=state.torch_generator(logits.device))
    return int(token.item())
