"""The OpenAI app (one base URL for every model, issue 15): routing by ``model``, the model
list, and the pipelines' handlers rebuilt from the settings their apps report. No Ray."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError

from carpool.errors import RequestError
from carpool.http import _describe_validation_error
from pipelines.openai_api import (
    ENDPOINT_PIPELINES,
    OpenAIArgs,
    OpenAIIngress,
    pick_pipeline,
    requested_model,
    validate_body,
)

SERVED = {
    "embed": ["all-MiniLM-L6-v2"],
    "rank": ["SmolLM2-135M-Instruct"],
    "generate": ["Qwen2.5-Coder-0.5B-Instruct", "SmolLM2-135M-Instruct", "auto", "large", "small"],
    "rag": ["rag"],
}


def _refusal(endpoint: str, model: str | None, **kwargs: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        pick_pipeline(endpoint, model, kwargs.pop("served", SERVED), **kwargs)
    return info.value


# --- routing by model ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "model", "kind"),
    [
        ("/v1/embeddings", "all-MiniLM-L6-v2", "embed"),
        ("/v1/embeddings", None, "embed"),
        ("/v1/rerank", "SmolLM2-135M-Instruct", "rank"),
        ("/v2/rerank", None, "rank"),
        ("/v1/completions", "large", "generate"),
        ("/v1/chat/completions", "auto", "generate"),
        # The same served name is the ranker at /v1/rerank and the small generator here.
        ("/v1/chat/completions", "SmolLM2-135M-Instruct", "generate"),
        ("/v1/chat/completions", "rag", "rag"),
        # Omitted: generate, whose own default_model then applies, as at /generate.
        ("/v1/chat/completions", None, "generate"),
    ],
)
def test_each_model_reaches_the_pipeline_that_serves_it(
    endpoint: str, model: str | None, kind: str
) -> None:
    assert pick_pipeline(endpoint, model, SERVED) == kind


def test_an_unknown_model_gets_404_listing_the_valid_names_for_that_endpoint() -> None:
    error = _refusal("/v1/chat/completions", "gpt-4o")
    assert error.status_code == 404 and error.param == "model"
    assert error.code == "model_not_found"
    for name in ["small", "large", "auto", "rag", "Qwen2.5-Coder-0.5B-Instruct"]:
        assert repr(name) in error.message
    assert "all-MiniLM-L6-v2" not in error.message  # not a chat model


def test_a_model_of_another_endpoint_is_pointed_there() -> None:
    error = _refusal("/v1/chat/completions", "all-MiniLM-L6-v2")
    assert error.status_code == 404
    assert "is served at /v1/embeddings" in error.message
    rag_at_rerank = _refusal("/v1/rerank", "rag")
    assert "/v1/chat/completions" in rag_at_rerank.message
    assert "'SmolLM2-135M-Instruct'" in rag_at_rerank.message


def test_an_unreachable_app_is_a_503_not_a_wrong_404() -> None:
    served = {k: v for k, v in SERVED.items() if k != "rag"}
    error = _refusal(
        "/v1/chat/completions", "rag", served=served, unreachable={"rag": "not deployed"}
    )
    assert error.status_code == 503 and "not deployed" in error.message
    assert error.retry_after_s
    # Names the reachable pipeline serves still route while another app is down.
    assert pick_pipeline("/v1/chat/completions", "small", served, {"rag": "down"}) == "generate"


def test_an_endpoint_with_no_configured_pipeline_says_so() -> None:
    error = _refusal("/v1/embeddings", None, served={"generate": ["small"]})
    assert error.status_code == 404 and "GET /v1/models" in error.message


def test_every_endpoint_names_known_pipelines() -> None:
    from pipelines.openai_api import PIPELINES

    assert {k for kinds in ENDPOINT_PIPELINES.values() for k in kinds} == set(PIPELINES)


def test_args_front_the_named_apps_and_null_leaves_one_out() -> None:
    assert OpenAIArgs().apps() == {
        "embed": "embed",
        "rank": "rank",
        "generate": "generate",
        "rag": "rag",
    }
    assert OpenAIArgs(rag_app=None, embed_app="fz-embed").apps() == {
        "embed": "fz-embed",
        "rank": "rank",
        "generate": "generate",
    }
    with pytest.raises(ValueError, match="Extra inputs"):
        OpenAIArgs.model_validate({"embed": "embed"})


def test_a_non_string_model_goes_to_the_default_pipeline_whose_schema_names_it() -> None:
    from carpool.generation.schemas import ChatCompletionRequest

    assert requested_model({"model": 5}) is None
    with pytest.raises(RequestValidationError) as info:
        validate_body(ChatCompletionRequest, {"model": 5, "messages": []})
    message, param = _describe_validation_error(info.value.errors()[0])
    assert param == "model" and message.startswith("model")


def test_each_pipelines_schema_refuses_what_it_cannot_do_by_name() -> None:
    from carpool.generation.schemas import ChatCompletionRequest
    from pipelines.rag_schemas import RagChatRequest

    body = {"messages": [{"role": "user", "content": "q"}], "n": 2}
    assert validate_body(ChatCompletionRequest, body).n == 2  # generate honours n
    with pytest.raises(RequestValidationError) as info:
        validate_body(RagChatRequest, {**body, "model": "rag"})  # rag cannot
    message, _ = _describe_validation_error(info.value.errors()[0])
    assert "n is 2" in message


# --- the ingress over fake handlers -----------------------------------------------------------


class _FakeHandler:
    def __init__(self, kind: str, names: list[str]) -> None:
        self.kind = kind
        self.names = names
        self.calls: list[tuple[str, Any]] = []

    def served_names(self) -> list[str]:
        return self.names

    async def model_cards(self) -> list[Any]:
        if self.kind != "generate":
            from carpool.schemas import ModelCard

            return [ModelCard(id=self.names[0], created=1_700_000_000)]
        from carpool.schemas import ModelCard

        return [
            ModelCard(id=t, created=1_700_000_001, root=f"{t}-model", max_model_len=2048)
            for t in ("small", "large", "auto")
        ]

    async def chat_response(self, body: Any) -> str:
        self.calls.append(("chat", body))
        return self.kind


def _ingress(handlers: dict[str, Any], **args: Any) -> Any:
    """The ingress class under @serve.ingress, with these handlers already attached."""
    original = OpenAIIngress.__mro__[1]
    assert original.__name__ == "OpenAIIngress"
    obj = object.__new__(original)
    obj.args = OpenAIArgs.model_validate(args)
    obj._attached = {kind: (h, time.monotonic()) for kind, h in handlers.items()}
    obj._locks = {kind: asyncio.Lock() for kind in ("embed", "rank", "generate", "rag")}
    obj._refreshing = {}
    return obj


def _all_fakes() -> dict[str, _FakeHandler]:
    return {kind: _FakeHandler(kind, names) for kind, names in SERVED.items()}


def test_models_lists_every_pipelines_models_with_created_and_owner() -> None:
    response = asyncio.run(_ingress(_all_fakes()).models())
    body = json.loads(response.body)
    ids = [card["id"] for card in body["data"]]
    assert body["object"] == "list"
    assert ids == ["all-MiniLM-L6-v2", "SmolLM2-135M-Instruct", "small", "large", "auto", "rag"]
    for card in body["data"]:
        assert card["object"] == "model" and card["owned_by"] == "carpool"
        assert isinstance(card["created"], int) and card["created"] > 0
    assert "x-carpool-unreachable" not in response.headers


def test_models_leaves_out_an_unconfigured_pipeline() -> None:
    fakes = _all_fakes()
    del fakes["rag"]
    body = json.loads(asyncio.run(_ingress(fakes, rag_app=None).models()).body)
    assert "rag" not in [card["id"] for card in body["data"]]


def test_chat_goes_to_rag_or_generate_by_model_with_that_pipelines_schema() -> None:
    from carpool.generation.schemas import ChatCompletionRequest
    from pipelines.rag_schemas import RagChatRequest

    fakes = _all_fakes()
    ingress = _ingress(fakes)
    question = [{"role": "user", "content": "what colour is the bridge?"}]
    assert asyncio.run(ingress.chat_completions({"model": "rag", "messages": question})) == "rag"
    assert isinstance(fakes["rag"].calls[0][1], RagChatRequest)
    assert asyncio.run(ingress.chat_completions({"messages": question})) == "generate"
    assert isinstance(fakes["generate"].calls[0][1], ChatCompletionRequest)
    with pytest.raises(RequestError) as info:
        asyncio.run(ingress.chat_completions({"model": "gpt-4o", "messages": question}))
    assert info.value.status_code == 404 and "'rag'" in info.value.message


def test_a_404_looks_up_every_pipeline_to_say_where_the_name_is_served() -> None:
    fakes = _all_fakes()
    ingress = _ingress({"embed": fakes["embed"]})  # chat's pipelines not looked up yet
    looked_up: list[str] = []

    async def attach(kind: str, app: str) -> Any:
        looked_up.append(kind)
        return fakes[kind]

    ingress._attach = attach
    body = {"model": "small", "input": "hello"}
    from carpool.schemas import EmbeddingRequest

    with pytest.raises(RequestError) as info:
        asyncio.run(ingress.embeddings(EmbeddingRequest.model_validate(body)))
    assert info.value.status_code == 404
    assert "'small' is served at /v1/completions, /v1/chat/completions" in info.value.message
    assert sorted(looked_up) == ["generate", "rag", "rank"]


def test_settings_refresh_in_the_background_and_survive_an_app_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pipelines.openai_api as module

    old = _FakeHandler("embed", ["old-name"])
    new = _FakeHandler("embed", ["new-name"])
    ingress = _ingress({"embed": old})
    stale = time.monotonic() - module.SETTINGS_TTL_S - 1

    async def attach_new(kind: str, app: str) -> Any:
        return new

    async def attach_fails(kind: str, app: str) -> Any:
        raise RequestError(503, "the 'embed' app is not deployed")

    async def scenario() -> None:
        ingress._attached["embed"] = (old, stale)
        monkeypatch.setattr(ingress, "_attach", attach_new)
        assert await ingress._handler("embed", "embed") is old  # never waits for a refresh
        await ingress._refreshing["embed"]
        assert await ingress._handler("embed", "embed") is new
        ingress._attached["embed"] = (old, stale)
        monkeypatch.setattr(ingress, "_attach", attach_fails)
        await ingress._handler("embed", "embed")
        await ingress._refreshing["embed"]
        assert await ingress._handler("embed", "embed") is old  # a redeploy in progress
        assert not ingress._refreshing  # and not retried until the TTL passes again
        del ingress._attached["embed"]
        with pytest.raises(RequestError, match="not deployed"):  # first use: the 503 itself
            await ingress._handler("embed", "embed")

    asyncio.run(scenario())


# --- handlers rebuilt from an app's settings ---------------------------------------------------


def test_each_handler_attaches_with_its_apps_own_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray import serve

    from pipelines.embed import EmbedArgs, EmbedHandler
    from pipelines.generate import GenerateArgs, GenerateHandler
    from pipelines.rag import RagArgs, RagHandler
    from pipelines.rank import RankArgs, RankHandler
    from pipelines.router_access import RouterHandle

    looked_up: list[tuple[str, str]] = []

    def fake_handle(name: str, app_name: str) -> str:
        looked_up.append((app_name, name))
        return f"{app_name}/{name}"

    monkeypatch.setattr(serve, "get_deployment_handle", fake_handle)

    embed_args = EmbedArgs.model_validate(
        {
            "embedder": {"source": {"model": "x", "served_model_name": "e"}},
            "max_inputs_per_request": 7,
        }
    )
    embedder = EmbedHandler("h", embed_args, created=123)
    attached = EmbedHandler.attach("my-embed", embedder.settings())
    assert attached.args == embed_args and attached.created == 123
    assert attached.embedder == "my-embed/embedder" and attached.served_names() == ["e"]

    rank_args = RankArgs.model_validate({"ranker": {"source": {"model": "x"}}})
    ranker = RankHandler.attach("r", RankHandler("h", rank_args).settings())
    assert ranker.ranker == "r/ranker" and ranker.args == rank_args

    gen_args = GenerateArgs.model_validate({"large": None})
    generator = GenerateHandler.attach("g", GenerateHandler("s", None, gen_args, "r").settings())
    assert set(generator.handles) == {"small", "auto"}  # no large configured: none looked up
    # auto is the router that g's ingress hosts, reached through its route_* methods.
    assert isinstance(generator.handles["auto"], RouterHandle)
    assert generator.handles["auto"].app == "g"
    assert ("g", "large") not in looked_up

    rag_args = RagArgs(model_name="docs-qa", top_k=3)
    assert RagHandler.attach("q", RagHandler(rag_args).settings()).args == rag_args


def test_router_handle_maps_a_generators_calls_onto_the_hosting_ingress() -> None:
    """`auto` from another app: generate/stream/describe reach the ingress's route_*."""
    from pipelines.router_access import RouterHandle

    class Ingress:
        def __init__(self, opts: dict | None = None) -> None:
            self.opts = opts or {}

        def options(self, **kwargs: object) -> Ingress:
            return Ingress(kwargs)

        def __getattr__(self, name: str) -> str:
            return f"{name}{self.opts}"

    router = RouterHandle("g", Ingress())
    assert router.generate == "route_generate{}"
    assert router.describe == "route_describe{}"
    assert router.options(stream=True).stream == "route_stream{'stream': True}"
    with pytest.raises(AttributeError):
        _ = router.reconfigure  # only what a handler calls on a generator
