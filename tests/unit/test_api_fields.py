"""OpenAI/Cohere fields real clients send: honoured or refused by name (issue 15).

No Ray: request models, the call a pipeline hands its generator, pooling read from a model
folder, and token-id inputs on a tiny real encoder.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipelines.rag_schemas import RagChatRequest, generation_call

Q = [{"role": "user", "content": "What colour is the bridge?"}]


def _rag(**fields: object) -> RagChatRequest:
    return RagChatRequest.model_validate({"messages": Q, **fields})


def _rag_error(**fields: object) -> str:
    with pytest.raises(ValidationError) as info:
        _rag(**fields)
    return str(info.value)


def test_rag_passes_sampling_fields_to_the_generator() -> None:
    body = _rag(
        stop=["\n\n", "END"],
        seed=7,
        temperature=0.3,
        top_p=0.9,
        n=1,
        max_tokens=5,
        presence_penalty=0.5,
        frequency_penalty=-1,
    )
    call = generation_call(body, "SYS", 5)
    # What the generator replica reads (its model ignores unknown keys, so check the names).
    from carpool.generation.schemas import GenerationCall

    parsed = GenerationCall.model_validate(call)
    assert (parsed.presence_penalty, parsed.frequency_penalty) == (0.5, -1.0)
    assert call["stop"] == ["\n\n", "END"]
    assert call["seed"] == 7
    assert call["temperature"] == 0.3 and call["top_p"] == 0.9
    assert call["n"] == 1 and call["max_tokens"] == 5
    assert call["messages"][0] == {"role": "system", "content": "SYS"}
    assert call["messages"][-1]["content"] == Q[0]["content"]


def test_rag_uses_openai_defaults_for_absent_or_null_fields() -> None:
    for body in (_rag(), _rag(temperature=None, top_p=None, n=None, stop=None, seed=None)):
        call = generation_call(body, "SYS", 5)
        assert call["temperature"] == 1.0  # OpenAI's default, not greedy
        assert call["top_p"] == 1.0
        assert call["stop"] == [] and call["seed"] is None
    assert generation_call(_rag(stop="X"), "S", 5)["stop"] == ["X"]


def test_rag_keeps_client_system_messages_after_its_own() -> None:
    body = RagChatRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Answer in French."},
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Où est "},
                        {"type": "text", "text": "Paris?"},
                    ],
                },
            ]
        }
    )
    call = generation_call(body, "SOURCES", 5)
    system = call["messages"][0]["content"]
    assert system.startswith("SOURCES") and "Answer in French." in system and "Be brief." in system
    assert [m["role"] for m in call["messages"]] == ["system", "user"]
    assert call["messages"][1]["content"] == "Où est Paris?"


def test_rag_streams_usage_only_when_asked() -> None:
    assert _rag(stream=True, stream_options={"include_usage": True}).include_usage()
    assert not _rag(stream=True).include_usage()
    assert "stream_options" in _rag_error(stream_options={"include_usage": True})


@pytest.mark.parametrize(
    ("fields", "named", "advice"),
    [
        ({"n": 2}, "n", "set it to 1"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "remove tools"),
        ({"tool_choice": "auto"}, "tool_choice", "remove tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format", "remove"),
        ({"logit_bias": {"5": 1}}, "logit_bias", "remove"),
        ({"logprobs": True}, "logprobs", "remove"),
        ({"top_logprobs": 2}, "top_logprobs", "remove"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"reasoning_effort": "low"}, "reasoning_effort", None),
        ({"temprature": 0.5}, "temprature", None),
        ({"stop": ["a"] * 5}, "stop", "at most"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "only one"),
    ],
)
def test_rag_refuses_what_it_cannot_honour_by_name(
    fields: dict, named: str, advice: str | None
) -> None:
    message = _rag_error(**fields)
    assert named in message
    if advice:
        assert advice in message


def test_rag_refuses_unknown_fields_in_messages_and_tool_roles() -> None:
    with pytest.raises(ValidationError, match="tool_calls"):
        RagChatRequest.model_validate(
            {"messages": [*Q, {"role": "assistant", "content": "x", "tool_calls": []}]}
        )
    with pytest.raises(ValidationError, match="role"):
        RagChatRequest.model_validate({"messages": [*Q, {"role": "tool", "content": "x"}]})


def test_rag_accepts_values_that_ask_for_what_it_does() -> None:
    # Neutral values clients send by default are not refusals.
    body = _rag(
        n=1,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        presence_penalty=0,
        frequency_penalty=None,
        logprobs=False,
        parallel_tool_calls=None,
        user="me",
    )
    assert body.question() == Q[0]["content"]


# --- embeddings: token-id inputs -------------------------------------------------------------


def _embed_error(value: object) -> str:
    from carpool.schemas import EmbeddingRequest

    with pytest.raises(ValidationError) as info:
        EmbeddingRequest.model_validate({"input": value})
    return str(info.value)


def test_embedding_input_takes_every_openai_shape() -> None:
    from carpool.schemas import EmbeddingRequest

    one = EmbeddingRequest.model_validate({"input": [101, 7592, 102]})
    assert one.is_token_ids() and one.token_ids() == [[101, 7592, 102]] and one.count() == 1
    many = EmbeddingRequest.model_validate({"input": [[101, 102], [101, 7592, 102]]})
    assert many.token_ids() == [[101, 102], [101, 7592, 102]] and many.texts() == []
    texts = EmbeddingRequest.model_validate({"input": ["a", "b"]})
    assert not texts.is_token_ids() and texts.texts() == ["a", "b"] and texts.count() == 2
    assert EmbeddingRequest.model_validate({"input": "a"}).texts() == ["a"]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ([1, "a"], "input[1] is a string"),
        (["a", 1], "input[1] is the integer 1"),
        ([[1, 2], [3, "x"]], "input[1] is a list"),
        ([[1, 2], []], "input[1] is an empty list of token ids"),
        ([-5, 2], "never negative"),
        ([True, 2], "input[0] is a boolean"),
        ([1.5], "non-integer"),
        (42, "send a string, a list of strings, a list of token ids"),
        ([None], "input[0] is null"),
    ],
)
def test_embedding_input_errors_name_the_item_and_the_shapes(value: object, fragment: str) -> None:
    message = _embed_error(value)
    assert fragment in message
    # One clear message, not pydantic's dump of every union branch.
    assert "input.str" not in message and "list[int]" not in message


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tests.factories import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny-api"))


def _embedder(path: str, **source: object):
    from deployments.embedder import EmbedderConfig, EmbeddingServer, TextEmbedder

    config = EmbedderConfig.model_validate({"source": {"model": path, **source}})
    return EmbeddingServer(config, TextEmbedder(config))


def test_token_ids_embed_like_the_text_they_encode(tiny: dict[str, str]) -> None:
    import asyncio

    import numpy as np

    server = _embedder(tiny["encoder"], max_length=64)
    texts = ["the river city", "paris is the capital of france"]
    ids = server.model.tokenize(texts)
    from_text = asyncio.run(server.embed(texts))
    from_ids = asyncio.run(server.embed_tokens(ids))
    assert from_ids.token_counts == from_text.token_counts
    for a, b in zip(from_text.vectors, from_ids.vectors, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_foreign_token_ids_are_refused_with_the_langchain_setting(tiny: dict[str, str]) -> None:
    import asyncio

    from carpool.errors import RequestError

    server = _embedder(tiny["encoder"], max_length=64)
    # tiktoken (cl100k) ids run past a BERT vocabulary of 30522.
    with pytest.raises(RequestError) as info:
        asyncio.run(server.embed_tokens([[101, 102], [15339, 100257]]))
    assert info.value.status_code == 400
    assert "input[1]" in info.value.message and "100257" in info.value.message
    assert "check_embedding_ctx_length=False" in info.value.message


def test_long_token_ids_are_cut_or_refused(tiny: dict[str, str]) -> None:
    import asyncio

    from carpool.errors import RequestError

    server = _embedder(tiny["encoder"], max_length=16)
    long = [101, *([1996] * 40), 102]
    result = asyncio.run(server.embed_tokens([[101, 102], long]))
    assert result.truncated == [False, True] and result.token_counts == [2, 16]
    with pytest.raises(RequestError) as info:
        asyncio.run(server.embed_tokens([long], truncate=False))
    assert info.value.status_code == 413 and "truncate" in info.value.message


# --- rerank: Cohere v2 shape; model cards ----------------------------------------------------


def test_cohere_v2_rerank_request_takes_strings_and_text_objects() -> None:
    from carpool.schemas import CohereRerankRequest

    body = CohereRerankRequest.model_validate(
        {
            "model": "ranker",
            "query": "capital of France",
            "documents": ["Paris is in France.", {"text": "Berlin is in Germany."}],
            "top_n": 1,
            "max_tokens_per_doc": 4096,
        }
    )
    assert body.texts() == ["Paris is in France.", "Berlin is in Germany."]
    for bad, fragment in (
        ({"documents": []}, "empty list"),
        ({"documents": ["ok", " "]}, "documents[1]"),
        ({"documents": ["a"], "rank_fields": ["title"]}, "rank_fields"),
        ({"documents": [{"text": "a", "title": "t"}]}, "title"),
    ):
        with pytest.raises(ValidationError, match=fragment.replace("[", r"\[")):
            CohereRerankRequest.model_validate({"query": "q", **bad})


def test_model_cards_carry_created() -> None:
    import time

    from carpool.schemas import ModelCard

    card = ModelCard(id="embedder").model_dump()
    assert abs(card["created"] - time.time()) < 60
    assert ModelCard(id="x", created=5).model_dump()["created"] == 5


# --- pooling ---------------------------------------------------------------------------------


def _st_folder(root, flags: dict, modules_path: str | None = "1_Pooling"):
    import json
    import shutil

    shutil.copytree(root, root.parent / (root.name + "-st"), dirs_exist_ok=False)
    folder = root.parent / (root.name + "-st")
    if modules_path is not None:
        (folder / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "x.Transformer"},
                    {"idx": 1, "name": "1", "path": modules_path, "type": "x.Pooling"},
                ]
            )
        )
        target = folder / modules_path
    else:
        target = folder / "1_Pooling"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **flags}))
    return folder


@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
        ({"pooling_mode_mean_tokens": True}, "mean"),
        ({"pooling_mode_max_tokens": True}, "max"),
        ({"pooling_mode_lasttoken": True}, "lasttoken"),
        ({"pooling_mode": "cls_token"}, "cls"),
    ],
)
def test_pooling_is_read_from_the_sentence_transformers_config(
    tmp_path, flags: dict, mode: str
) -> None:
    from carpool.models import read_pooling_config, resolve_pooling

    folder = tmp_path / "m"
    folder.mkdir()
    folder = _st_folder(folder, flags)
    assert read_pooling_config(folder) == mode
    assert resolve_pooling(None, str(folder), "bert") == mode
    # An explicit setting wins over the folder.
    assert resolve_pooling("max", str(folder), "bert") == "max"


def test_pooling_module_path_comes_from_modules_json(tmp_path) -> None:
    from carpool.models import read_pooling_config

    folder = tmp_path / "m"
    folder.mkdir()
    folder = _st_folder(folder, {"pooling_mode_cls_token": True}, modules_path="2_Pool")
    assert read_pooling_config(folder) == "cls"


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len_tokens"),
        ({"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "cls + mean"),
        ({}, "no mode"),
    ],
)
def test_pooling_carpool_cannot_apply_is_refused(tmp_path, flags: dict, fragment: str) -> None:
    from carpool.models import PoolingError, resolve_pooling

    folder = tmp_path / "m"
    folder.mkdir()
    folder = _st_folder(folder, flags)
    with pytest.raises(PoolingError) as info:
        resolve_pooling(None, str(folder), "bert")
    assert fragment in str(info.value) and "`pooling`" in str(info.value)


def test_pooling_without_config_is_mean_for_encoders_and_refused_otherwise(tmp_path) -> None:
    from carpool.models import PoolingError, resolve_pooling

    assert resolve_pooling(None, str(tmp_path), "bert") == "mean"
    assert resolve_pooling(None, None, "xlm-roberta") == "mean"
    with pytest.raises(PoolingError, match="lasttoken"):
        resolve_pooling(None, str(tmp_path), "qwen2")
    assert resolve_pooling("lasttoken", str(tmp_path), "qwen2") == "lasttoken"


def test_the_packaged_minilm_folder_says_mean() -> None:
    from carpool.models import read_pooling_config, resolve_model_source

    assert read_pooling_config(resolve_model_source("packaged:all-MiniLM-L6-v2")) == "mean"


def test_embedder_applies_the_folders_pooling(tiny: dict[str, str], tmp_path) -> None:
    import asyncio
    import shutil
    from pathlib import Path

    import numpy as np
    import torch
    from transformers import AutoModel

    src = Path(tiny["encoder"])
    folder = _st_folder(
        Path(shutil.copytree(src, tmp_path / "enc")), {"pooling_mode_cls_token": True}
    )
    server = _embedder(str(folder), max_length=64)
    assert server.model.pooling == "cls"
    text = "the river city"
    got = asyncio.run(server.embed([text])).vectors[0]
    model = AutoModel.from_pretrained(folder).eval()
    ids = torch.tensor([server.model.tokenize([text])[0]])
    with torch.no_grad():
        cls = model(input_ids=ids).last_hidden_state[0, 0]
    want = torch.nn.functional.normalize(cls, dim=0).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    # The plain folder (no Pooling config, BERT) stays mean-pooled, and differs.
    plain = asyncio.run(_embedder(str(src), max_length=64).embed([text])).vectors[0]
    assert not np.allclose(plain, got, atol=1e-3)


def test_pool_modes_on_padded_rows() -> None:
    import torch

    from deployments.embedder import pool

    hidden = torch.tensor(
        [[[1.0, 5.0], [3.0, -1.0], [100.0, 100.0]], [[2.0, 2.0], [4.0, 0.0], [6.0, 1.0]]]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert pool(hidden, mask, "cls").tolist() == [[1.0, 5.0], [2.0, 2.0]]
    assert pool(hidden, mask, "mean").tolist() == [[2.0, 2.0], [4.0, 1.0]]
    assert pool(hidden, mask, "max").tolist() == [[3.0, 5.0], [6.0, 2.0]]
    assert pool(hidden, mask, "lasttoken").tolist() == [[3.0, -1.0], [6.0, 1.0]]


# --- the ingress routes without Serve: real model servers behind a plain-Python handle -------


class _Method:
    """``handle.method.remote(...)`` over a plain-Python server (what Serve's handle does)."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args, **kwargs):
        import asyncio

        result = self._fn(*args, **kwargs)
        return result if asyncio.iscoroutine(result) else _done(result)


async def _done(value):
    return value


class _Handle:
    def __init__(self, server: object, *methods: str) -> None:
        for name in methods:
            setattr(self, name, _Method(getattr(server, name)))


def _ingress(cls, **attrs):
    """An ingress instance without Serve's replica machinery (only its route methods)."""
    # @serve.ingress subclasses the class we wrote (with an ASGI wrapper whose __del__ is a
    # coroutine); the class under it holds the route methods.
    original = cls.__mro__[1]
    assert original.__name__ == cls.__name__ and "__del__" not in original.__dict__
    obj = object.__new__(original)
    obj.__dict__.update(attrs)
    return obj


@pytest.fixture(scope="module")
def rank_ingress(tiny: dict[str, str]):
    import time

    from deployments.ranker import RankerConfig, RankingServer
    from pipelines.rank import RankArgs, RankIngress

    args = RankArgs.model_validate(
        {
            "ranker": {
                "backend": "cross_encoder",
                "source": {"model": tiny["cross_encoder"], "max_length": 64},
            }
        }
    )
    server = RankingServer(RankerConfig.model_validate(args.ranker.model_dump()))
    return _ingress(
        RankIngress,
        args=args,
        ranker=_Handle(server, "rank", "describe"),
        model_name="ranker",
        created=int(time.time()),
        _described=None,
    )


def _json(response) -> dict:
    import json

    return json.loads(response.body)


def test_v2_rerank_route_answers_in_cohere_shape(rank_ingress) -> None:
    import asyncio

    from carpool.schemas import CohereRerankRequest, RerankRequest

    docs = ["the river", "a city", "music and guitar"]
    v2 = _json(
        asyncio.run(
            rank_ingress.rerank_v2(
                CohereRerankRequest(query="river", documents=[docs[0], {"text": docs[1]}, docs[2]])
            )
        )
    )
    v1 = _json(asyncio.run(rank_ingress.rerank(RerankRequest(query="river", documents=docs))))
    assert [r["index"] for r in v2["results"]] == [r["index"] for r in v1["results"]]
    assert [r["relevance_score"] for r in v2["results"]] == pytest.approx(
        [r["relevance_score"] for r in v1["results"]]
    )
    assert all(set(r) == {"index", "relevance_score"} for r in v2["results"])
    assert v2["meta"]["billed_units"] == {"search_units": 1}
    assert v2["meta"]["tokens"]["input_tokens"] == v1["usage"]["total_tokens"]
    top = _json(
        asyncio.run(
            rank_ingress.rerank_v2(
                CohereRerankRequest(query="river", documents=docs, top_n=1, return_documents=True)
            )
        )
    )
    assert len(top["results"]) == 1
    assert top["results"][0]["document"]["text"] == docs[top["results"][0]["index"]]


def test_v2_rerank_refuses_max_tokens_per_doc_below_the_rankers_limit(rank_ingress) -> None:
    import asyncio

    from carpool.errors import RequestError
    from carpool.schemas import CohereRerankRequest

    with pytest.raises(RequestError) as info:
        asyncio.run(
            rank_ingress.rerank_v2(
                CohereRerankRequest(query="q", documents=["a"], max_tokens_per_doc=10)
            )
        )
    assert info.value.status_code == 400
    assert "max_tokens_per_doc" in info.value.message and "64" in info.value.message
    ok = asyncio.run(
        rank_ingress.rerank_v2(
            CohereRerankRequest(query="q", documents=["a"], max_tokens_per_doc=64)
        )
    )
    assert ok.status_code == 200
    cards = asyncio.run(rank_ingress.models()).model_dump()["data"]
    assert cards[0]["created"] == rank_ingress.created


@pytest.fixture(scope="module")
def embed_ingress(tiny: dict[str, str]):
    import time

    from deployments.embedder import EmbedderConfig, EmbeddingServer, TextEmbedder
    from pipelines.embed import EmbedArgs, EmbedIngress

    args = EmbedArgs.model_validate(
        {"embedder": {"source": {"model": tiny["encoder"], "max_length": 64}}}
    )
    config = EmbedderConfig.model_validate(args.embedder.model_dump())
    server = EmbeddingServer(config, TextEmbedder(config))
    return _ingress(
        EmbedIngress,
        args=args,
        embedder=_Handle(server, "embed", "embed_tokens"),
        model_name="embedder",
        created=int(time.time()),
    )


def test_embeddings_route_takes_token_ids_and_2048_inputs(embed_ingress) -> None:
    import asyncio

    import numpy as np

    from carpool.errors import RequestError
    from carpool.schemas import EmbeddingRequest
    from tests.factories import bert_tokenizer

    texts = ["the river city", "paris is the capital of france"]
    ids = bert_tokenizer()(texts)["input_ids"]
    by_text = _json(asyncio.run(embed_ingress.embed_response(EmbeddingRequest(input=texts))))
    by_ids = _json(asyncio.run(embed_ingress.embed_response(EmbeddingRequest(input=ids))))
    np.testing.assert_allclose(
        [d["embedding"] for d in by_text["data"]],
        [d["embedding"] for d in by_ids["data"]],
        atol=1e-5,
    )
    assert by_ids["usage"]["prompt_tokens"] == sum(len(s) for s in ids)
    many = _json(asyncio.run(embed_ingress.embed_response(EmbeddingRequest(input=["w"] * 2048))))
    assert len(many["data"]) == 2048
    with pytest.raises(RequestError) as info:
        asyncio.run(embed_ingress.embed_response(EmbeddingRequest(input=["w"] * 2049)))
    assert info.value.status_code == 400
    assert "2048" in info.value.message and "chunk_size" in info.value.message
    with pytest.raises(RequestError) as info:
        asyncio.run(embed_ingress.embed_response(EmbeddingRequest(input=[[101, 102], [100257]])))
    assert info.value.status_code == 400 and "check_embedding_ctx_length" in info.value.message


def test_rag_model_must_be_what_the_app_serves() -> None:
    from carpool.errors import RequestError
    from pipelines.rag import RagArgs, RagIngress

    ingress = _ingress(RagIngress, args=RagArgs())
    ingress._check_model(None)
    ingress._check_model("rag")
    with pytest.raises(RequestError) as info:
        ingress._check_model("gpt-4o")
    assert info.value.status_code == 404 and "'rag'" in info.value.message
    renamed = _ingress(RagIngress, args=RagArgs(model_name="docs-qa"))
    renamed._check_model("docs-qa")
    with pytest.raises(RequestError):
        renamed._check_model("rag")


def test_truncation_is_exact_while_other_requests_tokenize(tiny: dict[str, str]) -> None:
    # A fast tokenizer's truncation is state every call rewrites; a truncating call racing
    # another request's tokenize in a worker thread once came back uncut.
    import threading

    server = _embedder(tiny["encoder"], max_length=16)
    model = server.model
    long = " ".join(["river city"] * 60)
    expected = model.truncate(long)
    assert len(expected) == 16 and expected[-1] == model.tokenizer.sep_token_id
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            model.tokenize([long] * 8)

    workers = [threading.Thread(target=churn) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        results = [model.truncate(long) for _ in range(300)]
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert all(r == expected for r in results)


def test_search_app_lists_itself_with_created() -> None:
    import asyncio
    import time

    from pipelines.search import SearchIngress, api

    assert "get" in api.openapi()["paths"]["/v1/models"]
    original = SearchIngress.__mro__[1]  # the class under @serve.ingress's wrapper
    before = int(time.time())
    # Niceness 0: a real ingress lowers its own process and the Serve proxy on its node,
    # which here would be the test runner and any Ray proxy on the machine.
    quiet = {"cpu_niceness": 0, "proxy_cpu_niceness": 0}
    ingress = original(retriever=None, args={"app_name": "docs-search", "ingress": quiet})
    cards = asyncio.run(ingress.models()).model_dump()
    assert cards["object"] == "list"
    assert [c["id"] for c in cards["data"]] == ["docs-search"]
    assert cards["data"][0]["object"] == "model"
    assert before <= cards["data"][0]["created"] <= int(time.time())
