"""Wire schemas, config validation and model-source resolution, without Ray or models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from carpool.config import BatchingConfig, ModelSourceConfig, ReplicaConfig
from carpool.errors import ModelSourceError, RequestError, find_request_error
from carpool.http import _describe_validation_error
from carpool.models import resolve_model_source
from carpool.schemas import EmbeddingRequest, RerankRequest
from deployments.embedder import EmbedderConfig
from pipelines.embed import EmbedArgs


def test_embedding_request_accepts_a_string_or_a_list() -> None:
    assert EmbeddingRequest(input="hi").texts() == ["hi"]
    assert EmbeddingRequest(input=["a", "b"]).texts() == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input": []}, "empty list"),
        ({"input": ["ok", "  "]}, "input[1]"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "stream": True}, "stream"),
    ],
)
def test_embedding_request_errors_name_the_field(body: dict, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        EmbeddingRequest.model_validate(body)
    messages = " ".join(_describe_validation_error(e)[0] for e in info.value.errors())
    assert fragment in messages


def test_rerank_request_rules() -> None:
    with pytest.raises(ValidationError):
        RerankRequest(query="q", documents=[])
    with pytest.raises(ValidationError):
        RerankRequest(query="q", documents=["a"], top_n=0)
    assert RerankRequest(query="q", documents=["a", "b"], top_n=5).top_n == 5


def test_batching_config_is_bounded_and_strict() -> None:
    with pytest.raises(ValidationError):
        BatchingConfig(max_batch_size=0)
    with pytest.raises(ValidationError):
        BatchingConfig.model_validate({"max_batch_sise": 8})  # typo must not pass silently
    with pytest.raises(ValidationError):
        BatchingConfig.model_validate({"split_policy": "fastest"})


def test_serve_options_size_ongoing_requests_for_batching() -> None:
    options = ReplicaConfig(num_cpus=0.25).serve_options("x", BatchingConfig(max_batch_size=32))
    assert options["max_ongoing_requests"] >= 32 * 4
    assert options["ray_actor_options"]["num_cpus"] == 0.25


def test_served_model_name_defaults_to_the_last_path_part() -> None:
    assert ModelSourceConfig(model="packaged:all-MiniLM-L6-v2").served_model_name == (
        "all-MiniLM-L6-v2"
    )
    assert ModelSourceConfig(model="BAAI/bge-small-en/").served_model_name == "bge-small-en"
    assert EmbedArgs().embedder.source.model == EmbedderConfig().source.model


def test_model_sources_resolve_or_say_what_to_do(tmp_path) -> None:
    assert resolve_model_source(str(tmp_path)) == str(tmp_path)
    assert resolve_model_source("org/some-model") == "org/some-model"  # a hub id, untouched
    with pytest.raises(ModelSourceError, match="choose one of"):
        resolve_model_source("packaged:nope")
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model_source("/no/such/folder")


def test_request_errors_survive_wrapping() -> None:
    inner = RequestError(413, "too long", param="input[0]")
    try:
        try:
            raise inner
        except RequestError as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as outer:
        assert find_request_error(outer) is inner
    assert find_request_error(ValueError("x")) is None
