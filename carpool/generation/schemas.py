"""Wire formats of ``/generate``: OpenAI-compatible completions and chat completions.

Requests forbid unknown fields, so a typo or an unsupported OpenAI option fails with a
message naming it instead of being silently ignored. Options OpenAI clients send with
neutral defaults (``n: 1``, penalties of 0, ``logprobs: false``...) are accepted at those
values and refused otherwise, with a message saying what to change.

``GenerationCall`` is the internal request an ingress sends to a generator replica (plain
text; the replica owns the tokenizer and the chat template).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

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


class _SamplingFields(_Request):
    """Fields completions and chat share."""

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
    n: int = Field(default=1, ge=1, le=MAX_N, description="Choices per prompt.")
    stream: bool = Field(default=False, description="Send tokens as server-sent events.")
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
    presence_penalty: float = Field(default=0.0, description="Only 0 is supported.")
    frequency_penalty: float = Field(default=0.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(default=None, description="Not supported.")
    ignore_eos: bool = Field(
        default=False,
        description="carpool extension: keep generating past end-of-sequence until "
        "max_tokens (benchmarks use it for exact lengths).",
    )

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop has {len(stops)} strings; send at most {MAX_STOP}")
        for i, s in enumerate(stops):
            if not s:
                raise ValueError(f"stop[{i}] is empty; remove it")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(
                    f"stop[{i}] has {len(s)} characters; send at most {MAX_STOP_CHARS}"
                )
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> _SamplingFields:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported; remove it or set it to 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported; remove it")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /generate/v1/completions``."""

    prompt: str | list[str] = Field(description="A prompt, or a list of prompts.")
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_HARD, description="Most tokens to generate."
    )
    echo: bool = Field(default=False, description="Only false is supported.")
    logprobs: int | None = Field(default=None, description="Not supported.")
    best_of: int | None = Field(default=None, description="Only 1 is supported.")
    suffix: str | None = Field(default=None, description="Not supported.")

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

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported; remove it or set it to false")
        if self.logprobs:
            raise ValueError("logprobs is not supported; remove it")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported; remove it or set it to 1")
        if self.suffix:
            raise ValueError("suffix is not supported; remove it")
        return self

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

    messages: list[ChatMessage] = Field(description="The conversation so far.")
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_HARD, description="Most tokens to generate."
    )
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_HARD, description="Same as max_tokens (newer name)."
    )
    logprobs: bool | None = Field(default=None, description="Only false is supported.")
    top_logprobs: int | None = Field(default=None, description="Not supported.")
    parallel_tool_calls: bool | None = Field(default=None, description="Ignored; accepted.")

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
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs is not supported; remove logprobs and top_logprobs")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError(
                f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                f"({self.max_completion_tokens}) differ; send only one of them"
            )
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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
    # From the HTTP request's x-carpool-deadline-ms / x-carpool-priority headers.
    deadline: float | None = None  # time.time() seconds
    priority: Literal["interactive", "batch"] = "interactive"

    @classmethod
    def from_completion(cls, body: CompletionRequest) -> GenerationCall:
        return cls(prompts=body.prompts(), **_sampling(body, body.max_tokens))

    @classmethod
    def from_chat(cls, body: ChatCompletionRequest) -> GenerationCall:
        messages = []
        for m in body.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name:
                message["name"] = m.name
            messages.append(message)
        return cls(messages=messages, **_sampling(body, body.token_limit()))


def _sampling(body: _SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    return {
        "n": body.n,
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "stop": body.stop_list(),
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
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
    logprobs: None = None


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
    logprobs: None = None


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
    logprobs: None = None


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
