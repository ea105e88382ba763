"""Token log-probabilities from both engines and the plain generator server (no Ray).

The cascade router judges the small model's answer by its mean token logprob, so the value
must be the one of the sampled token under the distribution it came from.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest

from carpool.generation.factory import make_engine
from carpool.generation.sampling import SamplingParams
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.schemas import GenerationCall
from carpool.generation.sequence import GenSequence, SeqEvent, TokenizerInfo

PROMPTS = ["the carpool batch token", "hello", "paris is the capital of france and the city"]
MAX_TOKENS = [7, 12, 9]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    import torch
    from transformers import LlamaForCausalLM

    from tests.factories import llama_tokenizer, tiny_llama_config

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, initializer_range=0.5)).eval()
    return model, tokenizer


def run_engine(tiny, mode: str, **params: Any) -> dict[int, list[SeqEvent]]:
    model, tokenizer = tiny
    tok = TokenizerInfo.from_tokenizer(tokenizer, model.generation_config)
    engine = make_engine(mode, model, tok, SchedulerLimits(2, 256), 512, 16)
    events: dict[int, list[SeqEvent]] = {}
    done = threading.Event()

    def sink(event: SeqEvent) -> None:
        events.setdefault(event.index, []).append(event)
        if sum(1 for evs in events.values() if evs[-1].finish_reason) == len(PROMPTS):
            done.set()

    seqs = [
        GenSequence(
            tokenizer(p)["input_ids"],
            SamplingParams(max_tokens=n, ignore_eos=True, **params),
            sink,
            index=i,
        )
        for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
    ]
    try:
        engine.submit(seqs)
        assert done.wait(60), events
    finally:
        engine.close()
    return events


def reference_logprobs(tiny, prompt: str, tokens: list[int]) -> list[float]:
    """log_softmax of one unbatched forward over prompt + completion, at each output token."""
    import torch

    model, tokenizer = tiny
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(ids) - 1
    return [float(logp[start + k, t]) for k, t in enumerate(tokens)]


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_greedy_logprobs_match_an_unbatched_forward(tiny, mode):
    events = run_engine(tiny, mode, temperature=0.0)
    for i, prompt in enumerate(PROMPTS):
        tokens = [t for e in events[i] for t in e.token_ids]
        logprobs = [lp for e in events[i] for lp in e.token_logprobs]
        assert len(tokens) == len(logprobs) == MAX_TOKENS[i]
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
        assert logprobs == pytest.approx(reference_logprobs(tiny, prompt, tokens), abs=1e-4)


def test_sampled_logprobs_are_finite_and_one_per_token(tiny):
    events = run_engine(tiny, "continuous", temperature=0.8, seed=3)
    for i in range(len(PROMPTS)):
        tokens = [t for e in events[i] for t in e.token_ids]
        logprobs = [lp for e in events[i] for lp in e.token_logprobs]
        assert len(logprobs) == len(tokens) == MAX_TOKENS[i]
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)


def test_generator_server_returns_choice_zero_tokens_and_logprobs(tiny):
    from deployments.generator import GeneratorServer

    model, tokenizer = tiny
    server = GeneratorServer(
        {"limits": {"max_seq_len": 256}, "batching": {"max_num_seqs": 2}},
        model=model,
        tokenizer=tokenizer,
    )
    try:
        call = GenerationCall(prompts=[PROMPTS[0]], max_tokens=6, temperature=0.0, ignore_eos=True)
        result = asyncio.run(server.generate(call))
    finally:
        server.close()
    assert len(result.token_ids) == len(result.token_logprobs) == 6
    assert result.completion_tokens == 6
    expected = reference_logprobs(tiny, PROMPTS[0], result.token_ids)
    assert result.token_logprobs == pytest.approx(expected, abs=1e-4)
