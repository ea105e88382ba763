"""What flows through a generation engine: sequences, their events, step records.

A ``GenSequence`` is one prompt being generated (request side: params, where its events go;
engine side: progress). Engines report what a sequence produced as ``SeqEvent``s and what
each step did as ``StepRecord``s; ``TokenizerInfo`` is all an engine needs of a tokenizer.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from carpool.generation.sampling import SamplerState, SamplingParams
from carpool.generation.text import IncrementalDecoder, StopMatcher

# Prompt tokens decoded together with the first output tokens so their leading spaces and
# multi-byte characters come out right (see text.IncrementalDecoder).
DECODE_CONTEXT_TOKENS = 4

# End-of-turn / end-of-text tokens of common chat families, added to the eos ids when the
# vocabulary has them as tokens.
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

_ids = itertools.count()


@dataclass
class SeqEvent:
    """What a sequence produced since its last event; ``finish_reason`` set on the last one.

    Finish reasons: ``stop`` (end of sequence or a stop string), ``length`` (max_tokens or
    the context limit), ``cancelled``, ``timeout``, ``error`` (then ``error`` says why).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Log-probability of each of token_ids under the distribution it was drawn from.
    token_logprobs: list[float] = field(default_factory=list)
    # For each of token_ids, the sequence's top_logprobs most likely (token, logprob) pairs;
    # empty unless its params ask for alternatives.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class GenSequence:
    """One prompt being generated: request side (params, sink) and engine side (progress).

    ``sink`` receives the sequence's events. An engine's ``generate`` sets it (and ``loop``,
    the event loop it must be called on, for engines that run in a thread of their own); a
    caller driving an engine synchronously passes its own.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[SeqEvent], None] | None = None,
        index: int = 0,
        deadline: float | None = None,
        rank: int = 0,
        predicted_tokens: float | None = None,
        grammar: Any = None,
        constraint: Any = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sink = sink
        self.loop: Any = None  # asyncio loop the sink belongs to; None: call it directly
        self.index = index
        self.deadline = deadline  # time.monotonic() after which the engine drops it
        self.rank = rank  # priority tier: 0 interactive is admitted before 1 batch
        # The router's length prediction; engines with a priority queue of their own use it.
        self.predicted_tokens = predicted_tokens
        # Structured output: ``constraint`` (structured.OutputConstraint) is what the output
        # must be, for engines that constrain on their own (vLLM); ``grammar`` is its
        # per-sequence state for carpool's engines, which mask the logits with it.
        self.constraint = constraint
        self.sampler = SamplerState(params, grammar=grammar)
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.num_computed = 0  # tokens whose keys/values are in the KV cache
        self.cached_tokens = 0  # prompt tokens an engine found in its prefix cache
        self.cancelled = False  # set from any thread; the engine acts at its next step
        self.finish_reason: str | None = None
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._context = self.prompt_ids[-DECODE_CONTEXT_TOKENS:]
        self._decoder: IncrementalDecoder | None = None
        self._stopper = StopMatcher(params.stop)
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[float] = []
        self._pending_top: list[list[tuple[int, float]]] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_chunk(self, size: int) -> list[int]:
        """The next ``size`` tokens to feed: prompt tokens, then the last sampled token."""
        if self.num_computed < len(self.prompt_ids):
            return self.prompt_ids[self.num_computed : self.num_computed + size]
        return [self.output_ids[-1]]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.id}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
            f"computed={self.num_computed}, finish={self.finish_reason})"
        )


@dataclass
class StepRecord:
    """What one engine step did (exported as metrics by listeners)."""

    running: int
    waiting: int
    decode_seqs: int = 0
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    padded_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_bytes: int = 0

    @property
    def tokens(self) -> int:
        return self.decode_seqs + self.padded_tokens


class EngineListener(Protocol):
    """Receives step and finish records (metrics); called on the engine thread."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_finish(self, seq: GenSequence) -> None: ...


@dataclass
class TokenizerInfo:
    """What an engine needs from the tokenizer: decoding, end-of-sequence and padding ids."""

    decode: Callable[[Sequence[int]], str]
    eos_ids: frozenset[int]
    pad_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, generation_config: Any = None) -> TokenizerInfo:
        eos: set[int] = set()
        for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(x) for x in source)
        # Chat-tuned families end a turn with one token and a document with another; a raw
        # completion may produce either, so both end the sequence.
        vocab = tokenizer.get_vocab()
        eos.update(vocab[name] for name in END_TOKENS if name in vocab)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(eos) if eos else 0

        def decode(ids: Sequence[int]) -> str:
            return tokenizer.decode(list(ids), skip_special_tokens=True)

        return cls(decode=decode, eos_ids=frozenset(eos), pad_id=int(pad))


def check_fits(seqs: Sequence[GenSequence], max_seq_len: int) -> None:
    """Refuses, before any is queued, a sequence whose prompt plus max_tokens cannot fit."""
    for seq in seqs:
        if seq.num_prompt_tokens + seq.params.max_tokens > max_seq_len:
            raise ValueError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.params.max_tokens}) exceeds max_seq_len {max_seq_len}"
            )
