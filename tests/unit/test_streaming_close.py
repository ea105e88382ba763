"""A client leaving mid-stream closes the ingress's event iterator at once, not at GC time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from carpool.http import ClosingStreamingResponse

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "headers": []}


def _leave_after(chunks: int, error: BaseException) -> Any:
    """An ASGI send that fails the way a departed client does, on the given body chunk."""
    seen = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal seen
        if message["type"] == "http.response.body":
            seen += 1
            if seen >= chunks:
                raise error

    return send


async def _receive() -> dict[str, Any]:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


def _run(response_class: type[StreamingResponse], error: BaseException) -> list[str]:
    log: list[str] = []

    async def events() -> AsyncIterator[str]:
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            log.append("backend cancelled")

    async def main() -> None:
        response = response_class(events(), media_type="text/event-stream")
        with pytest.raises((ClientDisconnect, asyncio.CancelledError)):
            await response(SCOPE, _receive, _leave_after(3, error))
        # The response (and so the iterator) is still referenced: nothing but the response
        # itself can have closed it.
        log.append(f"response alive: {response is not None}")

    asyncio.run(main())
    return log


@pytest.mark.parametrize("error", [OSError("reset by peer"), asyncio.CancelledError()])
def test_leaving_inside_send_runs_the_iterators_cleanup_at_once(error: BaseException) -> None:
    assert _run(ClosingStreamingResponse, error) == ["backend cancelled", "response alive: True"]


def test_starlettes_own_response_leaves_it_to_the_garbage_collector() -> None:
    """Why the subclass exists: with the plain class the cleanup has not run at that point."""
    log = _run(StreamingResponse, OSError("reset by peer"))
    assert log[0] == "response alive: True"
