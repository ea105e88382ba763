"""Model servers on tiny random models: batching must not change results."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from carpool.errors import RequestError
from deployments.embedder import EmbedderConfig, EmbeddingServer, TextEmbedder
from deployments.ranker import (
    CrossEncoderScorer,
    LlmPointwiseScorer,
    RankerConfig,
    RankingServer,
)
from tests.factories import random_text


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tests.factories import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


def _embedder(models: dict[str, str], **batching: object) -> EmbeddingServer:
    config = EmbedderConfig.model_validate(
        {"source": {"model": models["encoder"], "max_length": 64}, "batching": batching}
    )
    return EmbeddingServer(config, TextEmbedder(config))


def test_embeddings_do_not_depend_on_batch_company(models: dict[str, str]) -> None:
    server = _embedder(models, max_batch_size=16, max_batch_tokens=256)
    rng = random.Random(0)
    texts = [random_text(rng, 1, 50) for _ in range(40)]

    async def main() -> tuple[list, list]:
        alone = [(await server.embed([t])).vectors[0] for t in texts]
        together = await asyncio.gather(*(server.embed([t]) for t in texts))
        return alone, [r.vectors[0] for r in together]

    alone, together = asyncio.run(main())
    assert server.stats()["max_items_per_pass"] > 1, "concurrent calls should have shared passes"
    for a, b in zip(alone, together, strict=True):
        assert np.abs(a - b).max() < 1e-4
        assert abs(float(np.linalg.norm(a)) - 1) < 1e-4  # normalised


def test_multi_input_request_keeps_order(models: dict[str, str]) -> None:
    server = _embedder(models)
    texts = ["short", "a much longer text " * 5, "mid length text here"]

    async def main() -> tuple:
        many = await server.embed(texts)
        single = [(await server.embed([t])).vectors[0] for t in texts]
        return many, single

    many, single = asyncio.run(main())
    assert many.token_counts[1] > many.token_counts[2] > many.token_counts[0]
    for a, b in zip(many.vectors, single, strict=True):
        assert np.abs(a - b).max() < 1e-4


def test_overlong_input_is_truncated_and_reported_or_refused(models: dict[str, str]) -> None:
    server = _embedder(models)
    long_text = "word " * 500
    result = asyncio.run(server.embed(["ok", long_text]))
    assert result.truncated == [False, True]
    assert result.token_counts[1] == 64
    with pytest.raises(RequestError) as info:
        asyncio.run(server.embed(["ok", long_text], truncate=False))
    assert info.value.status_code == 413
    assert "input[1]" in info.value.message and "truncate" in info.value.message


def test_reconfigure_validates_before_applying(models: dict[str, str]) -> None:
    server = _embedder(models, max_batch_size=8)
    with pytest.raises(ValueError):
        server.reconfigure({"max_batch_size": 0})
    assert server.limits.max_batch_size == 8
    server.reconfigure({"max_batch_size": 3, "max_batch_tokens": 64, "split_policy": "greedy"})
    assert server.limits.max_batch_size == 3
    assert server.executor.splitter.name == "greedy"


@pytest.mark.parametrize("backend", ["cross_encoder", "llm"])
def test_rank_scores_do_not_depend_on_batch_company(models: dict[str, str], backend: str) -> None:
    path = models["cross_encoder" if backend == "cross_encoder" else "causal_lm"]
    config = RankerConfig.model_validate(
        {
            "backend": backend,
            "source": {"model": path, "max_length": 128},
            "batching": {"max_batch_size": 8, "max_batch_tokens": 512},
        }
    )
    scorer = (CrossEncoderScorer if backend == "cross_encoder" else LlmPointwiseScorer)(config)
    server = RankingServer(config, scorer)
    rng = random.Random(5)
    requests = [
        (random_text(rng, 2, 8), [random_text(rng, 1, 40) for _ in range(rng.randint(1, 6))])
        for _ in range(8)
    ]

    async def main() -> tuple[list, list]:
        alone = [[(await server.rank(q, [d])).scores[0] for d in docs] for q, docs in requests]
        together = await asyncio.gather(*(server.rank(q, docs) for q, docs in requests))
        return alone, [r.scores for r in together]

    alone, together = asyncio.run(main())
    assert server.stats()["max_items_per_pass"] > 1
    for a, b in zip(alone, together, strict=True):
        assert np.allclose(a, b, atol=1e-4)


def test_llm_scorer_truncates_documents_not_the_prompt(models: dict[str, str]) -> None:
    config = RankerConfig.model_validate(
        {"backend": "llm", "source": {"model": models["causal_lm"], "max_length": 96}}
    )
    scorer = LlmPointwiseScorer(config)
    encoded = scorer.encode("what is it", ["short doc", "long " * 400], truncate=True)
    (short_ids, _), short_cut = encoded[0]
    (long_ids, _), long_cut = encoded[1]
    assert not short_cut and long_cut
    assert len(long_ids) == 96
    # The prompt's tail (the question and the answer cue) survives truncation.
    assert long_ids[-8:] == short_ids[-8:]
    with pytest.raises(RequestError) as info:
        scorer.encode("what is it", ["long " * 400], truncate=False)
    assert info.value.status_code == 413


def test_ranker_config_rejects_prompt_without_slots() -> None:
    with pytest.raises(ValueError, match="document"):
        RankerConfig.model_validate({"prompt": "Is {query} relevant?"})


def test_trim_heap_returns_freed_memory_on_glibc() -> None:
    import platform

    from carpool.models import trim_heap

    expected = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert trim_heap() is expected
