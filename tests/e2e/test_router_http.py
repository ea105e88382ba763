"""`model: "auto"` through the router with the packaged models: decisions are visible."""

from __future__ import annotations

import httpx


def test_auto_says_what_it_decided(default_apps: str) -> None:
    response = httpx.post(
        f"{default_apps}/generate/v1/chat/completions",
        json={
            "model": "auto",
            "messages": [{"role": "user", "content": "Answer yes or no: is water wet?"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=300,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    record = body["carpool"]
    assert record["model"] in ("small", "large")
    assert body["model"] == record["model"]
    assert record["lane"] in ("short", "long")
    assert record["actual_tokens"] == body["usage"]["completion_tokens"]
    assert response.headers["x-carpool-model"] == record["model"]
    assert response.headers["x-carpool-lane"] == record["lane"]
    assert "x-carpool-predicted-tokens" in response.headers
    assert response.headers["x-carpool-escalated"] in ("True", "False")


def test_auto_streams(default_apps: str) -> None:
    with httpx.stream(
        "POST",
        f"{default_apps}/generate/v1/completions",
        json={
            "model": "auto",
            "prompt": "The capital of France is",
            "max_tokens": 4,
            "stream": True,
            "temperature": 0,
        },
        timeout=300,
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-carpool-model"] in ("small", "large")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
