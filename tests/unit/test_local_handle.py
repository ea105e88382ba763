"""LocalHandle: a replica's own methods called the way its handlers call a DeploymentHandle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from carpool.calls import open_stream
from carpool.local_handle import LocalHandle


class Target:
    def __init__(self) -> None:
        self.closed = 0
        self.produced = 0
        self.gate = asyncio.Event()

    def describe(self) -> dict[str, Any]:
        return {"model": "t"}

    async def generate(self, n: int) -> int:
        await asyncio.sleep(0)
        return n * 2

    async def slow(self) -> None:
        await asyncio.Event().wait()

    async def stream(self, n: int) -> AsyncIterator[int]:
        try:
            for i in range(n):
                if i == 3:
                    await self.gate.wait()  # parked mid-stream, inside an await
                self.produced += 1
                yield i
        finally:
            self.closed += 1


def test_calls_answer_like_a_handle() -> None:
    async def main() -> None:
        handle = LocalHandle(Target())
        assert await handle.generate.remote(21) == 42
        assert await handle.describe.remote() == {"model": "t"}  # a sync method too
        with pytest.raises(AttributeError):
            handle._private  # noqa: B018

    asyncio.run(main())


def test_cancelling_a_call_cancels_the_method() -> None:
    async def main() -> None:
        call = LocalHandle(Target()).slow.remote()
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())


def test_a_stream_cancelled_between_events_closes_its_generator() -> None:
    async def main() -> None:
        target = Target()
        target.gate.set()
        events, first = await open_stream(LocalHandle(target), 100)
        assert first == 0 and await events.__anext__() == 1
        events.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert target.closed == 1
        assert target.produced == 2  # nothing generated after the caller left

    asyncio.run(main())


def test_a_consumer_cancelled_inside_an_await_closes_the_generator() -> None:
    async def main() -> None:
        target = Target()
        events, _ = await open_stream(LocalHandle(target), 100)

        async def consume() -> None:
            async for _ in events:
                pass

        task = asyncio.create_task(consume())
        while target.produced < 3:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # parked at the gate
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert target.closed == 1
        events.cancel()  # after the fact: nothing left to close, no error
        await asyncio.sleep(0)
        assert target.closed == 1

    asyncio.run(main())
