"""The twin routes ``auto`` as the router does: same requests and seed, same decisions.

The serving router (``RouterServer.generate`` over fake async generators) and the twin
(``carpool_twin.sim.Twin._route`` on its event loop) both drive the router's flow
(``plan`` -> gate -> call -> ``after_answer`` -> ``finish``). Each driver still translates its
own world: the async one reads a generator's ``GenerationResult``, the twin a ``SimRequest``.
This test feeds both the same requests (varied prompts, ``max_tokens``, small answers that are cut off,
unsure or fine) and checks, request by request, the model, lane, predicted length, escalation
and reason, the models called in order, and at the end the length predictor's and the
escalation learner's learned state.
A change to either driver's flow (the cascade's condition, what the predictor learns, when
the learner learns) makes them disagree here.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from carpool.generation.hops import Choice, GenerationResult, RouteDecision
from carpool.generation.schemas import GenerationCall
from carpool_twin.replicas import GeneratorReplica, SimRequest
from carpool_twin.sim import Pool, Twin
from router.core import RouterServer

PROMPTS = [
    "Write python code for a parser of arithmetic expressions",
    "Explain relativity in detail, with examples",
    "Answer yes or no: is ice cold?",
    "hello",
    "Summarise this paragraph in one sentence: the quick brown fox jumps",
    "Translate 'good morning' into French",
    "Write a long story about dragons and the sea",
    "What is 2 + 2?",
]


def requests(seed: int, n: int) -> list[SimRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = rng.choice(PROMPTS)
        max_tokens = rng.choice([8, 16, 32, 64, 128, 256])
        # Code prompts run long (often cut off at max_tokens); the rest vary.
        produced = max_tokens if "code" in text else rng.randint(1, max_tokens)
        out.append(
            SimRequest(
                "generate",
                prompt_tokens=max(1, len(text) // 4),
                max_tokens=max_tokens,
                output_tokens=produced,
                model="auto",
                text=text,
                small_mean_logprob=rng.choice([-0.2, -0.6, -2.5]),
            )
        )
    return out


def call_of(req: SimRequest) -> GenerationCall:
    """The call the twin's router sees for ``req`` (carpool_twin.sim.Twin._route)."""
    return GenerationCall(prompts=[req.text], max_tokens=req.max_tokens)


class Answers:
    """A generator answering the request in hand as the twin's replicas do: ``produced``
    tokens, cut off when that is ``max_tokens``, at small's mean log-probability."""

    def __init__(self, name: str, current: list[SimRequest], called: list[str]) -> None:
        self.name, self.current, self.called = name, current, called

    async def generate(self, call: GenerationCall) -> GenerationResult:
        self.called.append(self.name)
        req = self.current[0]
        cut = req.produced >= req.max_tokens
        return GenerationResult(
            self.name,
            [Choice(0, "", "length" if cut else "stop")],
            req.prompt_tokens,
            req.produced,
            token_ids=list(range(req.produced)),  # no repetition, as the twin reads it
            token_logprobs=[req.small_mean_logprob] * req.produced,
        )

    async def stream(self, call: GenerationCall) -> Any:
        raise AssertionError("the agreement test generates whole answers only")


class Recorder:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_decision(self, decision: RouteDecision) -> None:
        # Time in the lane is wall-clock for one and simulated for the other.
        self.records.append({k: v for k, v in decision.to_dict().items() if k != "queue_ms"})


class CallsTwin(Twin):
    """The twin, noting which model each submission goes to."""

    called: list[str]

    def _submit(self, pool: Any, req: Any, reply: Any, rec: Any) -> None:
        self.called.append(pool.name)
        super()._submit(pool, req, reply, rec)


def run_router(
    config: dict[str, Any], reqs: list[SimRequest]
) -> tuple[RouterServer, Recorder, list[str]]:
    current: list[SimRequest] = []
    called: list[str] = []
    clients = {m: Answers(m, current, called) for m in ("small", "large")}
    router = RouterServer({**config, "predictor_snapshot": None}, clients)  # type: ignore[arg-type]
    recorder = Recorder()
    router.listeners.append(recorder)

    async def main() -> None:
        for req in reqs:  # one at a time: the twin's requests do not overlap either
            current[:] = [req]
            await router.generate(call_of(req))

    asyncio.run(main())
    return router, recorder, called


def run_twin(
    config: dict[str, Any], reqs: list[SimRequest], seed: int
) -> tuple[CallsTwin, Recorder]:
    entry = {
        "kind": "generator",
        "prefill": {"fits": {"line": {"coef": {"const": 5.0, "tokens": 0}}}, "use": "line"},
        "decode": {"fits": {"line": {"coef": {"const": 5.0, "batch": 0}}}, "use": "line"},
        "kv_bytes_per_token": 1024,
    }
    pools = {
        m: Pool(m, [GeneratorReplica(m, {"max_num_seqs": 8}, entry)]) for m in ("small", "large")
    }
    twin = CallsTwin(pools, router=config, seed=seed)
    twin.called = []
    assert twin.router is not None
    recorder = Recorder()
    twin.router.listeners.append(recorder)
    # 100 s apart: each is answered (escalation included) before the next arrives.
    twin.run(arrivals=[(100.0 * (i + 1), r) for i, r in enumerate(reqs)], warmup_s=0)
    return twin, recorder


CONFIGS = {
    "learned_cascade": {"policy": "learned_cascade", "min_mean_logprob": -1.0},
    "cascade": {"policy": "cascade", "min_mean_logprob": -1.0, "escalate_on_length": True},
    "threshold": {"policy": "threshold", "max_small_tokens": 40},
    "one lane": {"policy": "cascade", "lanes_enabled": False, "escalate_on_length": False},
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 7])
def test_the_twin_routes_auto_as_the_router_does(name: str, seed: int) -> None:
    config = CONFIGS[name]
    reqs = requests(seed, 120)
    router, served, called = run_router(config, reqs)
    twin, simulated = run_twin(config, reqs, seed)

    assert len(served.records) == len(simulated.records) == len(reqs)
    for i, (real, sim) in enumerate(zip(served.records, simulated.records, strict=True)):
        assert sim == real, f"request {i} ({reqs[i].text!r}, max_tokens {reqs[i].max_tokens})"
    assert [r.model for r in twin.records] == [r["model"] for r in served.records]
    assert [r.escalated for r in twin.records] == [r["escalated"] for r in served.records]
    assert twin.called == called  # small then large for each escalation, in the same order

    assert twin.router is not None
    real_state, sim_state = router.predictor.state(), twin.router.predictor.state()
    assert real_state.keys() == sim_state.keys()
    for key in real_state:
        assert np.array_equal(np.asarray(real_state[key]), np.asarray(sim_state[key])), key
    assert router.learner.observations == twin.router.learner.observations
    assert np.array_equal(router.learner.weights, twin.router.learner.weights)

    # The cases the comparison is about all occurred.
    lanes = {r["lane"] for r in served.records}
    assert len(lanes) == (1 if name == "one lane" else 2)
    if name != "threshold":
        assert 0 < sum(r["escalated"] for r in served.records) < len(reqs)
        assert router.learner.observations > 30
    else:
        assert {r["model"] for r in served.records} == {"small", "large"}
    if name == "learned_cascade":
        assert any(r["reason"].startswith("learned") for r in served.records)
