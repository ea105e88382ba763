"""The /v1/embeddings body: the EmbeddingResponse shape, float32 values exact, base64 equal."""

import base64
import json

import numpy as np

from carpool.schemas import EmbeddingResponse
from deployments.embedder import EmbedResult
from pipelines.embed import embedding_body


def _result() -> EmbedResult:
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((3, 384)).astype(np.float32)
    # Rows of one batch, one of them a strided view: what an embedder may hand back.
    vectors = [batch[0], batch[1], batch[2][::1].copy(), batch[:, 7]]
    return EmbedResult(vectors, [5, 6, 7, 8], [False, True, False, False], "m")


def test_floats_read_back_as_the_same_float32_in_the_response_shape():
    result = _result()
    raw = embedding_body(result, "float")
    response = EmbeddingResponse.model_validate(json.loads(raw))
    assert response.model == "m"
    assert response.usage.prompt_tokens == response.usage.total_tokens == 26
    assert [d.index for d in response.data] == [0, 1, 2, 3]
    assert [d.truncated for d in response.data] == [False, True, False, False]
    for data, vector in zip(response.data, result.vectors, strict=True):
        assert isinstance(data.embedding, list)
        np.testing.assert_array_equal(np.asarray(data.embedding, dtype=np.float32), vector)
    # Shortest float32 forms, not 17-digit float64 widenings: fewer bytes on every hop.
    widened = json.dumps(
        {"data": [{"embedding": v.tolist()} for v in result.vectors]}, separators=(",", ":")
    )
    assert len(raw) < 0.75 * len(widened)


def test_base64_holds_the_same_float32_bytes():
    result = _result()
    floats = json.loads(embedding_body(result, "float"))["data"]
    b64 = json.loads(embedding_body(result, "base64"))["data"]
    for f, b in zip(floats, b64, strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))
