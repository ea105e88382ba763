"""Tool calling: tools into the prompt, tool calls out of the answer (OpenAI's shapes).

Into the prompt: a chat template that knows tools (Qwen2.5's does) renders them itself
(``apply_chat_template(tools=...)``); for one that does not (SmolLM2's), carpool writes the
same Hermes-style block Qwen2.5 uses into the system message, and renders earlier tool calls
and tool results as ``<tool_call>`` / ``<tool_response>`` text, so every chat model sees
one convention.

Out of the answer, by ``tool_choice``:

- ``required`` / a named function: decoding was constrained to JSON (a list of
  ``{"name", "parameters"}`` for required, as vLLM does; the arguments object for a named
  function), so the answer parses into ``tool_calls``.
- ``auto``: the model decides. ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks (what Qwen2.5's template asks for) become ``tool_calls``; text before the first
  block is the message content. An answer that is only such a JSON call without the tags
  (what Qwen2.5-Coder-0.5B writes) counts too. A block that does not parse, or names a
  function not in ``tools``, leaves the whole answer as plain content (what vLLM's Hermes
  parser does).

Pure Python (no torch, no Ray): the ingress parses, the generator renders.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

ToolMode = Literal["none", "auto", "required", "named"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Qwen2.5's own tools block, for templates that cannot render tools themselves.
HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def template_supports_tools(template: Any) -> bool:
    """True when the chat template reads a ``tools`` variable (renders tools itself)."""
    if isinstance(template, dict):  # several named templates
        return any(template_supports_tools(t) for t in template.values())
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def _arguments_value(arguments: Any) -> Any:
    """A call's arguments as an object when they are JSON text (templates expect one)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def render_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to hand ``apply_chat_template``.

    ``native``: the template renders tools, tool calls and tool results itself (arguments
    turned into objects, as templates expect). Otherwise the tools go into the system
    message as Qwen2.5's Hermes block, and tool calls and results become text, so the
    template sees plain system, user and assistant turns.
    """
    out = copy.deepcopy(messages)
    if native:
        for m in out:
            for call in m.get("tool_calls") or []:
                fn = call.get("function", {})
                fn["arguments"] = _arguments_value(fn.get("arguments", {}))
        return out, (tools or None)
    rendered: list[dict[str, Any]] = []
    for m in out:
        m.pop("tool_call_id", None)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [
                f"{TOOL_CALL_OPEN}\n"
                + json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _arguments_value(c["function"].get("arguments", {})),
                    },
                    ensure_ascii=False,
                )
                + f"\n{TOOL_CALL_CLOSE}"
                for c in calls
            ]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        rendered.append(m)
    if tools:
        block = HERMES_TOOLS_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if rendered and rendered[0]["role"] in ("system", "developer"):
            first = rendered[0]
            first["content"] = f"{first['content']}\n\n{block}" if first["content"] else block
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered, None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI tool call; ``arguments`` becomes JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_forced(text: str, mode: ToolMode, name: str | None) -> list[dict[str, Any]]:
    """Tool calls from a constrained answer; [] when it is cut short (max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if mode == "named" and name is not None:
        return [make_call(name, value)]
    if mode == "required" and isinstance(value, list):
        return [
            make_call(item["name"], item.get("parameters", {}))
            for item in value
            if isinstance(item, dict) and isinstance(item.get("name"), str)
        ]
    return []


def _bare_calls(text: str, known: set[str]) -> list[dict[str, Any]]:
    """Calls from an answer that is nothing but a JSON call (or a list of them), untagged.

    Small Qwen2.5 models often answer a tool prompt with the call's JSON and no
    ``<tool_call>`` tags. Only an answer that is wholly such JSON, naming known functions,
    counts; anything else stays text.
    """
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in known:
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, (dict, str)) or set(item) - {
            "name",
            "arguments",
            "parameters",
        }:
            return []
        calls.append(make_call(item["name"], arguments))
    return calls


def parse_hermes(text: str, names: Iterable[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an ``auto`` answer; no calls leaves the text as it is."""
    known = set(names)
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        calls = _bare_calls(text.strip(), known) if text.strip()[:1] in ("{", "[") else []
        return (None, calls) if calls else (text, [])
    calls = []
    for match in _BLOCK.finditer(text, start):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in known:
            return text, []
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append(make_call(obj["name"], arguments))
    if not calls:
        return text, []
    content = text[:start].strip()
    return (content or None), calls


@dataclass
class ToolAnswer:
    """A chat choice's message once tool calls are parsed out."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None


@dataclass
class ToolParser:
    """Turns one choice's text into content and tool calls, whole or as it streams.

    Streaming: in ``auto`` mode, content is passed on as it comes, except text that could be
    the start of ``<tool_call>`` (held back until it is clearly not); from the first block
    on, the rest is kept and parsed at the end. An answer that opens with ``{`` or ``[`` may
    be an untagged call, so it is kept whole and parsed at the end too. Forced modes keep
    everything: the answer is one JSON value, parsed at the end.
    """

    mode: ToolMode
    names: list[str]
    named: str | None = None
    _text: str = field(default="", repr=False)
    _sent: int = 0  # characters of _text already passed on as content
    _in_call: bool = False

    def answer(self, text: str, finish_reason: str | None) -> ToolAnswer:
        """The whole answer's content and calls (non-streamed responses)."""
        if self.mode in ("required", "named"):
            calls = parse_forced(text, self.mode, self.named)
        elif self.mode == "auto":
            content, calls = parse_hermes(text, self.names)
            if calls:
                return ToolAnswer(content, calls, "tool_calls")
            return ToolAnswer(text, [], finish_reason)
        else:
            calls = []
        if calls:
            return ToolAnswer(None, calls, "tool_calls")
        return ToolAnswer(text, [], finish_reason)

    def feed(self, text: str) -> str:
        """Content that can be streamed now."""
        self._text += text
        if self.mode in ("required", "named") or self._in_call:
            return ""
        if self._sent == 0:
            head = self._text.lstrip()
            if not head:
                return ""  # only whitespace so far: what follows decides
            if head[0] in "{[":
                self._in_call = True  # may be an untagged JSON call: kept to the end
                return ""
        at = self._text.find(TOOL_CALL_OPEN, self._sent)
        if at >= 0:
            self._in_call = True
            out, self._sent = self._text[self._sent : at], at
            return out
        safe = len(self._text) - _partial_tag(self._text[self._sent :])
        out, self._sent = self._text[self._sent : safe], safe
        return out

    def finish(self, finish_reason: str | None) -> ToolAnswer:
        """What is left when the choice ends: held-back content, and the tool calls."""
        if self.mode == "auto":
            if self._in_call:
                _, calls = parse_hermes(self._text[self._sent :], self.names)
                if calls:
                    return ToolAnswer(None, calls, "tool_calls")
            return ToolAnswer(self._text[self._sent :] or None, [], finish_reason)
        whole = self.answer(self._text, finish_reason)
        return whole


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
