"""Incremental detokenisation and stop sequences (pure Python; the tokenizer is injected).

Decoding a growing token list one token at a time is not "decode the new token": byte-level
BPE splits multi-byte characters over tokens, and sentencepiece drops leading spaces at the
start of a decode. So each step decodes a short window that starts a few tokens back and
emits only what it adds, holding back a trailing U+FFFD (an incomplete character).

Stop sequences are matched on text. Text that might be the start of a stop sequence is held
back until it is clearly not one, so a streamed response never shows part of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas (the prefix/read-offset method)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: int = 0) -> None:
        # ``context``: how many leading ids are already-shown text (e.g. the prompt's last
        # tokens), decoded only so the first generated token gets its leading space right.
        self._decode = decode
        self._prefix_offset = 0
        self._read_offset = context

    def step(self, ids: Sequence[int]) -> str:
        """Returns the text the ids added since the last call ('' while a character is incomplete)."""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return delta
        return ""

    def flush(self, ids: Sequence[int]) -> str:
        """Whatever is still held back (an incomplete character at the very end is emitted as is)."""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopMatcher:
    """Accumulates text, cuts it at the first stop sequence, and says what is safe to emit."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.text = ""
        self.emitted = 0
        self.stopped_by: str | None = None

    def feed(self, delta: str) -> str:
        """Adds generated text; returns the part that can be shown now."""
        if self.stopped_by is not None:
            return ""
        scan_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        if not self.stop:
            return self._emit(len(self.text))
        cut = -1
        for s in self.stop:
            at = self.text.find(s, scan_from)
            if at != -1 and (cut == -1 or at < cut):
                cut, self.stopped_by = at, s
        if cut != -1:
            self.text = self.text[:cut]
            return self._emit(cut)
        return self._emit(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The generation ended for another reason: release what was held back."""
        return self._emit(len(self.text))

    def _held_back(self) -> int:
        # The longest tail of the text that is a proper prefix of some stop sequence.
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
