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
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
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


class EmbeddingRequest(WireRequest):
    """``POST /embed/v1/embeddings``: OpenAI's embeddings request."""

    input: str | list[str] = Field(
        description="Text to embed, or a list of texts (each embedded separately)."
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

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: str | list[str]) -> str | list[str]:
        texts = [value] if isinstance(value, str) else value
        if not texts:
            raise ValueError("input is an empty list; send at least one string")
        if len(texts) > MAX_ITEMS_HARD:
            raise ValueError(f"input has {len(texts)} items; send at most {MAX_ITEMS_HARD}")
        for i, text in enumerate(texts):
            if len(text) > MAX_TEXT_CHARS_HARD:
                raise ValueError(
                    f"input[{i}] has {len(text)} characters; send at most {MAX_TEXT_CHARS_HARD}"
                )
        _check_texts(texts, "input")
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


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
        if not value.strip():
            raise ValueError("query is only whitespace; send the text to rank documents against")
        return value

    @field_validator("documents")
    @classmethod
    def _docs(cls, value: list[str]) -> list[str]:
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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(
        default_factory=lambda: int(time.time()),
        description="Unix time the serving app started (OpenAI's field; clients require it).",
    )
    owned_by: str = "carpool"


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
