"""Deadline and priority headers against the real serve config and packaged models."""

from __future__ import annotations

import time

import httpx
import pytest

GOOD = {
    "embed": ("/embed/v1/embeddings", {"input": ["a sentence to embed"]}),
    "rank": ("/rank/v1/rerank", {"query": "river", "documents": ["the river", "a city"]}),
    "search": ("/search/v1/search", {"query": "how does batching work", "top_k": 3}),
    "generate": (
        "/generate/v1/completions",
        {"model": "small", "prompt": "The river", "max_tokens": 2, "temperature": 0},
    ),
    "rag": (
        "/rag/v1/chat/completions",
        {"messages": [{"role": "user", "content": "What is carpool?"}], "max_tokens": 2},
    ),
}


@pytest.mark.parametrize("app", sorted(GOOD))
def test_every_pipeline_honours_priority_and_an_ample_deadline(default_apps: str, app: str) -> None:
    path, body = GOOD[app]
    # Ample even for a cold /rag on a busy 2-core machine: its first LLM rerank alone took
    # 92 s beside two busy processes, and the 120 s budget once ran out.
    r = httpx.post(
        f"{default_apps}{path}",
        json=body,
        headers={"x-carpool-priority": "batch", "x-carpool-deadline-ms": "400000"},
        timeout=450,
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("app", sorted(GOOD))
def test_every_pipeline_answers_504_fast_when_the_deadline_is_spent(
    default_apps: str, app: str
) -> None:
    path, body = GOOD[app]
    started = time.monotonic()
    r = httpx.post(
        f"{default_apps}{path}", json=body, headers={"x-carpool-deadline-ms": "0"}, timeout=60
    )
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - started < 5


def test_a_bad_priority_is_a_400_that_says_what_to_send(default_apps: str) -> None:
    path, body = GOOD["embed"]
    r = httpx.post(
        f"{default_apps}{path}", json=body, headers={"x-carpool-priority": "urgent"}, timeout=60
    )
    assert r.status_code == 400
    assert "interactive" in r.json()["error"]["message"]


def test_a_long_generation_stops_at_its_deadline(default_apps: str) -> None:
    started = time.monotonic()
    r = httpx.post(
        f"{default_apps}/generate/v1/completions",
        json={
            "model": "small",
            "prompt": "Tell me a long story",
            "max_tokens": 400,
            "ignore_eos": True,
        },
        headers={"x-carpool-deadline-ms": "1500"},
        timeout=120,
    )
    took = time.monotonic() - started
    assert r.status_code == 504, r.text
    assert took < 8, f"504 after {took:.1f} s for a 1.5 s deadline"
