"""``POST /rag/v1/chat/completions``'s request: OpenAI's chat shape, each field honoured or
refused by name, and the generator call it becomes."""

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from carpool.generation.schemas import (
    MAX_STOP,
    StreamOptions,
    check_stops,
    check_token_limits,
)
from carpool.generation.tool_schemas import TextPart
from carpool.schemas import WireRequest

UNSUPPORTED_FIELDS = {
    "tools": "tool calling is not supported by /rag; remove tools (use /generate)",
    "tool_choice": "tool calling is not supported by /rag; remove tool_choice",
    "functions": "function calling is not supported by /rag; remove functions",
    "function_call": "function calling is not supported by /rag; remove function_call",
    "response_format": "structured output is not supported by /rag: answers are cited "
    "text; remove response_format",
    "logit_bias": "logit_bias is not supported by /rag; remove it",
    "top_logprobs": "logprobs are not supported by /rag; remove top_logprobs",
    "audio": "audio output is not supported; remove audio",
    "prediction": "predicted outputs are not supported; remove prediction",
}


def _honoured(name: str, value: Any) -> bool:
    """Values of those fields that ask for what /rag does anyway (plain text, no tools)."""
    if name == "tool_choice":
        return value == "none"
    if name == "response_format":
        return value == {"type": "text"}
    return False


class RagMessage(WireRequest):
    """One chat message; text only (a list of text parts is joined)."""

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="'system'/'developer' messages are added to the pipeline's own system "
        "prompt; 'tool' messages are refused (tools are not supported here)."
    )
    content: str | list[TextPart] = Field(description="Text, or a list of text parts.")
    name: str | None = Field(default=None, max_length=256)

    @field_validator("content")
    @classmethod
    def _bounded(cls, value: str | list[TextPart]) -> str | list[TextPart]:
        size = len(value) if isinstance(value, str) else sum(len(p.text) for p in value)
        if size > 100_000:
            raise ValueError(f"content has {size} characters; send at most 100000 per message")
        return value

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class RagChatRequest(WireRequest):
    """``POST /rag/v1/chat/completions``: OpenAI's chat shape; the last user turn is the query.

    Every field is either honoured (passed to the generator) or refused with a 400 that names
    it: unknown fields, ``n`` > 1, ``tools``, ``response_format``, logprobs and the like.
    ``null`` is accepted wherever OpenAI accepts it and means the default.
    """

    messages: list[RagMessage] = Field(min_length=1, max_length=64)
    model: str | None = Field(
        default=None,
        max_length=256,
        description="'rag' (or this app's model_name); omitted: 'rag'. Other names get 404.",
    )
    max_tokens: int | None = Field(default=None, ge=1, le=32_768)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32_768)
    temperature: float | None = Field(
        default=None, ge=0, le=2, description="0 is greedy; default 1.0 (OpenAI's)."
    )
    top_p: float | None = Field(default=None, gt=0, le=1, description="Default 1.0.")
    n: int | None = Field(default=None, description="Only 1 is supported (one cited answer).")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        default=None, description=f"Up to {MAX_STOP} strings that end the answer."
    )
    seed: int | None = Field(
        default=None, ge=-(2**63), lt=2**63, description="Makes sampling repeatable."
    )
    presence_penalty: float | None = Field(
        default=None, ge=-2, le=2, description="OpenAI's: penalises tokens already generated."
    )
    frequency_penalty: float | None = Field(
        default=None, ge=-2, le=2, description="OpenAI's: penalises tokens by their count so far."
    )
    logprobs: bool | None = Field(default=None, description="Only false is supported.")
    user: str | None = Field(default=None, max_length=256, description="Ignored; accepted.")
    top_k: int | None = Field(
        default=None, ge=1, le=200, description="carpool extension: chunks retrieved."
    )
    # Refused by name when set (see UNSUPPORTED_FIELDS); declared so the message is specific.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    top_logprobs: Any = None
    audio: Any = None
    prediction: Any = None
    parallel_tool_calls: bool | None = Field(
        default=None, description="Accepted only without tools (it then means nothing)."
    )

    @field_validator("messages")
    @classmethod
    def _has_question(cls, value: list[RagMessage]) -> list[RagMessage]:
        users = [m for m in value if m.role == "user"]
        if not users or not users[-1].text().strip():
            raise ValueError("messages need a non-empty user message: the question to answer")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        return check_stops(value)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "RagChatRequest":
        for name, why in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value is None or value == [] or value == {} or _honoured(name, value):
                continue
            raise ValueError(f"{name}: {why}")
        if self.n not in (None, 1):
            raise ValueError(
                f"n is {self.n}, but /rag returns one cited answer; remove n or set it to 1 "
                "(send the request again for another answer)"
            )
        if self.logprobs:
            raise ValueError("logprobs are not supported by /rag; remove logprobs")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true; remove it")
        check_token_limits(self.max_tokens, self.max_completion_tokens)
        return self

    def question(self) -> str:
        return next(m.text() for m in reversed(self.messages) if m.role == "user")

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def generation_call(body: RagChatRequest, system: str, max_tokens: int) -> dict[str, Any]:
    """What the generator gets: the sources prompt, the conversation and every sampling field.

    Client system/developer messages are kept, after the pipeline's own instructions (the
    model has one system turn); OpenAI's defaults apply to fields left out or null. The
    request's deadline and priority are added where every generation call gets them, on the
    generate path (``pipelines.generate_path.with_controls``).
    """
    extra = [m.text() for m in body.messages if m.role in ("system", "developer")]
    if extra:
        system = system + "\n\n" + "\n\n".join(extra)
    history = [
        {"role": m.role, "content": m.text()}
        for m in body.messages
        if m.role not in ("system", "developer")
    ]
    return {
        "messages": [{"role": "system", "content": system}, *history],
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "stop": body.stop_list(),
        "seed": body.seed,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
    }
