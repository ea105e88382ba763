"""A replica's own methods behind the calls a handler makes on a ``DeploymentHandle``.

With direct streaming the small generator's replica is its app's HTTP ingress. The handler
that answers HTTP (``GenerateHandler``) reaches every model through handles; for the
replica's own model those calls stay in the process: no Ray hop, no serialisation, no copy
per streamed message. Only what the handlers use is here: ``handle.method.remote(...)``
(an awaitable that ``cancel()`` stops) and ``handle.options(stream=True)`` (an async
iterator that ``cancel()`` closes, so the generator's ``finally`` aborts its sequences).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

logger = logging.getLogger(__name__)


class LocalStream:
    """A streaming call's events, iterated in the caller's own task (no relay task).

    A caller cancelled while it awaits the next event cancels the generator with it (the
    cancellation is raised inside the generator's await); ``cancel()`` covers a caller that
    stops between events, as ``DeploymentResponseGenerator.cancel()`` does for Serve.
    """

    def __init__(self, events: AsyncIterator[Any]) -> None:
        self._events = events
        self._closing: asyncio.Task[None] | None = None

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._events.__anext__()

    def cancel(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())

    async def _close(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is None:
            return
        try:
            await aclose()
        except RuntimeError:
            # Still running in another task: that task's cancellation closes it instead.
            logger.debug("a local stream was closed while running", exc_info=True)


class _LocalMethod:
    def __init__(self, target: Any, name: str, stream: bool) -> None:
        self._method = getattr(target, name)
        self._stream = stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._stream:
            return LocalStream(self._method(*args, **kwargs))
        result = self._method(*args, **kwargs)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(result)
        return done


class LocalHandle:
    """Calls ``target``'s methods the way a handle to its deployment would, in-process."""

    def __init__(self, target: Any, stream: bool = False) -> None:
        self._target = target
        self._stream = stream

    def options(self, *, stream: bool = False, **_: Any) -> LocalHandle:
        return LocalHandle(self._target, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _LocalMethod(self._target, name, self._stream)
