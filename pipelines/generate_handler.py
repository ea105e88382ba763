"""The generate pipeline's request handling: route by ``model``, answer whole or as SSE.

``GenerateHandler`` answers over handles to the generators (and the router, which the
generate app's ingress hosts in-process; other apps reach it through
``pipelines.router_access``): the generate app's ingress, the generator replica that serves
its own HTTP (direct streaming) and the OpenAI app (``pipelines.openai_api``) all answer
with it, so a request is checked, routed
and formatted the same whichever URL and process it came in by.
"""

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import Field, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

from carpool.admission import current_controls
from carpool.calls import call_backend, call_idempotent, call_once, open_stream
from carpool.config import IngressConfig, ModelSourceConfig, StrictModel
from carpool.error_body import error_response
from carpool.errors import RequestError, find_request_error
from carpool.generation.config import DEFAULT_LARGE, DEFAULT_SMALL, GeneratorConfig
from carpool.generation.hops import GenerationEvent, GenerationResult, RouteDecision
from carpool.generation.logprobs import chat_logprobs, completion_logprobs
from carpool.generation.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    ToolCallOut,
    UsageInfo,
    new_id,
    now,
)
from carpool.generation.schemas import ChatCompletionRequest, CompletionRequest, GenerationCall
from carpool.generation.tool_schemas import NamedToolChoice
from carpool.generation.tools import ToolParser
from carpool.http import ClosingStreamingResponse
from carpool.schemas import ModelCard
from pipelines.handler import PipelineHandler
from pipelines.placement import PlacementArgs
from pipelines.router_access import router_handle
from router.config import RouterConfig

logger = logging.getLogger(__name__)

TIERS = ("small", "large")
# The tier the router answers: it retries its own calls to the generators, so the handler
# calls it once (carpool.calls.call_once), never inside a second retry loop.
AUTO = "auto"
# Deployment names other apps find this pipeline's parts by (serve.get_deployment_handle); the
# generators are named by their tier.
GENERATE_INGRESS = "generate_ingress"
# With direct_streaming the small generator is the app's ingress, under its tier's name.
DIRECT_INGRESS = "small"


class GenerateArgs(StrictModel):
    """Arguments of the generate pipeline (the ``args:`` of its serve config entry)."""

    small: GeneratorConfig = Field(
        default_factory=lambda: GeneratorConfig(source=ModelSourceConfig(model=DEFAULT_SMALL)),
        description="The small generator (default SmolLM2-135M-Instruct).",
    )
    large: GeneratorConfig | None = Field(
        default_factory=lambda: GeneratorConfig(source=ModelSourceConfig(model=DEFAULT_LARGE)),
        description="The large generator (default Qwen2.5-Coder-0.5B-Instruct); null "
        "deploys only the small one.",
    )
    default_model: Literal["small", "large", "auto"] = Field(
        default="small", description="Model used when a request omits `model`."
    )
    router: RouterConfig | None = Field(
        default_factory=RouterConfig,
        description='The router behind `model: "auto"` (length prediction, lanes, '
        "small/large choice); null serves explicit models only.",
    )
    direct_streaming: bool = Field(
        default=False,
        description="The small generator's replicas serve this app's HTTP themselves (Ray "
        "Serve LLM's direct streaming): a small answer's tokens go replica -> proxy -> "
        "client, one process hop fewer than through the separate ingress. Requests for "
        "large and auto are answered by those replicas too, over handles, so HTTP capacity "
        "follows small's replica count and a busy small replica delays them: off in the "
        "cluster configs (docs/generation.md, Direct streaming). `ingress` then only sets "
        "the default deadline.",
    )
    placement: PlacementArgs = Field(
        default_factory=PlacementArgs,
        description="Which small replica a request reaches (pipelines.placement): HAProxy's "
        "leastconn, or carpool's cost router (prefix cache, queued work, output length).",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @model_validator(mode="after")
    def _one_queue_order(self) -> "GenerateArgs":
        # One owner per queue order: the router's lanes put `auto` requests in
        # shortest-predicted-first order (with aging) before they reach a generator; vLLM's
        # priority scheduling would order the same requests a second time, with aging and
        # bounds of its own.
        if self.router is None or not self.router.lanes_enabled:
            return self
        for tier, cfg in (("small", self.small), ("large", self.large)):
            if cfg is not None and cfg.mode == "vllm" and cfg.vllm.priority_scheduling:
                raise ValueError(
                    f"router.lanes_enabled (true) and {tier}.vllm.priority_scheduling (true) "
                    "both order `auto` requests by predicted length, in two queues; keep one: "
                    f"set {tier}.vllm.priority_scheduling: false where the router caps what "
                    "it hands a replica (router.max_in_flight_per_replica: its lanes hold the "
                    "backlog, as in serve.yaml), or router.lanes_enabled: false where it does "
                    "not (the backlog waits in vLLM's queue; docs/vllm.md, Priority)"
                )
        return self


# A stream's formatter: given the model that answers, event -> the chunks it becomes.
EventFormat = Callable[[GenerationEvent], list[dict[str, Any]]]
Formatter = Callable[[str], EventFormat]


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


def _answered_by(answer: GenerationResult | GenerationEvent, requested: str) -> str:
    """The model that answers: the router's choice for ``auto``, else the one asked for."""
    return answer.decision.model if answer.decision is not None else requested


def _with_decision(body: dict[str, Any], decision: RouteDecision | None) -> JSONResponse:
    """The JSON response, with the router's decision as its ``carpool`` field and headers."""
    if decision is not None:
        body["carpool"] = decision.to_dict()
    return JSONResponse(body, headers=decision_headers(decision))


def with_controls(call: GenerationCall) -> GenerationCall:
    """The call as sent downstream, with this request's deadline and priority."""
    controls = current_controls()
    return call.model_copy(update={"deadline": controls.deadline, "priority": controls.priority})


def _chat_logprobs(record: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if record is None else chat_logprobs(record)


def tool_parser(body: ChatCompletionRequest) -> Callable[[], ToolParser] | None:
    """Makes a per-choice tool-call parser when the request has tools in play, else None."""
    mode = body.tool_mode()
    if mode == "none":
        return None
    names = [t.function.name for t in body.tools or []]
    named = (
        body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    )
    return lambda: ToolParser(mode, names, named)


def _without_null_tool_calls(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI leaves ``tool_calls`` out of a message or delta that has none."""
    for choice in body.get("choices", []):
        for key in ("message", "delta"):
            part = choice.get(key)
            if isinstance(part, dict) and part.get("tool_calls") is None:
                part.pop("tool_calls", None)
    return body


def _usage(counts: GenerationResult | GenerationEvent) -> UsageInfo:
    prompt, completion = counts.prompt_tokens, counts.completion_tokens
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def model_aliases(args: GenerateArgs) -> dict[str, str]:
    """Every name ``model`` may take in this app -> the tier that answers it: the tiers
    (``small``, ``large`` when configured, ``auto`` with a router) and the served names behind
    them. Pure, so the HAProxy routes (pipelines.direct_routes) match what the app serves."""
    configs = {"small": args.small}
    if args.large is not None:
        configs["large"] = args.large
    tiers = [*configs, *(["auto"] if args.router is not None else [])]
    aliases = {tier: tier for tier in tiers}
    for tier, cfg in configs.items():
        # Clients may name a tier or the model behind it; a tier's own name wins.
        aliases.setdefault(cfg.source.served_model_name or tier, tier)
    return aliases


class GenerateHandler(PipelineHandler):
    """The generate pipeline's request handling over its generator (and router) handles.

    The generate app's ingress and the OpenAI app (``pipelines.openai_api``) both answer with
    it, so a request is checked, routed to a tier and answered (or streamed) the same whichever
    URL it came in by.
    """

    def __init__(
        self,
        small: DeploymentHandle,
        large: DeploymentHandle | None,
        args: GenerateArgs,
        router: DeploymentHandle | None = None,
        created: int | None = None,
    ) -> None:
        self.args = args
        self.created = created or now()
        self.handles: dict[str, DeploymentHandle] = {"small": small}
        configs: dict[str, GeneratorConfig] = {"small": self.args.small}
        if large is not None and self.args.large is not None:
            self.handles["large"] = large
            configs["large"] = self.args.large
        self.configs = configs
        if router is not None:
            # "auto": the router picks small or large per request (and may escalate).
            self.handles[AUTO] = router
        self.aliases = {
            name: tier for name, tier in model_aliases(args).items() if tier in self.handles
        }
        self._described: dict[str, dict[str, Any]] = {}

    def _route(self, requested: str | None) -> tuple[str, DeploymentHandle, str]:
        name = requested or self.args.default_model
        tier = self.aliases.get(name)
        if tier is None:
            raise RequestError(
                404,
                f"model {name!r} is not served here; use one of {sorted(self.aliases)}",
                param="model",
                code="model_not_found",
            )
        return tier, self.handles[tier], name

    @classmethod
    def attach(cls, app: str, settings: dict[str, Any]) -> "GenerateHandler":
        """The handler of a running generate app, from its ingress's ``settings()``."""
        args = GenerateArgs.model_validate(settings["args"])

        def handle(tier: str) -> DeploymentHandle:
            return serve.get_deployment_handle(tier, app_name=app)

        return cls(
            handle("small"),
            handle("large") if args.large is not None else None,
            args,
            router_handle(app) if args.router is not None else None,
            settings["created"],
        )

    def served_names(self) -> list[str]:
        """Every name ``model`` may take here: the tiers and the served names behind them."""
        return sorted(self.aliases)

    # --- completions ----------------------------------------------------------------------

    async def _generate(
        self, requested: str | None, call: GenerationCall, formatter: Formatter | None
    ) -> tuple[Any, str]:
        """The SSE response when ``formatter`` is given, else the whole result; and the name
        the client asked for."""
        tier, handle, model = self._route(requested)
        payload = with_controls(call)
        if formatter is not None:
            return await self._stream(tier, handle, payload, model, formatter), model
        return await self._call(tier, lambda: handle.generate.remote(payload)), model

    async def _call(self, tier: str, make_call: Callable[[], Any]) -> Any:
        """Calls a tier: a named model retried here (``call_idempotent``); ``auto`` once
        (``call_once``), since the router retries its own calls to the generators and a second
        loop around it would retry each refusal twice over and re-run its decision."""
        if tier == AUTO:
            return await call_once(tier, make_call)
        return await call_idempotent(tier, make_call)

    async def completion_response(self, body: CompletionRequest) -> Any:
        def formatter(answered: str) -> EventFormat:
            return self._completion_chunks(answered, body.include_usage())

        call = GenerationCall.from_completion(body)
        result, model = await self._generate(body.model, call, formatter if body.stream else None)
        if body.stream:
            return result
        response = CompletionResponse(
            model=_answered_by(result, model),
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    logprobs=None if c.logprobs is None else completion_logprobs(c.logprobs),
                )
                for c in result.choices
            ],
            usage=_usage(result),
        )
        return _with_decision(response.model_dump(), result.decision)

    def _completion_chunks(self, model: str, include_usage: bool) -> EventFormat:
        chunk_id, created = new_id("cmpl"), now()
        # Characters each choice has streamed so far: where its next token's text_offset is.
        offsets: dict[int, int] = {}

        def chunk(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
            return {
                "id": chunk_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage,
            }

        def fmt(event: GenerationEvent) -> list[dict[str, Any]]:
            if event.type == "delta":
                logprobs = None
                record = event.logprobs
                if record is not None:
                    start = offsets.get(event.index, 0)
                    logprobs = completion_logprobs(record, start)
                    offsets[event.index] = start + sum(len(t) for t in record["tokens"])
                return [
                    chunk(
                        [
                            {
                                "index": event.index,
                                "text": event.text,
                                "finish_reason": event.finish_reason,
                                "logprobs": logprobs,
                            }
                        ]
                    )
                ]
            if event.type == "end" and include_usage:
                return [chunk([], _usage(event).model_dump())]
            return []

        return fmt

    # --- chat -----------------------------------------------------------------------------

    async def chat_response(self, body: ChatCompletionRequest) -> Any:
        def formatter(answered: str) -> EventFormat:
            n, usage = body.choices_per_prompt(), body.include_usage()
            return self._chat_chunks(answered, n, usage, tool_parser(body))

        call = GenerationCall.from_chat(body)
        result, model = await self._generate(body.model, call, formatter if body.stream else None)
        if body.stream:
            return result
        parser = tool_parser(body)
        choices = []
        for c in result.choices:
            content, calls, reason = c.text, None, c.finish_reason
            if parser is not None:
                answer = parser().answer(c.text, c.finish_reason)
                content, reason = answer.content, answer.finish_reason
                calls = [ToolCallOut(**t) for t in answer.tool_calls] or None
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatMessageOut(content=content, tool_calls=calls),
                    finish_reason=reason,
                    logprobs=_chat_logprobs(c.logprobs),
                )
            )
        response = ChatCompletionResponse(
            model=_answered_by(result, model), choices=choices, usage=_usage(result)
        )
        return _with_decision(_without_null_tool_calls(response.model_dump()), result.decision)

    def _chat_chunks(
        self,
        model: str,
        n: int,
        include_usage: bool,
        tools: Callable[[], ToolParser] | None = None,
    ) -> EventFormat:
        chunk_id, created = new_id("chatcmpl"), now()
        parsers: dict[int, ToolParser] = {}

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> dict:
            return _without_null_tool_calls(
                ChatCompletionChunk(
                    id=chunk_id, created=created, model=model, choices=choices, usage=usage
                ).model_dump(exclude_none=False)
            )

        def tool_delta(event: GenerationEvent) -> list[dict[str, Any]]:
            # Content streams as it comes (auto mode), held back where it may open a tool
            # call; the calls go out whole, one delta each, with the finishing chunk.
            i = event.index
            parser = parsers.setdefault(i, tools())  # type: ignore[misc]
            text = parser.feed(event.text)
            logprobs = _chat_logprobs(event.logprobs)
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
                                logprobs=_chat_logprobs(event.logprobs),
                            )
                        ]
                    )
                ]
            if event.type == "end" and include_usage:
                return [chunk([], _usage(event))]
            return []

        return fmt

    # --- streaming ------------------------------------------------------------------------

    async def _stream(
        self,
        tier: str,
        handle: DeploymentHandle,
        call: GenerationCall,
        requested: str,
        formatter: Formatter,
    ) -> ClosingStreamingResponse:
        # The first event comes after the replica validated and queued the request, so bad
        # input still gets a plain 4xx response rather than an error inside a 200 stream, and
        # a replica's overload refusal is tried on another replica before any token exists
        # (here, or for `auto` in the router).
        events, first = await self._call(tier, lambda: open_stream(handle, call))
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        headers.update(decision_headers(first.decision))
        # 'auto': the router chose before generating and its start event says which model;
        # every chunk names that one, as a whole answer's `model` does.
        fmt = formatter(_answered_by(first, requested))
        return ClosingStreamingResponse(
            self._sse(tier, first, events, fmt), media_type="text/event-stream", headers=headers
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

    async def model_cards(self) -> list[ModelCard]:
        """One card per tier (small, large, auto), with the model behind it."""
        cards = []
        for tier, handle in self.handles.items():
            if tier not in self._described:
                self._described[tier] = await call_backend(tier, handle.describe.remote())
            info = self._described[tier]
            cards.append(
                ModelCard(
                    id=tier,
                    created=self.created,
                    root=info["model"],
                    max_model_len=info["max_seq_len"],
                )
            )
        return cards
