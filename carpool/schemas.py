"""Wire formats: OpenAI-compatible embeddings and the common rerank shape.

Kept apart from the logic so the HTTP contract is readable in one place. Field limits here
are hard caps on what a request can describe; the pipelines' ``Args`` apply tighter,
configurable limits on top.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Hard caps that keep one request from describing unbounded work (configurable caps are lower).
MAX_ITEMS_HARD = 4096
MAX_TEXT_CHARS_HARD = 1_000_000


def find_unservable_value(data: Any) -> str | None:
    """What in a decoded JSON body no model can take, as a message naming where; else None.

    Two things pass JSON parsing yet break later stages: a lone UTF-16 surrogate (``"\\ud800"``
    decodes to a ``str`` that tokenizers and UTF-8 encoders reject) and a non-finite number
    (``NaN``, ``Infinity``, ``1e309``), which cannot even be written back as JSON. The walk is
    iterative, so a deeply nested body cannot exhaust the stack here.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            problem = _lone_surrogate(value)
            if problem is not None:
                return f"{path or 'body'} {problem}"
        elif isinstance(value, float):
            if not math.isfinite(value):
                return (
                    f"{path or 'body'} is {value}; send a finite number (JSON has no NaN or "
                    "Infinity, and 1e309 overflows)"
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                key_text = str(key)
                problem = _lone_surrogate(key_text)
                if problem is not None:
                    return f"a key of {path or 'body'} {problem}"
                stack.append((f"{path}.{key_text}" if path else key_text, item))
        elif isinstance(value, list):
            # Integers (token ids: up to millions in one body) are always servable; skip
            # them without building a path for each.
            stack.extend(
                (f"{path}[{i}]", item) for i, item in enumerate(value) if type(item) is not int
            )
    return None


def _lone_surrogate(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}) at character "
            f"{exc.start}, which is not valid Unicode; send valid UTF-8 text (escape a "
            "non-BMP character as a surrogate pair)"
        )
    return None


class WireRequest(BaseModel):
    """Base of every request body: unknown fields, NaN/Infinity and broken text refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _servable(cls, data: Any) -> Any:
        problem = find_unservable_value(data)
        if problem is not None:
            raise ValueError(problem)
        return data


def _check_texts(values: list[str], field: str) -> list[str]:
    for i, text in enumerate(values):
        if not text.strip():
            raise ValueError(
                f"{field}[{i}] is empty or only whitespace; remove it or send non-empty text"
            )
    return values


# Largest token id accepted on the wire; the embedder checks ids against its own vocabulary.
MAX_TOKEN_ID = 2**31 - 1
MAX_IDS_PER_INPUT_HARD = 100_000

INPUT_SHAPES = (
    "send a string, a list of strings, a list of token ids (integers) or a list of such lists"
)


class EmbeddingRequest(WireRequest):
    """``POST /embed/v1/embeddings``: OpenAI's embeddings request.

    ``input`` takes every shape OpenAI's does: text, texts, token ids, or lists of token ids
    (LangChain's ``OpenAIEmbeddings`` sends ids by default). Ids must be the served model's
    own, special tokens included; they reach the model as sent.
    """

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text to embed, a list of texts, a list of token ids, or a list of "
        "token-id lists (each embedded separately). Token ids must come from the served "
        "model's tokenizer, special tokens included."
    )
    model: str | None = Field(
        default=None, max_length=256, description="Served model name; omit to use the default."
    )
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="'float' lists, or base64 of little-endian float32."
    )
    dimensions: int | None = Field(
        default=None, description="Not supported: the model's full dimension is always returned."
    )
    user: str | None = Field(default=None, max_length=256, description="Ignored; accepted.")
    truncate: bool = Field(
        default=True,
        description="carpool extension: cut inputs longer than the model's limit (and say so) "
        "instead of refusing them with 413.",
    )

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, value: Any) -> Any:
        """One message naming the item and the shapes accepted, not pydantic's union dump."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"input is {_json_kind(value)}; {INPUT_SHAPES}")
        if not value:
            raise ValueError("input is an empty list; send at least one string")
        first = value[0]
        if isinstance(first, str):
            kind, ok = "a list of strings", lambda v: isinstance(v, str)
        elif _is_id(first):
            kind, ok = "a list of token ids", _is_id
        elif isinstance(first, list):
            kind = "a list of token-id lists"
            ok = lambda v: isinstance(v, list) and all(_is_id(t) for t in v)  # noqa: E731
        else:
            raise ValueError(
                f"input[0] is {_json_kind(first)}; {INPUT_SHAPES} (token ids are integers "
                f"from 0 to {MAX_TOKEN_ID})"
            )
        for i, item in enumerate(value):
            if not ok(item):
                raise ValueError(
                    f"input[{i}] is {_json_kind(item)} but input[0] makes input {kind}; "
                    f"{INPUT_SHAPES}, not a mix (token ids are integers from 0 to "
                    f"{MAX_TOKEN_ID})"
                )
        return value

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if isinstance(value, list) and value and isinstance(value[0], int):
            items = [value]  # one input given as token ids
        if len(items) > MAX_ITEMS_HARD:
            raise ValueError(f"input has {len(items)} items; send at most {MAX_ITEMS_HARD}")
        for i, item in enumerate(items):
            if isinstance(item, str):
                if len(item) > MAX_TEXT_CHARS_HARD:
                    raise ValueError(
                        f"input[{i}] has {len(item)} characters; send at most {MAX_TEXT_CHARS_HARD}"
                    )
                continue
            if not item:
                raise ValueError(f"input[{i}] is an empty list of token ids; send at least one")
            if len(item) > MAX_IDS_PER_INPUT_HARD:
                raise ValueError(
                    f"input[{i}] has {len(item)} token ids; send at most {MAX_IDS_PER_INPUT_HARD}"
                )
        texts = [t for t in items if isinstance(t, str)]
        _check_texts(texts, "input")
        return value

    def is_token_ids(self) -> bool:
        return isinstance(self.input, list) and not isinstance(self.input[0], str)

    def texts(self) -> list[str]:
        """The inputs as texts (empty when they are token ids)."""
        if self.is_token_ids():
            return []
        return [self.input] if isinstance(self.input, str) else list(self.input)  # type: ignore[arg-type]

    def token_ids(self) -> list[list[int]]:
        """The inputs as token-id lists (empty when they are texts)."""
        if not self.is_token_ids():
            return []
        if isinstance(self.input[0], int):  # type: ignore[index]
            return [list(self.input)]  # type: ignore[arg-type]
        return [list(ids) for ids in self.input]  # type: ignore[union-attr]

    def count(self) -> int:
        return len(self.token_ids()) if self.is_token_ids() else len(self.texts())


def _is_id(value: Any) -> bool:
    # bool is an int in Python; true/false are not token ids.
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return f"the integer {value}" + (" (token ids are never negative)" if value < 0 else "")
    if isinstance(value, float):
        return "a non-integer number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    truncated: bool = Field(
        default=False, description="carpool extension: the input was cut to the model's limit."
    )


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class RerankRequest(WireRequest):
    """``POST /rank/v1/rerank``: the rerank shape shared by Cohere, Jina and TEI."""

    query: str = Field(min_length=1, max_length=MAX_TEXT_CHARS_HARD, description="The query.")
    documents: list[str] = Field(description="Documents to score against the query.")
    top_n: int | None = Field(
        default=None, ge=1, description="Return only the best N results (default: all)."
    )
    return_documents: bool = Field(
        default=False, description="Include each document's text in its result."
    )
    model: str | None = Field(
        default=None, max_length=256, description="Served model name; omit to use the default."
    )
    raw_scores: bool = Field(
        default=False,
        description="carpool extension: return raw scores instead of sigmoid-scaled ones.",
    )
    truncate: bool = Field(
        default=True,
        description="carpool extension: cut query-document pairs longer than the model's "
        "limit instead of refusing them with 413.",
    )

    @field_validator("query")
    @classmethod
    def _query_not_blank(cls, value: str) -> str:
        return _check_rank_query(value)

    @field_validator("documents")
    @classmethod
    def _docs(cls, value: list[str]) -> list[str]:
        return _check_documents(value)


def _check_rank_query(value: str) -> str:
    if not value.strip():
        raise ValueError("query is only whitespace; send the text to rank documents against")
    return value


def _check_documents(value: list[str]) -> list[str]:
    if not value:
        raise ValueError("documents is an empty list; send at least one document")
    if len(value) > MAX_ITEMS_HARD:
        raise ValueError(f"documents has {len(value)} items; send at most {MAX_ITEMS_HARD}")
    for i, text in enumerate(value):
        if len(text) > MAX_TEXT_CHARS_HARD:
            raise ValueError(
                f"documents[{i}] has {len(text)} characters; send at most {MAX_TEXT_CHARS_HARD}"
            )
    return _check_texts(value, "documents")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None
    truncated: bool = False


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class CohereDocument(WireRequest):
    text: str = Field(max_length=MAX_TEXT_CHARS_HARD)


class CohereRerankRequest(WireRequest):
    """``POST /rank/v2/rerank``: Cohere's v2 rerank request (what ``cohere.ClientV2`` sends)."""

    model: str | None = Field(
        default=None, max_length=256, description="Served model name; omit to use the default."
    )
    query: str = Field(min_length=1, max_length=MAX_TEXT_CHARS_HARD, description="The query.")
    documents: list[str | CohereDocument] = Field(
        description="Documents to score: strings (or objects with a 'text' field)."
    )
    top_n: int | None = Field(
        default=None, ge=1, description="Return only the best N results (default: all)."
    )
    max_tokens_per_doc: int | None = Field(
        default=None,
        ge=1,
        description="Accepted when at least the ranker's own limit (each query-document pair "
        "is cut to it); a lower value is refused, naming the limit.",
    )
    return_documents: bool | None = Field(
        default=False, description="Include each document's text in its result."
    )

    @field_validator("query")
    @classmethod
    def _query_not_blank(cls, value: str) -> str:
        return _check_rank_query(value)

    @field_validator("documents")
    @classmethod
    def _docs(cls, value: list[str | CohereDocument]) -> list[str | CohereDocument]:
        texts = [d if isinstance(d, str) else d.text for d in value]
        _check_documents(texts)  # same limits and messages as /v1/rerank
        return value

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class CohereRerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class CohereRerankResponse(BaseModel):
    id: str
    results: list[CohereRerankResult]
    meta: dict[str, Any]
    model: str


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``, for every pipeline (OpenAI's shape, vLLM's extras)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(
        default_factory=lambda: int(time.time()),
        description="Unix time the serving app started (OpenAI's field; clients require it).",
    )
    owned_by: str = "carpool"
    root: str | None = Field(
        default=None,
        description="The model behind this name (a generator tier's model); null where the "
        "name is the model itself or a pipeline.",
    )
    max_model_len: int | None = Field(
        default=None, description="A generator's context length (prompt + output tokens)."
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class DocumentIn(WireRequest):
    """One document to ingest; re-sending an id replaces that document."""

    id: str = Field(min_length=1, max_length=256, description="Document id (cited in answers).")
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS_HARD, description="Full text.")
    metadata: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, description="Flat metadata returned with search results."
    )

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("text is only whitespace; send the document's text")
        return value


class IngestRequest(WireRequest):
    documents: list[DocumentIn] = Field(min_length=1, max_length=1024)

    @field_validator("documents")
    @classmethod
    def _unique_ids(cls, value: list[DocumentIn]) -> list[DocumentIn]:
        ids = [d.id for d in value]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"documents repeat ids {dupes[:5]}; send each id once")
        return value


class IngestResponse(BaseModel):
    ids: list[str]
    chunks: int


class SearchRequest(WireRequest):
    """``POST /search/v1/search``: embed the query, retrieve, rerank."""

    query: str = Field(min_length=1, max_length=8000, description="What to search for.")
    top_k: int = Field(default=20, ge=1, le=200, description="Chunks retrieved before reranking.")
    top_n: int = Field(default=5, ge=1, le=200, description="Results returned.")
    rerank: bool = Field(default=True, description="Rerank retrieved chunks with the ranker.")

    @field_validator("query")
    @classmethod
    def _query_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("query is only whitespace; send the text to search for")
        return value


class SearchHit(BaseModel):
    doc_id: str
    chunk_id: int
    text: str
    score: float = Field(description="Final score: retrieval and rerank mixed (see rerank_weight).")
    retrieval_score: float = Field(description="Cosine similarity of query and chunk.")
    rerank_score: float | None = Field(default=None, description="Ranker's sigmoid score.")
    metadata: dict[str, str | int | float | bool | None] = Field(default_factory=dict)


class SearchResponse(BaseModel):
    query: str
    results: list[SearchHit]
    reranked: bool
