"""/rag answers on the generate path, as /generate does: no Ray.

A ``RagHandler`` over an in-process retriever and a generator deployment played by
``tests.unit.test_one_owner.Replicas`` (each call reaches the next replica, which answers,
refuses for overload or has died), behind carpool's own HTTP app (``make_api``), next to
``/generate``'s real routes (``generate_api``) over the same replicas. The router behind
``auto`` is the real one, in-process. What rag adds (citations) is checked on the answers it
gives; what it shares with /generate (first-event check, refusal retry, deadline, SSE and the
usage chunk) is checked against /generate's answer to the same overload.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from carpool import calls, topology
from carpool.errors import RequestError
from carpool.generation.hops import GenerationEvent
from carpool.http import MAX_BODY_BYTES, make_api
from carpool.local_handle import LocalHandle
from carpool.schemas import SearchHit
from carpool.topology import DeploymentView, LiveReplicas
from pipelines.generate import generate_api
from pipelines.generate_handler import GenerateArgs, GenerateHandler
from pipelines.generate_path import GeneratePath
from pipelines.rag import RagArgs, RagHandler, citation_suffix, citing
from pipelines.rag_schemas import RagChatRequest
from router.core import RouterServer
from router.deployment import _HandleClient
from tests.unit.test_one_owner import DEPLOYMENT, Replicas

QUESTION = [{"role": "user", "content": "What colour is the bridge?"}]
SUFFIX = "\n\nSources: [quillon], [harbour]"


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> LiveReplicas:
    """Two live replicas of small, as the ingress and the router read them (as in
    ``test_one_owner``); the ingress's refusal memory starts empty."""
    counts = LiveReplicas(lambda: {DEPLOYMENT: DeploymentView(2, 8)}, interval_s=3600)
    counts.refresh_now()
    monkeypatch.setattr(topology, "_shared", counts)
    monkeypatch.setattr(calls, "_REFUSALS", {})
    return counts


class Retriever:
    """The search app's retriever: two chunks for any query; counts its calls."""

    def __init__(self) -> None:
        self.searched = 0

    async def search(self, query: str, top_k: int, controls: Any) -> list[dict[str, Any]]:
        self.searched += 1
        return [
            {
                "doc_id": doc_id,
                "chunk_id": 0,
                "text": text,
                "score": score,
                "metadata": {},
            }
            for doc_id, text, score in (
                ("quillon", "The Zorblatt bridge is orange.", 0.9),
                ("harbour", "Ships pass under the bridge.", 0.5),
            )
        ]


class SlowStart:
    """A generator's handle whose streams take ``start_s`` to send their first event."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.cancelled: list[str] = []
        self.stream = self  # handle.options(stream=True).stream.remote(call)

    def options(self, **_: Any) -> SlowStart:
        return self

    def remote(self, call: Any) -> SlowStart:
        return self

    def __aiter__(self) -> SlowStart:
        return self

    async def __anext__(self) -> GenerationEvent:
        await asyncio.sleep(self.start_s)
        return GenerationEvent.start("small", 5)

    def cancel(self) -> None:
        self.cancelled.append("stream")


class TooLong(Replicas):
    """A generator that refuses the prompt as the real one does when it cannot fit."""

    @staticmethod
    def fail(replica: str, behaviour: str) -> None:
        raise RequestError(
            400,
            "messages has 900 tokens; model 'small' takes at most 511 prompt tokens. Shorten it",
            param="messages",
            code="context_length_exceeded",
        )


def _generator(small: Replicas, live: LiveReplicas, generator: str) -> Any:
    """The generate app's tier rag names: small itself, or the router (``auto``) over it."""
    if generator == "small":
        return small
    return LocalHandle(RouterServer({}, {"small": _HandleClient(small, live.count, live.recount)}))


def _rag(
    small: Replicas, live: LiveReplicas, generator: str = "small", **args: Any
) -> tuple[FastAPI, Retriever]:
    """rag's chat route (as ``RagIngress`` serves it) over ``small``; its retriever."""
    retriever = Retriever()
    rag_args = RagArgs(generator_deployment=generator, rerank_weight=0, **args)
    handles = {
        "retriever": LocalHandle(retriever),
        "generator": _generator(small, live, generator),
    }
    handler = RagHandler(rag_args, created=1, handles=handles)
    api = make_api("rag under test", "", MAX_BODY_BYTES)

    @api.post("/v1/chat/completions")
    async def chat(body: RagChatRequest) -> Any:
        return await handler.chat_response(body)

    return api, retriever


def _generate(small: Replicas, live: LiveReplicas) -> FastAPI:
    """/generate's own routes over the same small replicas and a router in-process."""
    router = _generator(small, live, "auto")
    return generate_api(GenerateHandler(small, None, GenerateArgs(large=None), router, created=1))


def _post(api: FastAPI, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/chat/completions", json=body, headers=headers)

    return asyncio.run(post())


def _chunks(response: httpx.Response) -> list[Any]:
    """A stream's payloads, ``[DONE]`` kept as the string."""
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    return [
        line.removeprefix("data: ") if line == "data: [DONE]" else json.loads(line[6:])
        for line in lines
    ]


# --- overload: the same 503 with Retry-After as /generate ---------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("generator", ["small", "router"])
def test_an_overloaded_generator_is_a_503_with_retry_after_as_on_generate(
    live: LiveReplicas, generator: str, stream: bool
) -> None:
    """Every replica refuses: /rag answers 503 ``overloaded`` with Retry-After, streamed or not,
    as /generate does for the same model (before, a /rag stream answered 200 and carried the
    refusal in-band, then ``[DONE]``)."""
    rag, _ = _rag(Replicas({"a": "full", "b": "full"}), live, generator)
    answer = _post(rag, {"messages": QUESTION, "stream": stream})
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "overloaded"
    assert float(answer.headers["retry-after"]) > 0
    assert "data:" not in answer.text

    model = "auto" if generator == "router" else "small"
    body = {"model": model, "messages": QUESTION, "stream": stream}
    generate = _post(_generate(Replicas({"a": "full", "b": "full"}), live), body)
    assert generate.status_code == answer.status_code
    assert generate.json()["error"]["code"] == answer.json()["error"]["code"]
    assert "retry-after" in generate.headers


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("generator", ["small", "router"])
def test_a_refusing_replica_is_retried_on_another_and_the_answer_cites(
    live: LiveReplicas, generator: str, stream: bool
) -> None:
    small = Replicas({"a": "full", "b": "ok"})
    rag, _ = _rag(small, live, generator)
    answer = _post(rag, {"messages": QUESTION, "stream": stream})
    assert answer.status_code == 200, answer.text
    assert small.calls == ["a", "b"]  # one loop: the ingress's for small, the router's for auto
    assert answer.headers["x-carpool-citations"] == "quillon,harbour"
    if generator == "router":  # the router's decision, as /generate reports it
        assert answer.headers["x-carpool-model"] == "small"
    if not stream:
        body = answer.json()
        assert body["choices"][0]["message"]["content"] == "from b" + SUFFIX
        assert body["citations"] == ["quillon", "harbour"]
        assert [s["doc_id"] for s in body["sources"]] == ["quillon", "harbour"]
        assert body["model"] == "small" and body["usage"]["total_tokens"] == 8
        assert ("carpool" in body) == (generator == "router")
        return
    chunks = _chunks(answer)
    assert chunks[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == "from b" + SUFFIX
    last = chunks[-2]
    assert last["citations"] == ["quillon", "harbour"]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert all("citations" not in c for c in chunks[:-2])


def test_a_stream_asked_for_usage_ends_with_it_after_the_cited_chunk(live: LiveReplicas) -> None:
    rag, _ = _rag(Replicas({"a": "ok"}), live)
    body = {"messages": QUESTION, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _chunks(_post(rag, body))
    usage, cited = chunks[-2], chunks[-3]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 8
    assert cited["citations"] == ["quillon", "harbour"]
    assert all(c["usage"] is None for c in chunks[:-2])


def test_a_stream_that_breaks_after_its_first_event_ends_with_the_generate_paths_error(
    live: LiveReplicas,
) -> None:
    small = Replicas({"a": "lost_mid_stream", "b": "ok"})
    rag, _ = _rag(small, live)
    answer = _post(rag, {"messages": QUESTION, "stream": True})
    assert answer.status_code == 200  # the role chunk went out: too late for a status
    chunks = _chunks(answer)
    assert chunks[-1]["error"]["code"] == "backend_unavailable"
    assert small.calls == ["a"] and small.cancelled == ["a"]  # never restarted, let go


# --- bad input: a 4xx naming the field, never a 200 stream ---------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_the_generator_refuses_is_a_400_naming_the_field(
    live: LiveReplicas, stream: bool
) -> None:
    rag, _ = _rag(TooLong({"a": "ok"}), live)
    answer = _post(rag, {"messages": QUESTION, "stream": stream})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages" and "Shorten it" in error["message"]


def test_max_tokens_over_the_limit_is_refused_before_retrieval(live: LiveReplicas) -> None:
    rag, retriever = _rag(Replicas({"a": "ok"}), live, max_tokens_limit=16)
    answer = _post(rag, {"messages": QUESTION, "max_tokens": 17, "stream": True})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "max_tokens"
    assert "16" in answer.json()["error"]["message"]
    assert retriever.searched == 0


def test_a_field_rag_cannot_honour_is_a_400_naming_it(live: LiveReplicas) -> None:
    rag, retriever = _rag(Replicas({"a": "ok"}), live)
    answer = _post(rag, {"messages": QUESTION, "n": 2, "stream": True})
    assert answer.status_code == 400 and "n is 2" in answer.json()["error"]["message"]
    assert retriever.searched == 0


# --- deadline: the first event is awaited within it ----------------------------------------


def test_a_stream_whose_first_event_misses_the_deadline_is_a_504(live: LiveReplicas) -> None:
    small = SlowStart(start_s=5.0)
    rag, _ = _rag(small, live)  # type: ignore[arg-type]
    headers = {"x-carpool-deadline-ms": "300"}
    answer = _post(rag, {"messages": QUESTION, "stream": True}, headers)
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "deadline_exceeded"
    assert small.cancelled == ["stream"]  # the generation is let go


# --- citations, pure --------------------------------------------------------------------


def _hits(*ids: str) -> list[SearchHit]:
    return [
        SearchHit(doc_id=i, chunk_id=0, text=f"text of {i}", score=1.0, retrieval_score=1.0)
        for i in ids
    ]


def _events(*texts: str) -> list[GenerationEvent]:
    deltas = [
        GenerationEvent("delta", text=t, finish_reason="length" if k == len(texts) - 1 else None)
        for k, t in enumerate(texts)
    ]
    return [GenerationEvent.start("small", 3), *deltas, GenerationEvent.end(3, len(texts))]


def test_citing_ends_the_finishing_chunk_with_the_suffix_and_the_ids() -> None:
    cite = citing(_hits("a", "b", "a"))
    assert cite.headers == {"x-carpool-citations": "a,b"}
    fmt = cite.stream(GeneratePath()._chat_chunks("small", 1, include_usage=True))
    chunks = [c for e in _events("one", "two", "") for c in fmt(e)]
    assert [c["choices"][0]["delta"]["content"] for c in chunks[:-1]] == [
        "",
        "one",
        "two",
        citation_suffix(["a", "b"]),
    ]
    assert [("citations" in c) for c in chunks] == [False, False, False, True, False]
    assert chunks[3]["citations"] == ["a", "b"]
    assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_citing_a_whole_answer_and_one_with_no_sources() -> None:
    body = {"choices": [{"message": {"content": "It is orange."}}]}
    citing(_hits("q")).whole(body)
    assert body["choices"][0]["message"]["content"] == "It is orange.\n\nSources: [q]"
    assert body["citations"] == ["q"] and body["sources"][0]["doc_id"] == "q"

    empty = {"choices": [{"message": {"content": "I do not know."}}]}
    citing([]).whole(empty)
    assert empty["choices"][0]["message"]["content"] == "I do not know."
    assert empty["citations"] == [] and empty["sources"] == []
    fmt = citing([]).stream(GeneratePath()._chat_chunks("small", 1, include_usage=False))
    last = [c for e in _events("x") for c in fmt(e)][-1]
    assert last["citations"] == [] and last["choices"][0]["delta"]["content"] == "x"
