"""A cancellation that arrives just as the awaited thing completes is not lost.

CPython 3.11's ``asyncio.wait_for`` returns the inner result in that race (gh-86296), so a
client that left could keep a router slot or a downstream call. The serving path waits with
``asyncio.timeout`` instead; each test here fails under ``wait_for``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from carpool.admission import _CONTROLS, RequestControls
from carpool.calls import await_within_deadline
from carpool.errors import RequestError
from router.gate import Gate
from router.lanes import ShortestFirstQueue


def test_router_gate_cancelled_as_its_slot_is_granted_gives_the_slot_back() -> None:
    async def main() -> None:
        gate = Gate(1, ShortestFirstQueue())
        await gate.enter(10, "interactive")  # holds the only slot
        waiter = asyncio.create_task(
            gate.enter(10, "interactive", deadline=time.time() + 30, lane="short")
        )
        await asyncio.sleep(0.01)  # waiting in the lane now
        gate.leave(10)  # grants the slot to the waiter...
        waiter.cancel()  # ...and its client leaves in the same instant
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.in_flight == 0 and gate.queued_tokens == 0
        assert gate.lane_waiting == {"short": 0}

    asyncio.run(main())


def test_router_gate_still_gives_up_at_the_deadline_with_504() -> None:
    async def main() -> None:
        gate = Gate(1, ShortestFirstQueue())
        await gate.enter(10, "interactive")
        with pytest.raises(RequestError) as info:
            await gate.enter(10, "interactive", deadline=time.time() + 0.05)
        assert info.value.status_code == 504 and gate.in_flight == 1

    asyncio.run(main())


class _Call:
    """A downstream call (a DeploymentResponse): awaitable and cancellable."""

    def __init__(self, future: asyncio.Future[str]) -> None:
        self.future = future
        self.cancelled = False

    def __await__(self) -> Any:
        return self.future.__await__()

    def cancel(self) -> None:
        self.cancelled = True


def test_ingress_call_cancelled_as_it_completes_raises_and_cancels_downstream() -> None:
    async def main() -> None:
        call = _Call(asyncio.get_running_loop().create_future())
        _CONTROLS.set(RequestControls(deadline=time.time() + 30))
        task = asyncio.create_task(await_within_deadline("model", call))
        await asyncio.sleep(0.01)
        call.future.set_result("answer")  # the replica answers...
        task.cancel()  # ...just as the client leaves
        with pytest.raises(asyncio.CancelledError):
            await task
        assert call.cancelled

    asyncio.run(main())


def test_ingress_call_past_its_deadline_is_504_and_cancelled() -> None:
    async def main() -> None:
        call = _Call(asyncio.get_running_loop().create_future())
        _CONTROLS.set(RequestControls(deadline=time.time() + 0.05))
        with pytest.raises(RequestError) as info:
            await await_within_deadline("model", call)
        assert info.value.status_code == 504 and call.cancelled

    asyncio.run(main())


def _openai_ingress(monkeypatch: pytest.MonkeyPatch, settings: Any) -> Any:
    from pipelines import openai_api

    class _Remote:
        def remote(self) -> Any:
            return settings

    class _Handle:
        settings = _Remote()

    monkeypatch.setattr(openai_api.serve, "get_deployment_handle", lambda *a, **k: _Handle())
    monkeypatch.setattr(openai_api, "SETTINGS_TIMEOUT_S", 0.05)
    original = openai_api.OpenAIIngress.__mro__[1]
    return object.__new__(original)


def test_openai_ingress_settings_timeout_is_still_503(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        never: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        ingress = _openai_ingress(monkeypatch, _Call(never))  # type: ignore[arg-type]
        with pytest.raises(RequestError) as info:
            await ingress._attach("embed", "gone")
        assert info.value.status_code == 503
        assert "did not report its settings" in info.value.message

    asyncio.run(main())


def test_openai_ingress_settings_cancelled_as_they_arrive_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        arriving: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        ingress = _openai_ingress(monkeypatch, _Call(arriving))  # type: ignore[arg-type]
        task = asyncio.create_task(ingress._attach("embed", "embed"))
        await asyncio.sleep(0.01)
        arriving.set_result({})
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
