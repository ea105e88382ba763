"""From a generation call to prompt token ids: chat templates, tools, length checks.

``PromptPlanner.render`` turns a call into texts (a chat through the tokenizer's template,
tools rendered natively or as text); ``tokenize`` encodes the texts of many calls in one
tokenizer call (fast tokenizers batch it in Rust); ``check`` refuses what cannot fit the
context with a 400 that says what to change, and picks max_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.errors import RequestError
from carpool.generation.schemas import MAX_N, MAX_SEQS_PER_CALL, GenerationCall
from carpool.generation.tools import render_tool_messages, template_supports_tools


@dataclass(frozen=True)
class Rendered:
    """A call's prompt texts and whether the tokenizer adds its special tokens to them."""

    texts: list[str]
    add_special_tokens: bool

    @property
    def chars(self) -> int:
        return sum(len(t) for t in self.texts)


class PromptPlanner:
    """Renders, tokenises and checks prompts for one model (plain Python, no engine)."""

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        max_seq_len: int,
        max_tokens_limit: int,
        default_max_tokens: int,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens

    def render(self, call: GenerationCall) -> Rendered:
        if call.n > MAX_N:
            raise RequestError(400, f"n is {call.n}; send at most {MAX_N}", param="n")
        if call.messages is None:
            if not call.prompts:
                raise RequestError(400, "send a prompt or messages", param="prompt")
            rendered = Rendered(list(call.prompts), True)
        else:
            rendered = Rendered([self._chat_text(call)], False)
        count = len(rendered.texts) * call.n
        if count > MAX_SEQS_PER_CALL:
            raise RequestError(
                400,
                f"{len(rendered.texts)} prompts x n={call.n} make {count} sequences; send at "
                f"most {MAX_SEQS_PER_CALL} per request",
                param="n",
            )
        return rendered

    def _chat_text(self, call: GenerationCall) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise RequestError(
                400,
                f"model {self.name!r} has no chat template; use /v1/completions with a "
                "plain prompt instead",
                param="messages",
            )
        messages, tools = render_tool_messages(
            call.messages, call.tools, template_supports_tools(template)
        )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # template rejects the conversation (roles, order...)
            raise RequestError(
                400,
                f"the chat template of {self.name!r} rejected these messages: {exc}",
                param="messages",
            ) from None

    def tokenize(self, rendered: Sequence[Rendered]) -> list[list[list[int]]]:
        """Token ids of every text of every call, in two tokenizer calls at most."""
        out: list[list[list[int]]] = [[] for _ in rendered]
        for special in (True, False):
            where = [i for i, r in enumerate(rendered) if r.add_special_tokens == special]
            texts = [text for i in where for text in rendered[i].texts]
            if not texts:
                continue
            ids = iter(self.tokenizer(texts, add_special_tokens=special)["input_ids"])
            for i in where:
                out[i] = [list(next(ids)) for _ in rendered[i].texts]
        return out

    def encode(self, call: GenerationCall) -> list[list[int]]:
        """One call's prompt ids (render + tokenize)."""
        return self.tokenize([self.render(call)])[0]

    def check(self, call: GenerationCall, prompts: list[list[int]]) -> int:
        """Refuses prompts that cannot fit; returns the max_tokens to use."""
        longest = max(len(p) for p in prompts)
        where = "messages" if call.messages is not None else "prompt"
        if longest == 0:
            raise RequestError(400, f"{where} encodes to no tokens; send some text", param=where)
        room = self.max_seq_len - longest
        if room < 1:
            raise RequestError(
                400,
                f"{where} has {longest} tokens; model {self.name!r} takes at most "
                f"{self.max_seq_len - 1} prompt tokens. Shorten it",
                param=where,
                code="context_length_exceeded",
            )
        if call.max_tokens is None:
            return min(self.default_max_tokens, self.max_tokens_limit, room)
        if call.max_tokens > self.max_tokens_limit:
            raise RequestError(
                400,
                f"max_tokens is {call.max_tokens}; model {self.name!r} generates at most "
                f"{self.max_tokens_limit} tokens per request. Lower max_tokens",
                param="max_tokens",
            )
        if call.max_tokens > room:
            raise RequestError(
                400,
                f"{where} has {longest} tokens and max_tokens is {call.max_tokens}: together "
                f"they exceed model {self.name!r}'s {self.max_seq_len}-token context. Lower "
                f"max_tokens to at most {room} or shorten the {where}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return call.max_tokens
