"""The clients people already use, pointed at serve.yaml's one base URL (issue 15).

LangChain's ``ChatOpenAI`` (plain, ``with_structured_output``, ``bind_tools``) and
``OpenAIEmbeddings``, LlamaIndex's ``OpenAILike`` and Cohere's v2 client, each with its
default settings except the base URL (and, for ``OpenAIEmbeddings``, the setting its docs
give for servers other than OpenAI). Assertions are on structure and on agreement with
carpool's own endpoints, never on how good the small models' answers are.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from pydantic import BaseModel, Field

EMBEDDER = "all-MiniLM-L6-v2"
RANKER = "SmolLM2-135M-Instruct"
# Qwen2.5's chat template knows tools; SmolLM2's does not.
TOOL_MODEL = "large"
TIMEOUT_S = 600  # two CPU cores, models shared with the rest of the suite


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=12, description="First name")
    age: int = Field(ge=0, le=120)


def get_weather(city: str) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def base(default_apps: str) -> str:
    return f"{default_apps}/v1"


def chat_model(base: str, model: str, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=base, api_key="unused", model=model, timeout=TIMEOUT_S, max_retries=3, **kw
    )


def test_langchain_chat_invoke(base: str) -> None:
    reply = chat_model(base, "small", max_tokens=16, temperature=0).invoke(
        "What is the capital of France?"
    )
    assert isinstance(reply.content, str) and reply.content.strip()
    assert reply.response_metadata["finish_reason"] in {"stop", "length"}


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(base: str, method: str) -> None:
    llm = chat_model(base, TOOL_MODEL, max_tokens=96, temperature=0)
    structured = llm.with_structured_output(Person, method=method, include_raw=True)
    prompt = "Ada is 36 years old. Extract the person."
    if method == "json_mode":
        prompt += ' Answer in JSON with keys "name" and "age".'
    out = structured.invoke(prompt)
    assert out["parsing_error"] is None, out["raw"]
    person = out["parsed"]
    assert isinstance(person, Person)
    assert 0 <= person.age <= 120 and person.name


def test_langchain_bind_tools_forced_and_auto(base: str) -> None:
    llm = chat_model(base, TOOL_MODEL, max_tokens=64, temperature=0)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?"
    )
    assert [call["name"] for call in forced.tool_calls] == ["get_weather"]
    assert isinstance(forced.tool_calls[0]["args"].get("city"), str)
    assert forced.tool_calls[0]["id"]
    # "auto": a tool call or text, both well-formed; a call must name a bound tool.
    auto = llm.bind_tools([get_weather]).invoke("What is the weather in Rome?")
    assert auto.tool_calls or (isinstance(auto.content, str) and auto.content.strip())
    assert all(call["name"] == "get_weather" for call in auto.tool_calls)


def test_langchain_embeddings_default_chunk_size(base: str, default_apps: str) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        base_url=base,
        api_key="unused",
        model=EMBEDDER,
        check_embedding_ctx_length=False,  # its documented setting for non-OpenAI servers
        timeout=TIMEOUT_S,
        max_retries=3,
    )
    assert embeddings.chunk_size == 1000  # the default, so 1,100 texts take two requests
    texts = [f"document number {i} about rivers and bridges" for i in range(1100)]
    vectors = embeddings.embed_documents(texts)
    assert len(vectors) == 1100 and all(len(v) == 384 for v in vectors)
    sample = [0, 999, 1000, 1099]
    own = httpx.post(
        f"{default_apps}/embed/v1/embeddings",
        json={"input": [texts[i] for i in sample]},
        timeout=TIMEOUT_S,
    ).json()["data"]
    np.testing.assert_allclose(
        [vectors[i] for i in sample], [d["embedding"] for d in own], atol=1e-5
    )
    query = embeddings.embed_query("bridges")
    assert len(query) == 384


def test_langchain_embeddings_default_sends_tiktoken_ids_and_gets_told_the_setting(
    base: str,
) -> None:
    """With ``check_embedding_ctx_length=True`` (the default) LangChain tokenises with
    tiktoken's cl100k_base and posts the ids. tiktoken fetches that encoding from the
    internet, which this machine cannot reach, so the request LangChain would send is posted
    here as it would be: token-id arrays, ids beyond the embedder's vocabulary."""
    tiktoken_ids = [[15339, 1917, 100000], [9906, 11, 1268, 527, 499, 30]]
    response = httpx.post(
        f"{base}/embeddings",
        json={"model": EMBEDDER, "input": tiktoken_ids, "encoding_format": "base64"},
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 400, response.text
    assert "check_embedding_ctx_length" in response.json()["error"]["message"]


def test_llamaindex_openai_like_chat_and_completion(base: str) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    def llm(is_chat_model: bool, max_tokens: int) -> OpenAILike:
        return OpenAILike(
            api_base=base,
            api_key="unused",
            model="small",
            is_chat_model=is_chat_model,
            max_tokens=max_tokens,
            temperature=0,
            timeout=TIMEOUT_S,
        )

    chat_llm = llm(is_chat_model=True, max_tokens=16)
    reply = chat_llm.chat([ChatMessage(role="user", content="Name a colour.")])
    assert reply.message.content and reply.message.content.strip()
    assert chat_llm.complete("The sky is").text.strip()
    completion_llm = llm(is_chat_model=False, max_tokens=8)
    text = completion_llm.complete("The sky is").text
    own = httpx.post(
        f"{base}/completions",
        json={"model": "small", "prompt": "The sky is", "max_tokens": 8, "temperature": 0},
        timeout=TIMEOUT_S,
    ).json()["choices"][0]["text"]
    assert text == own and text.strip()
    streamed = "".join(r.delta or "" for r in completion_llm.stream_complete("The sky is"))
    assert streamed == own


def test_cohere_v2_rerank(default_apps: str) -> None:
    import cohere

    client = cohere.ClientV2(base_url=default_apps, api_key="unused", timeout=TIMEOUT_S)
    documents = [
        "Paris is the capital of France.",
        "Bananas are yellow.",
        "The Eiffel Tower is in Paris.",
    ]
    result = client.rerank(
        model=RANKER, query="What is the capital of France?", documents=documents, top_n=2
    )
    assert len(result.results) == 2
    scores = [r.relevance_score for r in result.results]
    assert scores == sorted(scores, reverse=True)
    assert {r.index for r in result.results} <= {0, 1, 2}
    # The same order as carpool's own /v1/rerank gives for the same request.
    own = httpx.post(
        f"{default_apps}/v1/rerank",
        json={"model": RANKER, "query": "What is the capital of France?", "documents": documents},
        timeout=TIMEOUT_S,
    ).json()["results"]
    assert [r.index for r in result.results] == [r["index"] for r in own[:2]]
