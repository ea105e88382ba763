"""Over-limit request bodies get their 413 on a real socket, not a connection reset (issue 15).

A server that answers before reading the body and then closes leaves unread bytes in its
socket; the kernel answers them with a reset, and a client still sending (Python's urllib,
``requests`` on some paths) reports ``Connection reset by peer`` with no status at all.
``BodySizeLimit`` reads and discards the rest of the body, up to a bound, before answering
(nginx's lingering close), so the client reads the 413.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import Request  # module level: the route's string annotation resolves here

from carpool.http import BodySizeLimit, drain_bound, make_api

LIMIT = 1 << 20  # 1 MiB: well above what socket buffers absorb unread on loopback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    import uvicorn

    api = make_api("body limit test", "echo", LIMIT)

    @api.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _post(url: str, data: Any, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=data, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_body_under_the_limit_is_served(base_url: str) -> None:
    status, body = _post(f"{base_url}/echo", b"x" * 1000)
    assert status == 200 and body == {"bytes": 1000}


@pytest.mark.parametrize("extra", [1, 64 * 1024, LIMIT])
def test_a_declared_body_over_the_limit_gets_413_not_a_reset(base_url: str, extra: int) -> None:
    for _ in range(3):  # a reset is a race; one clean answer could be luck
        status, body = _post(f"{base_url}/echo", b"x" * (LIMIT + extra))
        assert status == 413
        assert body["error"]["code"] == "body_too_large"
        assert str(LIMIT) in body["error"]["message"]


def test_a_chunked_body_over_the_limit_gets_413_not_a_reset(base_url: str) -> None:
    piece = b"x" * 65536

    def chunks() -> Iterator[bytes]:  # no Content-Length: urllib sends it chunked
        for _ in range(LIMIT // len(piece) + 8):
            yield piece

    status, body = _post(f"{base_url}/echo", chunks())
    assert status == 413 and body["error"]["code"] == "body_too_large"


def test_the_connection_still_serves_after_a_413(base_url: str) -> None:
    # The drained request leaves the server healthy for the next one.
    assert _post(f"{base_url}/echo", b"x" * (LIMIT + 10))[0] == 413
    assert _post(f"{base_url}/echo", b"{}")[0] == 200


def test_the_drain_stops_at_its_bound() -> None:
    """A client that never stops sending is read only up to the bound, then answered."""
    sent: list[dict[str, Any]] = []
    reads = 0

    async def endless() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if reads > 10_000:
            raise AssertionError("the drain did not stop at its bound")
        return {"type": "http.request", "body": b"x" * 4096, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        raise AssertionError("an over-limit body must not reach the app")

    limit = 8192
    middleware = BodySizeLimit(app, limit)
    scope = {"type": "http", "headers": [(b"content-length", str(10**9).encode())]}
    asyncio.run(middleware(scope, endless, send))
    assert sent[0]["status"] == 413
    assert reads * 4096 <= drain_bound(limit) + 4096
    assert reads * 4096 > limit  # it did read past the limit, not stop at once


def test_drain_bound_is_four_times_the_limit_capped_at_64_mib() -> None:
    assert drain_bound(1000) == 4000
    assert drain_bound(16 << 20) == 64 << 20
    assert drain_bound(1 << 30) == 64 << 20
