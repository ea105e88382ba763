"""The generate pipeline's request handling: route by ``model`` to a tier, answer on it.

``GenerateHandler`` answers over handles to the generators (and the router, which the
generate app's ingress hosts in-process; other apps reach it through
``pipelines.router_access``): the generate app's ingress, the generator replica that serves
its own HTTP (direct streaming) and the OpenAI app (``pipelines.openai_api``) all answer
with it, so a request is checked, routed and formatted the same whichever URL and process it
came in by. Running a call on a tier and formatting its answer is the generate path
(``pipelines.generate_path``), which ``/rag`` answers through too.
"""

from typing import Any, Literal

from pydantic import Field, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

from carpool.calls import call_backend
from carpool.config import IngressConfig, ModelSourceConfig, StrictModel
from carpool.errors import RequestError
from carpool.generation.config import DEFAULT_LARGE, DEFAULT_SMALL, GeneratorConfig
from carpool.generation.hops import GenerationEvent
from carpool.generation.logprobs import completion_logprobs
from carpool.generation.responses import CompletionChoice, CompletionResponse, new_id, now
from carpool.generation.schemas import ChatCompletionRequest, CompletionRequest, GenerationCall
from carpool.generation.tool_schemas import NamedToolChoice
from carpool.generation.tools import ToolParser
from carpool.schemas import ModelCard
from pipelines.generate_path import (
    AUTO,
    ChatForm,
    EventFormat,
    Formatter,
    GeneratePath,
    ToolParsers,
    answered_by,
    usage,
    with_controls,
    with_decision,
)
from pipelines.handler import PipelineHandler
from pipelines.placement import PlacementArgs
from pipelines.router_access import router_handle
from router.config import RouterConfig

TIERS = ("small", "large")
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


def tool_parser(body: ChatCompletionRequest) -> ToolParsers | None:
    """Makes a per-choice tool-call parser when the request has tools in play, else None."""
    mode = body.tool_mode()
    if mode == "none":
        return None
    names = [t.function.name for t in body.tools or []]
    named = (
        body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    )
    return lambda: ToolParser(mode, names, named)


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


class GenerateHandler(GeneratePath, PipelineHandler):
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

    async def completion_response(self, body: CompletionRequest) -> Any:
        def formatter(answered: str) -> EventFormat:
            return self._completion_chunks(answered, body.include_usage())

        call = GenerationCall.from_completion(body)
        result, model = await self._generate(body.model, call, formatter if body.stream else None)
        if body.stream:
            return result
        response = CompletionResponse(
            model=answered_by(result, model),
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    logprobs=None if c.logprobs is None else completion_logprobs(c.logprobs),
                )
                for c in result.choices
            ],
            usage=usage(result),
        )
        return with_decision(response.model_dump(), result.decision)

    def _completion_chunks(self, model: str, include_usage: bool) -> EventFormat:
        chunk_id, created = new_id("cmpl"), now()
        # Characters each choice has streamed so far: where its next token's text_offset is.
        offsets: dict[int, int] = {}

        def chunk(choices: list[dict[str, Any]], counts: Any = None) -> dict[str, Any]:
            return {
                "id": chunk_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": counts,
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
                return [chunk([], usage(event).model_dump())]
            return []

        return fmt

    # --- chat -----------------------------------------------------------------------------

    async def chat_response(self, body: ChatCompletionRequest) -> Any:
        call = GenerationCall.from_chat(body)
        tier, handle, model = self._route(body.model)
        form = ChatForm(
            stream=bool(body.stream),
            n=body.choices_per_prompt(),
            include_usage=body.include_usage(),
            tools=tool_parser(body),
        )
        return await self.answer_chat(tier, handle, model, call, form)

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
