"""Structured output and tools on the wire: ``response_format``, ``tools``, ``tool_choice``,
and chat messages with the tool calls of earlier turns.

Shapes and bounds only (a schema's size and depth, OpenAI's name pattern and limits); compiling
a grammar is the generator's job (``carpool.generation.structured``). The request models in
``carpool.generation.schemas`` carry these fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from carpool.generation.structured import ConstraintError, OutputConstraint, canonical_schema
from carpool.schemas import WireRequest

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


class JsonSchemaFormat(WireRequest):
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


class ResponseFormat(WireRequest):
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


class FunctionDefinition(WireRequest):
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


class Tool(WireRequest):
    type: Literal["function"] = Field(description="Only function tools exist.")
    function: FunctionDefinition


class NamedFunction(WireRequest):
    name: str = Field(max_length=64, description="A function named in tools.")


class NamedToolChoice(WireRequest):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(WireRequest):
    name: str = Field(max_length=64)
    arguments: str = Field(
        default="{}", max_length=MAX_ARGUMENTS_CHARS, description="The arguments as JSON text."
    )


class ToolCallIn(WireRequest):
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


def refuse_with_constraint(data: dict[str, Any], param: str, value: str) -> None:
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


def choice_label(choice: Any) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"function {choice.function.name}"
    return str(choice)


def format_constraint(body: Any) -> tuple[OutputConstraint | None, str | None]:
    """The grammar ``response_format`` asks for, and that field's name (for errors)."""
    fmt = body.response_format
    constraint = fmt.constraint() if fmt is not None else None
    return constraint, ("response_format" if constraint is not None else None)


class TextPart(WireRequest):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str


class ChatMessage(WireRequest):
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
