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
    "response_format": "structured output is not supported: the model answers free text; "
    'remove response_format or send {"type": "text"}',
    "service_tier": "service_tier is not supported; remove it",
    "store": "stored completions are not supported; remove store or send false",
    "metadata": "metadata is only kept with stored completions, which are not supported; remove it",
}
UNSUPPORTED_CHAT = {
    "tools": "tool calling is not supported; remove tools (describe the tool in a message "
    "and parse the answer yourself)",
    "tool_choice": 'tool calling is not supported; remove tool_choice or send "none"',
    "functions": "function calling is not supported; remove functions",
    "function_call": 'function calling is not supported; remove function_call or send "none"',
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
    response_format: Any = Field(default=None, description='Only {"type": "text"}.')
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
    tool_call_id: str | None = Field(default=None, max_length=256)

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
    tools: Any = Field(default=None, description="Not supported.")
    tool_choice: Any = Field(default=None, description='Only "none".')
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

    @classmethod
    def from_completion(cls, body: CompletionRequest) -> GenerationCall:
        return cls(
            prompts=body.prompts(), logprobs=body.logprobs, **_sampling(body, body.max_tokens)
        )

    @classmethod
    def from_chat(cls, body: ChatCompletionRequest) -> GenerationCall:
        messages = []
        for m in body.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name:
                message["name"] = m.name
            messages.append(message)
        return cls(
            messages=messages,
            logprobs=body.logprobs_asked(),
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


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
