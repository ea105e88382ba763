"""Wire formats of ``/generate``: OpenAI-compatible completions and chat completions.

Requests forbid unknown fields, so a typo or an unsupported OpenAI option fails with a
message naming it instead of being silently ignored. OpenAI fields carpool cannot honour
(``tools``, ``response_format`` other than text, ``logit_bias``, vLLM's ``top_k``...) are
declared so their 400 says what to change; ``null`` and neutral values (``n: 1``,
``tool_choice: "none"``) are accepted, as OpenAI and vLLM accept them. ``logprobs``,
``top_logprobs`` and the presence and frequency penalties are honoured.

``GenerationCall`` is the internal request an ingress sends to a generator replica (plain
text; the replica owns the tokenizer and the chat template).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from carpool.generation.logprobs import MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS
from carpool.generation.sampling import MAX_PENALTY
from carpool.generation.structured import ConstraintError, OutputConstraint, canonical_schema
from carpool.schemas import WireRequest

# Hard caps on what one request may describe; deployments apply their own, lower limits.
MAX_TOKENS_HARD = 32_768
MAX_PROMPTS = 64
MAX_N = 16
MAX_SEQS_PER_CALL = 64  # prompts x n
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_PROMPT_CHARS = 400_000
MAX_MESSAGES = 512


class _Request(WireRequest):
    """Unknown fields, NaN/Infinity and lone surrogates are refused (see ``WireRequest``)."""


class StreamOptions(_Request):
    include_usage: bool = Field(
        default=False, description="Send a last chunk with token usage (and empty choices)."
    )


def _neutral(name: str, value: Any) -> bool:
    """True when a refused field's value asks for what carpool does anyway."""
    if value is None or value == [] or value == {}:
        return True
    return {
        "tool_choice": value == "none",
        "response_format": value == {"type": "text"},
        "modalities": value == ["text"],
        "store": value is False,
        "service_tier": value in ("auto", "default"),
        "top_k": value in (-1, 0),
        "min_p": value == 0,
        "repetition_penalty": value == 1,
        "min_tokens": value == 0,
        "suffix": value == "",
        "best_of": value == 1,
        "echo": value is False,
    }.get(name, False)


# OpenAI (and vLLM) fields carpool cannot honour, each with what to change. They are declared
# (not left to ``extra="forbid"``) so the 400 says why and what to do, and ``null`` or a
# neutral value (``tool_choice: "none"``, ``response_format: {"type": "text"}``...) passes.
UNSUPPORTED_SHARED = {
    "logit_bias": "logit_bias is not supported; remove it",
    "top_k": "top_k is not supported (sampling is temperature and top_p only); remove it or "
    "send -1",
    "min_p": "min_p is not supported (sampling is temperature and top_p only); remove it or send 0",
    "repetition_penalty": "repetition_penalty is not supported; remove it or send 1 "
    "(presence_penalty and frequency_penalty are supported)",
    "min_tokens": "min_tokens is not supported; remove it or send 0 (ignore_eos: true with "
    "max_tokens gives an exact length)",
    "service_tier": "service_tier is not supported; remove it",
    "store": "stored completions are not supported; remove store or send false",
    "metadata": "metadata is only kept with stored completions, which are not supported; remove it",
}
UNSUPPORTED_CHAT = {
    "functions": "functions (the legacy form of tools) is not supported; remove it and send "
    'the same definitions as tools ([{"type": "function", "function": {...}}])',
    "function_call": "function_call (the legacy form of tool_choice) is not supported; remove "
    "it and send tool_choice (none, auto, required or a named function)",
    "audio": "audio output is not supported; remove audio",
    "modalities": 'only text output is supported; remove modalities or send ["text"]',
    "prediction": "predicted outputs are not supported; remove prediction",
    "reasoning_effort": "these models do not reason in hidden steps; remove reasoning_effort",
    "web_search_options": "web search is not supported; remove web_search_options",
}
UNSUPPORTED_COMPLETION = {
    "echo": "echo is not supported; remove it or set it to false",
    "best_of": "best_of is not supported; remove it or set it to 1 (use n for several choices)",
    "suffix": "suffix (fill-in-the-middle) is not supported; remove it",
}


# --- structured output and tools -----------------------------------------------------------

# OpenAI's limits: 128 tools per request, names of letters, digits, '_' and '-' up to 64.
MAX_TOOLS = 128
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_DESCRIPTION_CHARS = 8192
MAX_TOOL_CALLS = 64  # tool calls one assistant message may carry
MAX_ARGUMENTS_CHARS = 65_536
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("none", "auto", "required")


def _checked_schema(value: Any, what: str) -> Any:
    """A JSON schema's shape, size and depth (compiling it is the generator's job)."""
    if value is None:
        return value
    try:
        canonical_schema(value)
    except ConstraintError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return value


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema the output must match (OpenAI's shape)."""

    name: str = Field(
        pattern=NAME_PATTERN, description="The format's name (letters, digits, _ and -, 1-64)."
    )
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] = Field(
        alias="schema",
        description="A JSON schema (an object); decoding is constrained to match it.",
    )
    strict: bool | None = Field(
        default=None,
        description="Accepted; the schema is always enforced (properties it does not declare "
        "are never generated).",
    )

    @field_validator("schema_")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _checked_schema(value, "the schema")


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"] = Field(
        description="'text' (free text), 'json_object' (any JSON object) or 'json_schema' "
        "(JSON matching json_schema.schema)."
    )
    json_schema: JsonSchemaFormat | None = Field(
        default=None, description="With type json_schema: the schema and its name."
    )

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        if value not in RESPONSE_FORMAT_TYPES:
            raise ValueError(
                f"response_format type {value!r} is not supported; send one of "
                f"{list(RESPONSE_FORMAT_TYPES)}"
            )
        return value

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "response_format type 'json_schema' needs json_schema: "
                '{"name": ..., "schema": {...}}; send it, or use type json_object'
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(
                f"response_format.json_schema is only read with type 'json_schema', not "
                f"{self.type!r}; remove it or change the type"
            )
        return self

    def constraint(self) -> OutputConstraint | None:
        if self.type == "json_object":
            return OutputConstraint.json_object()
        if self.type == "json_schema" and self.json_schema is not None:
            return OutputConstraint.json_schema(self.json_schema.schema_)
        return None


class FunctionDefinition(_Request):
    name: str = Field(
        pattern=NAME_PATTERN, description="Function name (letters, digits, _ and -, 1-64)."
    )
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = Field(
        default=None,
        description="JSON schema of the arguments; omitted: no arguments (an empty object).",
    )
    strict: bool | None = Field(
        default=None, description="Accepted; forced calls always match parameters."
    )

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _checked_schema(value, "the parameters schema")

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(_Request):
    type: Literal["function"] = Field(description="Only function tools exist.")
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str = Field(max_length=64, description="A function named in tools.")


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Request):
    name: str = Field(max_length=64)
    arguments: str = Field(
        default="{}", max_length=MAX_ARGUMENTS_CHARS, description="The arguments as JSON text."
    )


class ToolCallIn(_Request):
    """A tool call of an earlier assistant message (conversation history)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


def tool_call_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """What a ``required`` tool choice must produce: a JSON list of calls (vLLM's shape)."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters_schema(),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def check_stops(value: str | list[str] | None) -> str | list[str] | None:
    """OpenAI's ``stop``: at most ``MAX_STOP`` non-empty strings of bounded length."""
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOP:
        raise ValueError(f"stop has {len(stops)} strings; send at most {MAX_STOP}")
    for i, s in enumerate(stops):
        if not s:
            raise ValueError(f"stop[{i}] is empty; remove it")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop[{i}] has {len(s)} characters; send at most {MAX_STOP_CHARS}")
    return value


def check_token_limits(max_tokens: int | None, max_completion_tokens: int | None) -> None:
    """Chat's two names for one limit: either, or both when they agree."""
    if (
        max_tokens is not None
        and max_completion_tokens is not None
        and max_tokens != max_completion_tokens
    ):
        raise ValueError(
            f"max_tokens ({max_tokens}) and max_completion_tokens "
            f"({max_completion_tokens}) differ; send only one of them"
        )


def _refuse_with_constraint(data: dict[str, Any], param: str, value: str) -> None:
    """Fields that would break a constrained (JSON) output, refused by name.

    ``data``: the fields validated so far (``stop`` and ``ignore_eos`` come first).
    """
    stop = data.get("stop")
    if stop:
        raise ValueError(
            f"{param} {value!r} with stop: a stop string could cut the JSON the output must "
            "be; remove stop"
        )
    if data.get("ignore_eos"):
        raise ValueError(
            f"{param} {value!r} with ignore_eos: the output ends when its JSON is complete; "
            "remove ignore_eos"
        )


def _choice_label(choice: Any) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"function {choice.function.name}"
    return str(choice)


def _format_constraint(body: Any) -> tuple[OutputConstraint | None, str | None]:
    """The grammar ``response_format`` asks for, and that field's name (for errors)."""
    fmt = body.response_format
    constraint = fmt.constraint() if fmt is not None else None
    return constraint, ("response_format" if constraint is not None else None)


class _SamplingFields(_Request):
    """Fields completions and chat share. ``null`` means the default, as in OpenAI's API."""

    model: str | None = Field(
        default=None,
        max_length=256,
        description="'small' or 'large' (or a served model name); omitted: 'small'.",
    )
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description="0 is greedy; default 1.0 (OpenAI's)."
    )
    top_p: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Nucleus sampling mass; default 1.0."
    )
    n: int | None = Field(default=None, ge=1, le=MAX_N, description="Choices per prompt; 1.")
    stream: bool | None = Field(default=None, description="Send tokens as server-sent events.")
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        default=None, description=f"Up to {MAX_STOP} strings that end the generation."
    )
    seed: int | None = Field(
        default=None,
        ge=-(2**63),
        lt=2**63,
        description="Makes sampling repeatable (each choice i uses seed + i).",
    )
    user: str | None = Field(default=None, max_length=256, description="Ignored; accepted.")
    presence_penalty: float | None = Field(
        default=None,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="Lowers the logit of every token already generated by this much.",
    )
    frequency_penalty: float | None = Field(
        default=None,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="Lowers each token's logit by this much per time it was generated.",
    )
    ignore_eos: bool | None = Field(
        default=None,
        description="carpool extension: keep generating past end-of-sequence until "
        "max_tokens (benchmarks use it for exact lengths).",
    )
    # Refused unless null or neutral (see UNSUPPORTED_SHARED); typed Any so the refusal,
    # not a type error, is what the client reads.
    logit_bias: Any = Field(default=None, description="Not supported.")
    top_k: Any = Field(default=None, description="Not supported (vLLM extension).")
    min_p: Any = Field(default=None, description="Not supported (vLLM extension).")
    repetition_penalty: Any = Field(default=None, description="Not supported (vLLM).")
    min_tokens: Any = Field(default=None, description="Not supported (vLLM extension).")
    response_format: ResponseFormat | None = Field(
        default=None,
        description='{"type": "text"} (default), {"type": "json_object"} or {"type": '
        '"json_schema", "json_schema": {"name", "schema", "strict"}}: JSON output is '
        "guaranteed by constrained decoding.",
    )
    service_tier: Any = Field(default=None, description="Only null, auto or default.")
    store: Any = Field(default=None, description="Only false.")
    metadata: Any = Field(default=None, description="Not supported.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        return check_stops(value)

    _unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_SHARED

    @field_validator("*")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuses a field carpool cannot honour; a field validator, so the 400 names it."""
        name = info.field_name or ""
        why = cls._unsupported_fields.get(name)
        if why is not None and not _neutral(name, value):
            raise ValueError(why)
        return value

    @model_validator(mode="after")
    def _stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true; remove it")
        return self

    @field_validator("response_format")
    @classmethod
    def _constrained_output(
        cls, value: ResponseFormat | None, info: ValidationInfo
    ) -> ResponseFormat | None:
        if value is not None and value.type != "text":
            _refuse_with_constraint(info.data, "response_format", value.type)
        return value

    def choices_per_prompt(self) -> int:
        return self.n or 1

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /generate/v1/completions``."""

    _unsupported_fields: ClassVar[dict[str, str]] = {
        **UNSUPPORTED_SHARED,
        **UNSUPPORTED_COMPLETION,
    }

    prompt: str | list[str] = Field(description="A prompt, or a list of prompts.")
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_HARD, description="Most tokens to generate."
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_COMPLETION_LOGPROBS,
        description="Return each token's logprob and this many most likely alternatives "
        f"(0 to {MAX_COMPLETION_LOGPROBS}); null returns none.",
    )
    echo: Any = Field(default=None, description="Only false is supported.")
    best_of: Any = Field(default=None, description="Only 1 is supported.")
    suffix: Any = Field(default=None, description="Not supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_prompts(cls, value: Any) -> Any:
        """Token-id prompts get a message saying so, not pydantic's type dump."""
        items = value if isinstance(value, list) else [value]
        if any(isinstance(i, (int, list)) for i in items):
            raise ValueError(
                "prompt as token ids is not supported; send the prompt as text (a string or "
                "a list of strings)"
            )
        return value

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: str | list[str]) -> str | list[str]:
        prompts = [value] if isinstance(value, str) else value
        if not prompts:
            raise ValueError("prompt is an empty list; send at least one prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt has {len(prompts)} items; send at most {MAX_PROMPTS}")
        for i, text in enumerate(prompts):
            if not text:
                raise ValueError(f"prompt[{i}] is empty; send some text to continue")
            if len(text) > MAX_PROMPT_CHARS:
                raise ValueError(
                    f"prompt[{i}] has {len(text)} characters; send at most {MAX_PROMPT_CHARS}"
                )
        return value

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class TextPart(_Request):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(
        default=None, max_length=256, description="role tool: the call this answers."
    )
    tool_calls: list[ToolCallIn] | None = Field(
        default=None,
        max_length=MAX_TOOL_CALLS,
        description="role assistant: the tool calls it made (conversation history).",
    )

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(
                f"tool_calls is only allowed on assistant messages, not {self.role!r}; remove it"
            )
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /generate/v1/chat/completions``."""

    _unsupported_fields: ClassVar[dict[str, str]] = {**UNSUPPORTED_SHARED, **UNSUPPORTED_CHAT}

    messages: list[ChatMessage] = Field(description="The conversation so far.")
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_HARD, description="Most tokens to generate."
    )
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_HARD, description="Same as max_tokens (newer name)."
    )
    logprobs: bool | None = Field(
        default=None, description="Return each output token's logprob (in choice.logprobs)."
    )
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_CHAT_TOP_LOGPROBS,
        description="With logprobs: true, this many most likely alternatives per token.",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="Accepted; means nothing without tools."
    )
    tools: list[Tool] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description="Functions the model may call; rendered through the model's chat template.",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="'none', 'auto' (default with tools: the model decides), 'required' (at "
        'least one call) or {"type": "function", "function": {"name": ...}} (that call).',
    )
    functions: Any = Field(default=None, description="Not supported.")
    function_call: Any = Field(default=None, description="Not supported.")
    audio: Any = Field(default=None, description="Not supported.")
    modalities: Any = Field(default=None, description='Only ["text"].')
    prediction: Any = Field(default=None, description="Not supported.")
    reasoning_effort: Any = Field(default=None, description="Not supported.")
    web_search_options: Any = Field(default=None, description="Not supported.")

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages is empty; send at least one message (role user)")
        if len(value) > MAX_MESSAGES:
            raise ValueError(f"messages has {len(value)} items; send at most {MAX_MESSAGES}")
        total = sum(len(m.text()) for m in value)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(
                f"messages hold {total} characters; send at most {MAX_PROMPT_CHARS} in all"
            )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_choice(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in TOOL_CHOICES:
            raise ValueError(
                f"tool_choice {value!r} is not supported; send one of {list(TOOL_CHOICES)} or "
                '{"type": "function", "function": {"name": ...}}'
            )
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in value or []]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"tools name the function(s) {dup} more than once; name each once")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_fits_tools(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        label = _choice_label(value)
        if value not in (None, "none") and not names:
            raise ValueError(
                f"tool_choice is {label!r} but there are no tools; send tools or remove tool_choice"
            )
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(
                f"tool_choice names function {value.function.name!r}, which is not in tools "
                f"({names}); name one of them"
            )
        if value == "required" or isinstance(value, NamedToolChoice):
            _refuse_with_constraint(info.data, "tool_choice", label)
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> ChatCompletionRequest:
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.tool_mode() != "none":
            raise ValueError(
                f"response_format {fmt.type!r} and tools with tool_choice "
                f"{_choice_label(self.tool_choice or 'auto')!r} cannot both hold: send one of "
                "them (or tool_choice 'none' with response_format)"
            )
        return self

    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """What the tools ask: none (or no tools), auto, required, or one named function."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice is None or self.tool_choice == "auto":
            return "auto"
        if self.tool_choice == "required":
            return "required"
        return "named"

    def constraint(self) -> tuple[OutputConstraint | None, str | None]:
        """The grammar the output must follow and the field it comes from (for errors)."""
        mode = self.tool_mode()
        if mode == "required":
            schema = tool_call_schema(self.tools or [], self.parallel_tool_calls is not False)
            return OutputConstraint.json_schema(schema), "tools"
        if mode == "named":
            name = self.tool_choice.function.name  # type: ignore[union-attr]
            tool = next(t for t in self.tools or [] if t.function.name == name)
            return OutputConstraint.json_schema(tool.function.parameters_schema()), "tools"
        return _format_constraint(self)

    @model_validator(mode="after")
    def _chat_only(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(
                f"top_logprobs is {self.top_logprobs} but logprobs is not true; send "
                "logprobs: true with it, or remove top_logprobs"
            )
        check_token_limits(self.max_tokens, self.max_completion_tokens)
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_asked(self) -> int | None:
        """Alternatives per token when logprobs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerationCall(BaseModel):
    """What an ingress sends a generator replica: text in, sampling knobs, no HTTP."""

    prompts: list[str] = Field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    # None: no logprobs; k: each token's logprob and its k most likely alternatives.
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # From the HTTP request's x-carpool-deadline-ms / x-carpool-priority headers.
    deadline: float | None = None  # time.time() seconds
    priority: Literal["interactive", "batch"] = "interactive"
    # The router's predicted output length (never from HTTP): an engine with its own
    # priority queue (vLLM) orders waiting requests by it, shortest first with aging.
    predicted_tokens: float | None = None
    # Structured output (structured.OutputConstraint.to_dict()): the grammar every choice must
    # follow, and the request field it came from (response_format or tools), for errors.
    constraint: dict[str, Any] | None = None
    constraint_param: str | None = None
    # Tools to render through the chat template (OpenAI's tool dicts); None: no tools.
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def from_completion(cls, body: CompletionRequest) -> GenerationCall:
        constraint, param = _format_constraint(body)
        return cls(
            prompts=body.prompts(),
            logprobs=body.logprobs,
            constraint=constraint.to_dict() if constraint else None,
            constraint_param=param,
            **_sampling(body, body.max_tokens),
        )

    @classmethod
    def from_chat(cls, body: ChatCompletionRequest) -> GenerationCall:
        messages = []
        for m in body.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name:
                message["name"] = m.name
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            messages.append(message)
        constraint, param = body.constraint()
        tools = None
        if body.tool_mode() != "none":  # tool_choice "none": the answer is text, no tools shown
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        return cls(
            messages=messages,
            logprobs=body.logprobs_asked(),
            constraint=constraint.to_dict() if constraint else None,
            constraint_param=param,
            tools=tools,
            **_sampling(body, body.token_limit()),
        )


def _sampling(body: _SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    return {
        "n": body.choices_per_prompt(),
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "stop": body.stop_list(),
        "seed": body.seed,
        "ignore_eos": bool(body.ignore_eos),
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
    }


# --- responses -----------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str] = Field(description="{'name': ..., 'arguments': JSON text}.")


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # OpenAI's streamed tool calls: [{index, id, type, function: {name, arguments}}].
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "carpool"
    root: str = Field(description="The model behind this name.")
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
