"""The generate path: one generation call on one tier, run and answered over HTTP.

``/generate``'s handler (``pipelines.generate_handler.GenerateHandler``) and ``/rag``'s
(``pipelines.rag.RagHandler``) both run their calls and answer their chat through
``GeneratePath``, so what a client sees cannot drift between them:

- the call: a named tier retried on another replica when one refuses (``call_idempotent``);
  ``auto`` called once (``call_once``), since the router retries its own calls; both within
  the request's deadline, with its priority (``with_controls``);
- a stream answers only once its first event is in (``open_stream``): bad input and an
  overload refusal are then a plain 4xx, or a 503 with ``Retry-After``, never a 200 stream
  that carries them; a stream that breaks later ends with an error event and is cancelled;
- the formatting: OpenAI's chat answer and chunks, the usage chunk, the router's decision as
  the ``carpool`` field and the ``x-carpool-*`` headers.

What a pipeline adds to the chat answers formatted here (rag: its citations) is an
``Additions``; the path itself knows nothing of it.
"""

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from carpool.admission import current_controls
from carpool.calls import call_idempotent, call_once, open_stream
from carpool.error_body import error_response
from carpool.errors import RequestError, find_request_error
from carpool.generation.hops import GenerationEvent, GenerationResult, RouteDecision
from carpool.generation.logprobs import chat_logprobs
from carpool.generation.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ToolCallOut,
    UsageInfo,
    new_id,
    now,
)
from carpool.generation.schemas import GenerationCall
from carpool.generation.tools import ToolParser
from carpool.http import ClosingStreamingResponse

logger = logging.getLogger(__name__)

# The tier the router answers: it retries its own calls to the generators, so the handler
# calls it once (carpool.calls.call_once), never inside a second retry loop.
AUTO = "auto"

# A stream's formatter: given the model that answers, event -> the chunks it becomes.
EventFormat = Callable[[GenerationEvent], list[dict[str, Any]]]
Formatter = Callable[[str], EventFormat]
# Makes a per-choice tool-call parser (a request with tools in play).
ToolParsers = Callable[[], ToolParser]


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def decision_headers(decision: RouteDecision | None) -> dict[str, str]:
    """``x-carpool-*`` headers saying what the router decided (empty for explicit models)."""
    if decision is None:
        return {}
    return {
        f"x-carpool-{k.replace('_', '-')}": str(v)
        for k, v in decision.to_dict().items()
        if k != "reason"
    }


def answered_by(answer: GenerationResult | GenerationEvent, requested: str) -> str:
    """The model that answers: the router's choice for ``auto``, else the one asked for."""
    return answer.decision.model if answer.decision is not None else requested


def with_decision(
    body: dict[str, Any], decision: RouteDecision | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The JSON response, with the router's decision as its ``carpool`` field and headers."""
    if decision is not None:
        body["carpool"] = decision.to_dict()
    return JSONResponse(body, headers={**decision_headers(decision), **(headers or {})})


def with_controls(call: GenerationCall) -> GenerationCall:
    """The call as sent downstream, with this request's deadline and priority."""
    controls = current_controls()
    return call.model_copy(update={"deadline": controls.deadline, "priority": controls.priority})


def chat_logprobs_or_none(record: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if record is None else chat_logprobs(record)


def without_null_tool_calls(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI leaves ``tool_calls`` out of a message or delta that has none."""
    for choice in body.get("choices", []):
        for key in ("message", "delta"):
            part = choice.get(key)
            if isinstance(part, dict) and part.get("tool_calls") is None:
                part.pop("tool_calls", None)
    return body


def usage(counts: GenerationResult | GenerationEvent) -> UsageInfo:
    prompt, completion = counts.prompt_tokens, counts.completion_tokens
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def chat_answer(
    result: GenerationResult, requested: str, tools: ToolParsers | None = None
) -> dict[str, Any]:
    """A whole chat answer's body (OpenAI's ``chat.completion``), tool calls parsed out."""
    choices = []
    for c in result.choices:
        content, calls, reason = c.text, None, c.finish_reason
        if tools is not None:
            answer = tools().answer(c.text, c.finish_reason)
            content, reason = answer.content, answer.finish_reason
            calls = [ToolCallOut(**t) for t in answer.tool_calls] or None
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=content, tool_calls=calls),
                finish_reason=reason,
                logprobs=chat_logprobs_or_none(c.logprobs),
            )
        )
    response = ChatCompletionResponse(
        model=answered_by(result, requested), choices=choices, usage=usage(result)
    )
    return without_null_tool_calls(response.model_dump())


@dataclass(frozen=True)
class ChatForm:
    """The shape of a chat answer: streamed or whole, choices per prompt, a usage chunk, tools."""

    stream: bool = False
    n: int = 1
    include_usage: bool = False
    tools: ToolParsers | None = None


def _unchanged(body: dict[str, Any]) -> None:
    return None


def _as_is(fmt: EventFormat) -> EventFormat:
    return fmt


@dataclass(frozen=True)
class Additions:
    """What a pipeline adds to the chat answers the generate path formats (rag: citations).

    ``headers`` go on the response, whole or streamed; ``whole`` edits a whole answer's body in
    place before it goes out; ``stream`` wraps a stream's formatter (event -> chunks).
    """

    headers: dict[str, str] = field(default_factory=dict)
    whole: Callable[[dict[str, Any]], None] = _unchanged
    stream: Callable[[EventFormat], EventFormat] = _as_is


NOTHING_ADDED = Additions()


class GeneratePath:
    """Runs a generation call on one tier (a handle to a generator, or the router for
    ``auto``) and answers it: whole as JSON, or streamed as OpenAI's server-sent events.

    Stateless: its methods use nothing of the instance, so any handler mixes it in.
    """

    async def _call(self, tier: str, make_call: Callable[[], Any]) -> Any:
        """Calls a tier: a named model retried here (``call_idempotent``); ``auto`` once
        (``call_once``), since the router retries its own calls to the generators and a second
        loop around it would retry each refusal twice over and re-run its decision."""
        if tier == AUTO:
            return await call_once(tier, make_call)
        return await call_idempotent(tier, make_call)

    async def answer_chat(
        self,
        tier: str,
        handle: Any,
        requested: str,
        call: GenerationCall,
        form: ChatForm,
        additions: Additions = NOTHING_ADDED,
    ) -> Any:
        """Runs ``call`` on ``tier`` and answers it as OpenAI's chat: the whole answer as JSON,
        or, with ``form.stream``, the SSE response once the first event is in. ``requested``
        is the name the answer carries as ``model`` unless the router chose one."""
        payload = with_controls(call)
        if form.stream:

            def formatter(answered: str) -> EventFormat:
                chunks = self._chat_chunks(answered, form.n, form.include_usage, form.tools)
                return additions.stream(chunks)

            return await self._stream(
                tier, handle, payload, requested, formatter, additions.headers
            )
        result = await self._call(tier, lambda: handle.generate.remote(payload))
        body = chat_answer(result, requested, form.tools)
        additions.whole(body)
        return with_decision(body, result.decision, additions.headers)

    def _chat_chunks(
        self,
        model: str,
        n: int,
        include_usage: bool,
        tools: ToolParsers | None = None,
    ) -> EventFormat:
        chunk_id, created = new_id("chatcmpl"), now()
        parsers: dict[int, ToolParser] = {}

        def chunk(choices: list[ChatChunkChoice], counts: UsageInfo | None = None) -> dict:
            return without_null_tool_calls(
                ChatCompletionChunk(
                    id=chunk_id, created=created, model=model, choices=choices, usage=counts
                ).model_dump(exclude_none=False)
            )

        def tool_delta(event: GenerationEvent) -> list[dict[str, Any]]:
            # Content streams as it comes (auto mode), held back where it may open a tool
            # call; the calls go out whole, one delta each, with the finishing chunk.
            i = event.index
            parser = parsers.setdefault(i, tools())  # type: ignore[misc]
            text = parser.feed(event.text)
            logprobs = chat_logprobs_or_none(event.logprobs)
            if event.finish_reason is None:
                if not text and logprobs is None:
                    return []
                delta = ChatDelta(content=text) if text else ChatDelta()
                return [chunk([ChatChunkChoice(index=i, delta=delta, logprobs=logprobs)])]
            answer = parser.finish(event.finish_reason)
            out = []
            tail = (text or "") + (answer.content or "") if not answer.tool_calls else text
            if tail or logprobs is not None:
                delta = ChatDelta(content=tail) if tail else ChatDelta()
                out.append(chunk([ChatChunkChoice(index=i, delta=delta, logprobs=logprobs)]))
            calls = [{"index": k, **call} for k, call in enumerate(answer.tool_calls)]
            out.append(
                chunk(
                    [
                        ChatChunkChoice(
                            index=i,
                            delta=ChatDelta(tool_calls=calls or None),
                            finish_reason=answer.finish_reason,
                        )
                    ]
                )
            )
            return out

        def fmt(event: GenerationEvent) -> list[dict[str, Any]]:
            if event.type == "start":  # OpenAI opens each choice with the role
                return [
                    chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                    for i in range(n)
                ]
            if event.type == "delta" and tools is not None:
                return tool_delta(event)
            if event.type == "delta":
                delta = ChatDelta(content=event.text) if event.text else ChatDelta()
                return [
                    chunk(
                        [
                            ChatChunkChoice(
                                index=event.index,
                                delta=delta,
                                finish_reason=event.finish_reason,
                                logprobs=chat_logprobs_or_none(event.logprobs),
                            )
                        ]
                    )
                ]
            if event.type == "end" and include_usage:
                return [chunk([], usage(event))]
            return []

        return fmt

    async def _stream(
        self,
        tier: str,
        handle: Any,
        call: GenerationCall,
        requested: str,
        formatter: Formatter,
        headers: dict[str, str] | None = None,
    ) -> ClosingStreamingResponse:
        # The first event comes after the replica validated and queued the request, so bad
        # input still gets a plain 4xx response rather than an error inside a 200 stream, and
        # a replica's overload refusal is tried on another replica before any token exists
        # (here, or for `auto` in the router).
        events, first = await self._call(tier, lambda: open_stream(handle, call))
        sent = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        sent.update(decision_headers(first.decision))
        sent.update(headers or {})
        # 'auto': the router chose before generating and its start event says which model;
        # every chunk names that one, as a whole answer's `model` does.
        fmt = formatter(answered_by(first, requested))
        return ClosingStreamingResponse(
            self._sse(tier, first, events, fmt), media_type="text/event-stream", headers=sent
        )

    async def _sse(
        self,
        tier: str,
        first: GenerationEvent,
        events: Any,
        fmt: EventFormat,
    ) -> AsyncIterator[str]:
        finished = False
        try:
            for payload in fmt(first):
                yield sse(payload)
            async for event in events:
                for payload in fmt(event):
                    yield sse(payload)
            finished = True
            yield "data: [DONE]\n\n"
        except Exception as exc:
            found = find_request_error(exc)
            if found is None:
                logger.exception("%s stream failed", tier)
                found = RequestError(
                    503,
                    f"the {tier} stage failed mid-stream ({type(exc).__name__}); retry",
                    code="backend_unavailable",
                )
            body = json.loads(
                error_response(found.status_code, found.message, found.param, found.code).body
            )
            yield sse(body)
        finally:
            if not finished:
                # The client left (or the stream broke): stop the replica's generation so
                # its slot is freed at the next engine step.
                events.cancel()
