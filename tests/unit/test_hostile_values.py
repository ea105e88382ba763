"""Values that parse as JSON yet broke later stages, each refused (or survived) where it enters.

Found by fuzzing the running apps (tests/integration/test_fuzz_openapi.py and
test_hostile_inputs.py); these pin each fix without Ray.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from urllib.parse import unquote

import numpy as np
import pytest
from fastapi.testclient import TestClient

from carpool.errors import RequestError
from carpool.generation.sampling import SamplerState, SamplingParams, sample_one
from carpool.generation.schemas import ChatCompletionRequest, CompletionRequest
from carpool.http import make_api
from carpool.schemas import (
    EmbeddingRequest,
    IngestRequest,
    RerankRequest,
    SearchRequest,
    find_unservable_value,
)
from deployments.retriever import RetrievalServer
from pipelines.rag import citations_header
from pipelines.rag_schemas import RagChatRequest


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ('{"input": "a\\ud800b"}', "input"),
        ('{"input": ["ok", "\\udfff"]}', "input[1]"),
        ('{"documents": [{"id": "x", "text": "t", "metadata": {"\\ud800": 1}}]}', "a key of"),
        ('{"documents": [{"id": "x", "text": "t", "metadata": {"k": NaN}}]}', "metadata.k is nan"),
        ('{"temperature": Infinity}', "temperature is inf"),
        ('{"top_p": -Infinity}', "top_p is -inf"),
        ('{"max_tokens": 1e309}', "max_tokens is inf"),
    ],
)
def test_unservable_values_are_found_with_their_path(raw: str, where: str) -> None:
    problem = find_unservable_value(json.loads(raw))
    assert problem is not None and where in problem
    assert "send" in problem  # says what to change


def test_valid_text_and_deep_nesting_pass_without_recursion() -> None:
    # A surrogate pair in JSON decodes to one non-BMP character: valid.
    assert find_unservable_value(json.loads('{"input": "emoji \\ud83d\\ude00", "n": 1.5}')) is None
    deep: list = []
    for _ in range(200_000):  # far past Python's recursion limit
        deep = [deep]
    assert find_unservable_value({"input": deep}) is None


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (EmbeddingRequest, '{"input": ["fine", "\\ud800"]}'),
        (EmbeddingRequest, '{"input": "a", "dimensions": NaN}'),
        (RerankRequest, '{"query": "q", "documents": ["\\udc00"]}'),
        (SearchRequest, '{"query": "q", "top_k": 1e309}'),
        (IngestRequest, '{"documents": [{"id": "m", "text": "x", "metadata": {"a": Infinity}}]}'),
        (CompletionRequest, '{"prompt": "\\ud800"}'),
        (CompletionRequest, '{"prompt": "a", "stop": ["\\udfff"]}'),
        (CompletionRequest, '{"prompt": "a", "temperature": NaN}'),
        (ChatCompletionRequest, '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        (RagChatRequest, '{"messages": [{"role": "user", "content": "q"}], "top_p": NaN}'),
    ],
)
def test_request_schemas_refuse_surrogates_and_non_finite_numbers(model: type, body: str) -> None:
    with pytest.raises(ValueError, match=r"lone UTF-16 surrogate|finite number"):
        model.model_validate(json.loads(body))


def test_citation_header_carries_any_id() -> None:
    ids = ["quillon", "carpool:operations", "a,b", "x\r\ny", "\U00025244", "caf\u00e9"]
    header = citations_header(ids)
    header.encode("ascii")  # a header value must be latin-1; ASCII is safest
    assert "\r" not in header and "\n" not in header
    assert [unquote(i) for i in header.split(",")] == ids
    assert header.split(",")[:2] == ["quillon", "carpool:operations"]


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-12])
def test_tiny_top_p_samples_the_best_token_not_nan(top_p: float) -> None:
    import torch

    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    token = sample_one(logits, SamplerState(SamplingParams(top_p=top_p, seed=1)))
    assert token == int(logits.argmax())


@pytest.fixture
def client() -> Iterator[TestClient]:
    api = make_api("t", "t", 300_000)

    @api.post("/v1/echo")
    async def echo(body: EmbeddingRequest) -> dict:
        return {"n": len(body.texts())}

    with TestClient(api) as c:
        yield c


def test_deeply_nested_body_is_a_400_that_says_so(client: TestClient) -> None:
    r = client.post(
        "/v1/echo",
        content=b"[" * 100_000 + b"]" * 100_000,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "json_too_deep"


def test_invalid_utf8_body_is_a_400_that_says_so(client: TestClient) -> None:
    r = client.post(
        "/v1/echo", content=b'{"input": "\xff\xfe"}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert "UTF-8" in r.json()["error"]["message"]


def test_body_over_the_cap_without_content_length_is_a_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"input": "'
        for _ in range(8):
            yield b"a" * 64 * 1024
        yield b'"}'

    r = client.post("/v1/echo", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert "300000 bytes" in r.json()["error"]["message"]


def test_whole_body_problems_read_without_a_body_prefix(client: TestClient) -> None:
    r = client.post(
        "/v1/echo", content=b'{"input": "\\ud800"}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("input holds a lone UTF-16 surrogate")
    empty = client.post("/v1/echo", content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]


def test_large_ingest_waits_out_embedder_overload_instead_of_failing() -> None:
    # A stand-in embedder that, like the real one's admission control, refuses with 503
    # "overloaded" while it is busy with another call.
    in_flight = 0
    refused = 0
    most = 0

    async def embed(texts: list[str]) -> list[np.ndarray]:
        nonlocal in_flight, refused, most
        if in_flight >= 1:
            refused += 1
            raise RequestError(503, "busy", code="overloaded", retry_after_s=0.01)
        in_flight += 1
        most = max(most, in_flight)
        try:
            await asyncio.sleep(0.002)
            return [np.ones(4, dtype=np.float32) / 2 for _ in texts]
        finally:
            in_flight -= 1

    config = {"index_dir": "", "seed_default_corpus": False, "embed_batch_texts": 4}
    server = RetrievalServer(config, embed)
    docs = [{"id": f"d{i}", "text": f"text {i}", "metadata": {}} for i in range(200)]
    result = asyncio.run(server.add_documents(docs))
    assert result["chunks"] == 200 and most == 1
    assert refused > 0  # the refusals happened and were waited out


def test_ingest_does_not_retry_what_is_not_overload() -> None:
    calls = 0

    async def embed(texts: list[str]) -> list[np.ndarray]:
        nonlocal calls
        calls += 1
        if len(texts) > 1:
            raise RequestError(413, "too long", code="too_long")
        return [np.ones(4, dtype=np.float32) / 2]

    server = RetrievalServer({"index_dir": "", "seed_default_corpus": False}, embed)
    with pytest.raises(RequestError, match="too long"):
        asyncio.run(server.add_documents([{"id": "a", "text": "x"}, {"id": "b", "text": "y"}]))
    assert calls == 2  # the dimension probe, then the one refused call; no retry


def test_non_finite_numbers_never_reach_a_json_response() -> None:
    # What the rag and search responses hit before: metadata NaN stored, then json.dumps
    # refused it on every answer citing that document.
    with pytest.raises(ValueError):
        json.dumps({"a": math.nan}, allow_nan=False)
    with pytest.raises(ValueError, match="finite"):
        IngestRequest.model_validate(
            {"documents": [{"id": "x", "text": "t", "metadata": {"a": math.nan}}]}
        )
