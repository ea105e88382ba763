"""Structured output: JSON grammars that constrain decoding, so the output always parses.

A request's ``response_format`` (``json_object`` or ``json_schema``) or a forced tool call
becomes an ``OutputConstraint``. The generator server compiles it into an xgrammar grammar
(``ConstraintCompiler``, off the engine's step loop, cached per schema), and each sequence
gets a ``GrammarState``: before sampling, ``apply_grammars`` masks the logits of the rows that
carry one (every token the grammar forbids gets -inf), and the engine advances the state
with each accepted token and ends the sequence ("stop") as soon as the grammar is complete.
Rows without a constraint are never touched, so mixing them in one step changes nothing for
them.

xgrammar (what vLLM uses) does the grammar work: ``TokenizerInfo`` from the Hugging Face
tokenizer, ``GrammarCompiler.compile_json_schema``, ``GrammarMatcher`` per sequence,
``fill_next_token_bitmask`` and ``apply_token_bitmask_inplace`` on CPU tensors (about 1 ms
per constrained token here). It is imported only when a constraint is first compiled.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from carpool.errors import RequestError

# Most characters of one schema (its compact JSON): compile time grows with the schema, and
# compiling runs in the replica, so a bound keeps one request from holding it for long.
MAX_SCHEMA_CHARS = 32_768
# Deepest nesting of objects and arrays in a schema (vLLM refuses deeper ones too).
MAX_SCHEMA_DEPTH = 32
# Largest length or count bound (maxLength, minItems...) and regex repetition ({n}) a schema
# may set: the compiled grammar grows with them (maxLength 1,000,000 took 3.3 s to compile
# here), and no answer within max_tokens gets near them anyway.
MAX_SCHEMA_REPEAT = 8192
MAX_PATTERN_REPEAT = 1024
_COUNT_KEYS = frozenset(
    {
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "minContains",
        "maxContains",
    }
)
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# Compiled grammars kept per replica (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 128

ConstraintKind = Literal["json_object", "json_schema"]


class ConstraintError(ValueError):
    """A constraint cannot be compiled (an invalid or unsupported schema); says what is wrong."""


class GrammarUnavailable(ImportError):
    """xgrammar is not installed in this environment."""


@dataclass(frozen=True)
class OutputConstraint:
    """What a sequence's output must be: any JSON object, or JSON matching ``schema``.

    ``schema`` is the schema as compact JSON, keys in the order sent: the output's properties
    follow the order of ``properties`` (as OpenAI's do), so it matters. Equal schemas share
    one compiled grammar.
    """

    kind: ConstraintKind
    schema: str | None = None

    @classmethod
    def json_object(cls) -> OutputConstraint:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> OutputConstraint:
        return cls("json_schema", canonical_schema(schema))

    def schema_dict(self) -> dict[str, Any] | bool:
        """The JSON schema this constraint enforces (json_object: any object)."""
        if self.schema is None:
            return {"type": "object"}
        return json.loads(self.schema)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "schema": self.schema}

    @classmethod
    def from_dict(cls, value: dict[str, Any] | None) -> OutputConstraint | None:
        if not value:
            return None
        return cls(value["kind"], value.get("schema"))


def canonical_schema(schema: Any) -> str:
    """Checks a schema's shape and size; returns it as compact JSON (key order kept)."""
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(
            f"a JSON schema must be an object (or true/false), got {type(schema).__name__}"
        )
    _check_bounds(schema)
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(
            f"the schema nests {depth} levels deep; send at most {MAX_SCHEMA_DEPTH}"
        )
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ConstraintError(
            f"the schema has {len(text)} characters as compact JSON; send at most "
            f"{MAX_SCHEMA_CHARS}"
        )
    return text


def _check_bounds(schema: Any) -> None:
    """Refuses length/count bounds and pattern repetitions that would make a huge grammar."""
    for item in _schema_objects(schema):
        for key, value in item.items():
            if key in _COUNT_KEYS and isinstance(value, (int, float)) and value > MAX_SCHEMA_REPEAT:
                raise ConstraintError(
                    f"{key} {value} is above {MAX_SCHEMA_REPEAT}; lower it (an answer is "
                    "bounded by max_tokens anyway)"
                )
            if key == "pattern" and isinstance(value, str):
                for match in _REPEAT.finditer(value):
                    counts = [int(g) for g in match.groups() if g]
                    if max(counts, default=0) > MAX_PATTERN_REPEAT:
                        raise ConstraintError(
                            f"pattern repeats {match.group(0)}, above {MAX_PATTERN_REPEAT}; "
                            "lower the count"
                        )


def _schema_objects(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object in a schema, iteratively (a deep body must not recurse); an object may be
    changed by the caller before its values are visited."""
    stack: list[Any] = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            yield item
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))


def json_safe_string_bounds(schema: str) -> str:
    r"""The schema with each length-bounded string given as a pattern of JSON-safe characters.

    xgrammar 0.2.8 compiles ``minLength``/``maxLength`` into ``[^"\\\r\n]{m,n}``, which
    admits the control characters U+0000-U+001F that JSON forbids unescaped: a random model
    wrote ``{"name": " lack\x17", ...}``, which no JSON parser reads. The same bounds as
    ``^[^\x00-\x1f"\\]{m,n}$`` keep the length (characters, as JSON Schema counts them)
    and exclude them. Strings that carry their own ``pattern`` or ``format`` are left as sent.
    """
    value = json.loads(schema)
    for item in _schema_objects(value):
        bounded = "minLength" in item or "maxLength" in item
        if (
            item.get("type") == "string"
            and bounded
            and "pattern" not in item
            and "format" not in item
        ):
            low = int(item.pop("minLength", 0))
            high = item.pop("maxLength", None)
            item["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{"" if high is None else int(high)}}}$'
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _depth(value: Any) -> int:
    """Nesting depth of objects and arrays, iteratively (a deep body must not recurse)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
    return deepest


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarUnavailable(
            "structured output needs the xgrammar package in the replica's environment "
            f"(a carpool dependency; reinstall with `make install`): {exc}"
        ) from exc
    return xgrammar


# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest says what is wrong.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def _clean(exc: Exception) -> str:
    text = _CPP_PREFIX.sub("", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class GrammarBusy(Exception):
    """Too many schemas wait for the compile thread; retry later (503)."""


class GrammarTimeout(Exception):
    """A schema took longer than the compile timeout (400: simplify it)."""


def compile_refusal(exc: Exception, param: str, model: str) -> RequestError:
    """The client's answer to a grammar that could not be compiled, by what went wrong."""
    if isinstance(exc, GrammarUnavailable):
        return RequestError(400, f"{param} is not available on model {model!r}: {exc}", param=param)
    if isinstance(exc, GrammarTimeout):
        return RequestError(
            400,
            f"{param}: {exc} on model {model!r} (limits.grammar_compile_timeout_s); "
            "simplify the schema or retry once it is cached",
            param=param,
            code="grammar_compile_timeout",
        )
    if isinstance(exc, GrammarBusy):
        return RequestError(
            503,
            f"{param}: {exc} on model {model!r}; retry after the Retry-After delay",
            param=param,
            code="grammar_queue_full",
            retry_after_s=1.0,
        )
    return RequestError(400, f"{param}: {exc}; fix the schema", param=param)


class ConstraintCompiler:
    """Compiles constraints for one tokenizer, caches them, and builds per-sequence states.

    Compilation runs on a one-thread executor (``compile_async``), never on the engine's
    step thread, so a request's compile does not stall the running sequences; identical
    schemas compiled at once share one compile, and results (failures included: a bad schema
    stays bad) are kept in a bounded LRU cache.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.cache_size = cache_size
        self._compiler: Any = None
        self._cache: OrderedDict[OutputConstraint, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carpool-grammar")
        self.compiles = 0  # grammars actually compiled (cache misses)

    def _ensure_compiler(self) -> Any:
        if self._compiler is None:
            xgr = _import_xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile_now(self, constraint: OutputConstraint) -> Any:
        compiler = self._ensure_compiler()
        self.compiles += 1
        try:
            # Whitespace between tokens is not free: small models otherwise fill their budget
            # with newlines. Compact JSON (", " and ": ") is always valid JSON.
            if constraint.kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type":"object"}', any_whitespace=False, strict_mode=False
                )
            return compiler.compile_json_schema(
                json_safe_string_bounds(constraint.schema or "{}"),
                any_whitespace=False,
                strict_mode=True,
            )
        except Exception as exc:  # xgrammar raises RuntimeError with what it could not do
            raise ConstraintError(f"the schema cannot be used: {_clean(exc)}") from None

    def _future(self, constraint: OutputConstraint) -> Future[Any]:
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                return future
            future = self._executor.submit(self._compile_now, constraint)
            self._cache[constraint] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, constraint: OutputConstraint) -> Any:
        """The compiled grammar (blocking); raises ``ConstraintError`` for a bad schema."""
        return self._future(constraint).result()

    def waiting(self) -> int:
        """Compiles queued or running (not cached results)."""
        with self._lock:
            return sum(1 for future in self._cache.values() if not future.done())

    async def compile_async(
        self,
        constraint: OutputConstraint,
        timeout_s: float | None = None,
        max_waiting: int | None = None,
    ) -> Any:
        """The compiled grammar, awaited without blocking the caller's event loop.

        ``max_waiting``: a schema not yet cached or queued is refused (``GrammarBusy``) while
        that many compiles wait for the one thread. ``timeout_s``: past it the caller gets
        ``GrammarTimeout``; the compile goes on and lands in the cache.
        """
        with self._lock:
            known = constraint in self._cache
        if not known and max_waiting is not None and self.waiting() >= max_waiting:
            raise GrammarBusy(f"{max_waiting} schemas are already waiting to compile")
        future = asyncio.wrap_future(self._future(constraint))
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            raise GrammarTimeout(f"the schema took over {timeout_s:g} s to compile") from None

    def state(self, compiled: Any) -> GrammarState:
        """A fresh per-sequence state over a compiled grammar."""
        xgr = _import_xgrammar()
        return GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size, self.stop_token_ids)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sequence's position in its grammar (an xgrammar ``GrammarMatcher``)."""

    def __init__(self, matcher: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.rejected: int | None = None  # a token the grammar refused (never expected)
        self.dead = False  # the grammar allowed no token at some step (never expected)

    def fill(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advances past ``token``; False (and ``rejected`` set) when the grammar forbids it."""
        if self.matcher.is_terminated():
            return token in self.stop_token_ids
        ok = bool(self.matcher.accept_token(int(token)))
        if not ok:
            self.rejected = int(token)
        return ok

    def complete(self) -> bool:
        """True when the output is whole and nothing but an end-of-sequence could follow."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        # Complete, but a longer output may also be (a number at the root can take another
        # digit): done only when the grammar allows no other token than a stop token.
        xgr = _import_xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.fill(bitmask, 0)
        allowed = allowed_ids(bitmask[0], self.vocab_size)
        return bool(allowed) and all(t in self.stop_token_ids for t in allowed)


def allowed_ids(row: Any, vocab_size: int) -> list[int]:
    """Token ids whose bit is set in one bitmask row (int32 words, bit b of word w is w*32+b)."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    bits = (row.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return [t for t in torch.nonzero(bits.flatten()).flatten().tolist() if t < vocab_size]


def apply_grammars(logits: Any, grammars: Sequence[GrammarState | None]) -> Any:
    """Masks each constrained row's logits to the tokens its grammar allows (in place).

    Rows whose entry is None are not touched (unconstrained sequences decode exactly as
    without any constraint in the batch). Returns the masked tensor: ``logits`` itself, or a
    contiguous copy when it was a strided view.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    xgr = _import_xgrammar()
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        grammars[i].fill(bitmask, i)  # type: ignore[union-attr]
    if not logits.is_contiguous():  # the kernels index rows of a contiguous tensor
        logits = logits.contiguous()
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    # A grammar that allows no token at all (never expected of a compiled schema) would leave
    # a row of -inf, and sampling it fails the whole step: open one stop token instead, which
    # the grammar then refuses, so that sequence alone ends with an error.
    import torch

    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    alive = torch.isfinite(logits.index_select(0, index)).any(dim=-1).tolist()
    for i, ok in zip(rows, alive, strict=True):
        state = grammars[i]
        if not ok and state is not None:
            stop = min(state.stop_token_ids) if state.stop_token_ids else 0
            logits[i, stop] = 0.0
            state.dead = True
    return logits
