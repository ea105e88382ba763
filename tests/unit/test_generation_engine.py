"""Generation engines and the plain generator server on a tiny random causal LM (no Ray).

The model is random but not degenerate (large init), so greedy outputs differ per prompt and
any mix-up between batch rows or cache slots shows up as different tokens.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from carpool.errors import RequestError
from carpool.generation.factory import make_engine
from carpool.generation.hops import Choice, GenerationEvent, GenerationResult
from carpool.generation.protocol import GenerationEngine
from carpool.generation.sampling import SamplingParams
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.schemas import GenerationCall
from carpool.generation.sequence import GenSequence, SeqEvent, StepRecord, TokenizerInfo

MODES = ["continuous", "static"]
PROMPTS = [
    "the carpool batch token",
    "hello",
    "a b c d e f g h i j k l m n o p q r s t",
    "rain " * 30,
    "paris is the capital of france and the city has a river",
]
MAX_TOKENS = [5, 23, 11, 17, 30]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    import torch
    from transformers import LlamaForCausalLM

    from tests.factories import llama_tokenizer, tiny_llama_config

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, initializer_range=0.5)).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def references(tiny) -> list[list[int]]:
    """Unbatched greedy transformers generate, one prompt at a time."""
    import torch

    model, tokenizer = tiny
    out = []
    # Exactly n tokens each, end-of-sequence or not (the engines run with ignore_eos).
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            out.append(gen[0, ids.shape[1] :].tolist())
    finally:
        model.generation_config.eos_token_id = saved
    assert all(len(ref) == n for ref, n in zip(out, MAX_TOKENS, strict=True))
    return out


class Collect:
    """A sink per sequence that records events; ``wait()`` until every sequence finished."""

    def __init__(self) -> None:
        self.events: dict[int, list[SeqEvent]] = {}
        self._done: set[int] = set()
        self._cond = threading.Condition()

    def sink(self, index: int):
        def sink(event: SeqEvent) -> None:
            with self._cond:
                self.events.setdefault(index, []).append(event)
                if event.finish_reason is not None:
                    self._done.add(index)
                self._cond.notify_all()

        return sink

    def wait(self, count: int, timeout: float = 60) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self._done) >= count, timeout), self.events

    def tokens(self, index: int) -> list[int]:
        return [t for e in self.events[index] for t in e.token_ids]

    def text(self, index: int) -> str:
        return "".join(e.text for e in self.events[index])

    def reason(self, index: int) -> str | None:
        return self.events[index][-1].finish_reason


class Steps:
    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.finished: list[GenSequence] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)

    def on_finish(self, seq: GenSequence) -> None:
        self.finished.append(seq)


def engine_for(
    tiny, mode: str, max_num_seqs: int = 4, max_step_tokens: int = 256, **info: Any
) -> GenerationEngine:
    model, tokenizer = tiny
    tok = TokenizerInfo.from_tokenizer(tokenizer, model.generation_config)
    if info:
        tok = TokenizerInfo(**{**tok.__dict__, **info})
    return make_engine(mode, model, tok, SchedulerLimits(max_num_seqs, max_step_tokens), 512, 16)


def seq(tiny, i: int, collect: Collect, **params: Any) -> GenSequence:
    _, tokenizer = tiny
    p = {"max_tokens": MAX_TOKENS[i], "temperature": 0.0, **params}
    return GenSequence(
        tokenizer(PROMPTS[i])["input_ids"], SamplingParams(**p), collect.sink(i), index=i
    )


# --- engines -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_equals_unbatched_generate_whatever_the_batch(tiny, references, mode):
    collect = Collect()
    engine = engine_for(tiny, mode, max_num_seqs=3)
    seqs = [seq(tiny, i, collect, ignore_eos=True) for i in range(len(PROMPTS))]
    try:
        # Arrivals in three waves, so later ones join a batch that is already decoding.
        engine.submit(seqs[:2])
        time.sleep(0.02)
        engine.submit(seqs[2:4])
        time.sleep(0.02)
        engine.submit(seqs[4:])
        collect.wait(len(seqs))
    finally:
        engine.close()
    for i, ref in enumerate(references):
        assert collect.tokens(i) == ref, f"prompt {i} differs in {mode} mode"
        assert collect.reason(i) == "length"


def test_chunked_prefill_gives_the_same_tokens(tiny, references):
    collect = Collect()
    # 8 tokens per step: the 30-token prompt is prefilled over several steps while the
    # others decode.
    engine = engine_for(tiny, "continuous", max_num_seqs=4, max_step_tokens=8)
    steps = Steps()
    engine.listeners.append(steps)
    try:
        engine.submit([seq(tiny, i, collect, ignore_eos=True) for i in (1, 3, 4)])
        collect.wait(3)
    finally:
        engine.close()
    for i in (1, 3, 4):
        assert collect.tokens(i) == references[i]
    assert max(r.tokens for r in steps.records) <= 8
    assert sum(1 for r in steps.records if r.prefill_seqs) >= 4  # 30 tokens in chunks of <= 8


@pytest.mark.parametrize("packed", [True, False])
def test_continuous_runner_with_and_without_packed_weights_matches_generate(
    tiny, references, packed
):
    import torch

    model, tokenizer = tiny
    tok = TokenizerInfo.from_tokenizer(tokenizer, model.generation_config)
    engine = make_engine(
        "continuous", model, tok, SchedulerLimits(3, 256), 512, 16, packed_weights=packed
    )
    runner = engine.runner
    assert runner.packed is packed
    linears = [m for m in runner.model.modules() if type(m) is torch.nn.Linear]
    if packed:
        # Every linear runs packed in the twin; the caller's model is left as it was and
        # shares its parameters with the twin (no second copy of the plain weights).
        assert runner.model is not model and not linears
        assert any(type(m) is torch.nn.Linear for m in model.modules())
        assert {id(p) for p in runner.model.parameters()} <= {id(p) for p in model.parameters()}
    else:
        assert runner.model is model and linears
    collect = Collect()
    try:
        engine.submit([seq(tiny, i, collect, ignore_eos=True) for i in range(len(PROMPTS))])
        collect.wait(len(PROMPTS))
    finally:
        engine.close()
    for i, ref in enumerate(references):
        assert collect.tokens(i) == ref, f"prompt {i} differs (packed={packed})"


def test_packed_twin_gives_the_logits_of_the_model(tiny):
    import torch

    from carpool.generation.runner import pack_linears

    model, _ = tiny
    twin = pack_linears(model)
    ids = torch.tensor([[5, 9, 13, 2, 7], [3, 3, 8, 1, 4]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        packed = twin(input_ids=ids).logits
    assert packed.shape == plain.shape
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)


def test_sequences_join_the_running_batch_and_leave_when_done(tiny):
    collect = Collect()
    engine = engine_for(tiny, "continuous", max_num_seqs=2)
    steps = Steps()
    engine.listeners.append(steps)
    lengths = [40, 3, 3, 3, 3]
    seqs = [
        GenSequence(
            tiny[1](PROMPTS[i])["input_ids"],
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            collect.sink(i),
            index=i,
        )
        for i, n in enumerate(lengths)
    ]
    try:
        engine.submit(seqs)
        collect.wait(len(seqs))
    finally:
        engine.close()
    assert all(r.running <= 2 for r in steps.records)
    # The long sequence kept decoding while the short ones took turns in the other slot:
    # prefills happened in steps that also decoded.
    assert sum(1 for r in steps.records if r.prefill_seqs and r.decode_seqs) >= 3
    order = [s.index for s in steps.finished]
    assert order[-1] == 0 and sorted(order[:-1]) == [1, 2, 3, 4]
    # 40 decode steps for the long one carried the four short ones: no step ran alone while
    # others waited.
    assert len(steps.records) <= 40 + 2


@pytest.mark.parametrize("mode", MODES)
def test_stop_sequence_ends_the_text_before_it(tiny, references, mode):
    _, tokenizer = tiny
    full = tokenizer.decode(references[4], skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    expected = full[: full.find(stop)]
    collect = Collect()
    engine = engine_for(tiny, mode)
    try:
        engine.submit([seq(tiny, 4, collect, stop=(stop, "never-there"), ignore_eos=True)])
        collect.wait(1)
    finally:
        engine.close()
    assert collect.text(4) == expected
    assert collect.reason(4) == "stop"


@pytest.mark.parametrize("mode", MODES)
def test_end_of_sequence_stops_unless_ignored(tiny, references, mode):
    eos = references[2][3]
    collect = Collect()
    engine = engine_for(tiny, mode, eos_ids=frozenset({eos}))
    try:
        engine.submit([seq(tiny, 2, collect)])
        collect.wait(1)
        first = collect.tokens(2)
        assert collect.reason(2) == "stop" and first[-1] == eos
        assert len(first) == references[2].index(eos) + 1
        collect2 = Collect()
        engine.submit([seq(tiny, 2, collect2, ignore_eos=True)])
        collect2.wait(1)
        assert collect2.tokens(2) == references[2] and collect2.reason(2) == "length"
    finally:
        engine.close()


def test_cancelling_a_sequence_frees_its_slot_for_the_next(tiny):
    collect = Collect()
    engine = engine_for(tiny, "continuous", max_num_seqs=1)
    steps = Steps()
    engine.listeners.append(steps)
    long = GenSequence(
        tiny[1](PROMPTS[0])["input_ids"],
        SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
        collect.sink(0),
        index=0,
    )
    queued = seq(tiny, 1, collect)
    try:
        engine.submit([long, queued])
        deadline = time.monotonic() + 30
        while len(collect.events.get(0, [])) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert 1 not in collect.events  # waiting: the only slot is taken
        engine.cancel(long)
        collect.wait(2)
    finally:
        engine.close()
    assert collect.reason(0) == "cancelled"
    assert len(long.output_ids) < 400
    assert collect.reason(1) in ("length", "stop")
    assert steps.records[-1].running == 0 and steps.records[-1].kv_blocks_used == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_request_past_its_deadline_times_out(tiny, mode):
    collect = Collect()
    engine = engine_for(tiny, mode)
    s = GenSequence(
        tiny[1](PROMPTS[0])["input_ids"],
        SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
        collect.sink(0),
        deadline=time.monotonic() + 0.05,
    )
    try:
        engine.submit([s])
        collect.wait(1)
    finally:
        engine.close()
    assert collect.reason(0) == "timeout"


def test_seeded_sampling_repeats_whatever_the_batch(tiny):
    results = []
    for companions in (0, 3):
        collect = Collect()
        engine = engine_for(tiny, "continuous")
        try:
            seqs = [seq(tiny, 4, collect, temperature=0.9, top_p=0.9, seed=1234)]
            seqs += [seq(tiny, i, collect, temperature=1.0) for i in range(companions)]
            engine.submit(seqs)
            collect.wait(len(seqs))
        finally:
            engine.close()
        results.append(collect.tokens(4))
    assert results[0] == results[1]


def test_submit_refuses_sequences_longer_than_the_context(tiny):
    engine = engine_for(tiny, "continuous")
    too_long = GenSequence([1] * 500, SamplingParams(max_tokens=20), lambda e: None)
    with pytest.raises(ValueError, match="exceeds max_seq_len 512"):
        engine.submit([too_long])
    engine.close()


# --- the plain server --------------------------------------------------------------------


def server_for(tiny, **overrides: Any):
    from deployments.generator import GeneratorServer

    model, tokenizer = tiny
    config = {
        "source": {"model": "tiny", "max_length": 256},
        "limits": {"max_tokens_limit": 64, "default_max_tokens": 16},
        "batching": {"max_num_seqs": 4, "max_step_tokens": 128},
        **overrides,
    }
    return GeneratorServer(config, model=model, tokenizer=tokenizer)


def run(coro):
    return asyncio.run(coro)


async def collect_stream(server, call: GenerationCall) -> list[GenerationEvent]:
    return [event async for event in server.stream(call)]


@pytest.mark.parametrize("interval", [(1, 0.0), (4, 10_000.0)])
def test_server_generates_and_streams_the_same_greedy_text(tiny, references, interval):
    tokens, ms = interval
    server = server_for(
        tiny,
        batching={
            "max_num_seqs": 4,
            "max_step_tokens": 128,
            "stream_interval_tokens": tokens,
            "stream_interval_ms": ms,
        },
    )
    try:
        call = GenerationCall(prompts=[PROMPTS[2]], max_tokens=11, temperature=0, ignore_eos=True)
        result = run(server.generate(call))
        events = run(collect_stream(server, call))
    finally:
        server.close()
    text = tiny[1].decode(references[2], skip_special_tokens=True)
    assert isinstance(result, GenerationResult) and result.decision is None
    assert result.choices == [Choice(0, text, "length")]
    assert result.completion_tokens == 11
    assert result.prompt_tokens == len(tiny[1](PROMPTS[2])["input_ids"])
    assert events[0].type == "start" and events[-1].type == "end"
    deltas = [e for e in events if e.type == "delta"]
    assert "".join(e.text for e in deltas) == text
    assert deltas[-1].finish_reason == "length"
    # What the engine had ready when the stream read it goes out together, so on a busy
    # machine the first delta may carry more than the first token (test_coalesce.py pins
    # the interval itself); every delta after the first holds `tokens` or ends the choice.
    assert deltas[0].text.startswith(tiny[1].decode(references[2][:1], skip_special_tokens=True))
    assert len(deltas) <= 1 + -(-10 // tokens)


def test_chat_uses_the_tokenizer_template(tiny):
    server = server_for(tiny)
    messages = [{"role": "user", "content": "hello there"}]
    try:
        result = run(
            server.generate(GenerationCall(messages=messages, max_tokens=3, temperature=0))
        )
    finally:
        server.close()
    tokenizer = tiny[1]
    expected = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert result.prompt_tokens == len(expected)


def test_n_choices_and_several_prompts_are_indexed_like_openai(tiny):
    server = server_for(tiny)
    call = GenerationCall(prompts=["one", "two"], n=2, max_tokens=4, seed=5, ignore_eos=True)
    try:
        first = run(server.generate(call))
        second = run(server.generate(call))
    finally:
        server.close()
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert first.choices == second.choices  # seeded
    assert first.completion_tokens == 16


@pytest.mark.parametrize(
    ("call", "status", "message"),
    [
        (GenerationCall(prompts=["hi"], max_tokens=65), 400, "at most 64 tokens per request"),
        (GenerationCall(prompts=["word " * 200], max_tokens=64), 400, "Lower max_tokens to"),
        (GenerationCall(prompts=["word " * 300]), 400, "takes at most 255 prompt tokens"),
        (GenerationCall(prompts=["x"] * 20, n=4), 400, "send at most 64"),
        (GenerationCall(prompts=[]), 400, "send a prompt or messages"),
    ],
)
def test_server_refuses_bad_calls_with_what_to_change(tiny, call, status, message):
    server = server_for(tiny)
    try:
        with pytest.raises(RequestError) as err:
            run(server.generate(call))
    finally:
        server.close()
    assert err.value.status_code == status
    assert message in err.value.message


def test_closing_a_stream_early_frees_the_slot(tiny):
    server = server_for(tiny)

    async def read_two_then_leave() -> None:
        stream = server.stream(
            GenerationCall(prompts=[PROMPTS[0]], max_tokens=64, temperature=0, ignore_eos=True)
        )
        seen = 0
        async for event in stream:
            seen += event.type == "delta"
            if seen == 2:
                break
        await stream.aclose()

    try:
        run(read_two_then_leave())
        deadline = time.monotonic() + 10
        while server.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = server.stats()
    finally:
        server.close()
    assert stats["running"] == 0
    assert stats["output_tokens"] < 64


def test_kv_budget_and_reconfigure_are_checked_before_anything_changes(tiny):
    with pytest.raises(ValueError, match=r"lower max_num_seqs or limits\.max_seq_len"):
        server_for(tiny, limits={"max_kv_cache_mb": 1, "max_seq_len": 100_000})
    server = server_for(tiny)
    try:
        with pytest.raises(ValueError, match="max_step_tokens"):
            server.reconfigure({"max_num_seqs": 64, "max_step_tokens": 32})
        assert server.engine.limits.max_num_seqs == 4
        server.reconfigure({"max_num_seqs": 8, "max_step_tokens": 64})
        assert server.engine.limits.max_num_seqs == 8
        assert server.batching.max_step_tokens == 64
        # The encoders' per-pass name on a generator is refused, naming the per-step one.
        with pytest.raises(ValueError, match="rename max_batch_tokens to max_step_tokens"):
            server.reconfigure({"max_num_seqs": 8, "max_batch_tokens": 64})
        assert server.batching.max_step_tokens == 64
    finally:
        server.close()


def test_server_refuses_only_what_would_wait_past_its_bound_or_deadline(tiny):
    server = server_for(
        tiny,
        source={"model": "tiny", "max_length": 512},
        limits={"max_tokens_limit": 440, "default_max_tokens": 16},
        batching={"max_num_seqs": 1, "max_step_tokens": 128, "max_queue_delay_ms": 1500},
    )
    hold = GenerationCall(prompts=[PROMPTS[0]], max_tokens=400, temperature=0, ignore_eos=True)

    async def until_waiting(n: int) -> None:
        # The holder must be running (not itself still waiting for the slot) before the
        # waiting count means "queued behind it".
        def ready() -> bool:
            stats = server.engine.stats()
            return stats["running"] >= 1 and stats["waiting"] >= n

        deadline = time.monotonic() + 30
        while not ready() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        assert ready()

    async def main() -> tuple:
        first = await server.generate(hold.model_copy(update={"max_tokens": 4}))
        assert first.completion_tokens == 4
        server.engine.mean_slot_s = 1.0  # as if sequences held their slot 1 s each
        holder = asyncio.create_task(server.generate(hold))
        await until_waiting(0)
        queued = [asyncio.create_task(server.generate(hold))]
        await until_waiting(1)
        # One waiting for the only slot, ~1 s of waiting, under the 1.5 s bound: admitted.
        queued.append(asyncio.create_task(server.generate(hold)))
        await until_waiting(2)
        # Two waiting, ~2 s: past the bound, refused at once; a tight deadline gets 504.
        refused = await asyncio.gather(
            server.generate(hold),
            server.generate(hold.model_copy(update={"deadline": time.time() + 0.5})),
            return_exceptions=True,
        )
        for task in (holder, *queued):
            task.cancel()
        await asyncio.gather(holder, *queued, return_exceptions=True)
        return refused

    try:
        over, late = run(main())
    finally:
        server.close()
    assert isinstance(over, RequestError) and over.status_code == 503, over
    assert over.code == "overloaded" and over.retry_after_s
    assert isinstance(late, RequestError) and late.status_code == 504, late
    assert late.code == "deadline_unmeetable"


def test_engine_comparison_reports_what_each_client_saw(tiny):
    from benchmarks.generation_compare import run_mode, workload

    server = server_for(tiny)
    try:
        requests = workload(6, 2, 12, seed=0)
        result = run(run_mode(server, requests, concurrency=3))
    finally:
        server.close()
    assert result["requests"] == 6
    assert result["output_tokens"] == sum(r["max_tokens"] for r in requests)  # ignore_eos
    # Each sequence's decode time over its tokens after the first: positive, and not more
    # than a whole request's latency.
    assert 0 < result["tpot_p50_ms"] <= result["tpot_p90_ms"] <= 1000 * result["latency_p90_s"]
