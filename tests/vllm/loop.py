"""One event loop for the whole vLLM tier.

vLLM's ``AsyncLLM`` binds its output handler to the first loop that generates (in a Serve
replica, the replica's loop, for its whole life); ``asyncio.run`` per call would give each
test a new loop and strand the engine on a closed one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

LOOP = asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return LOOP.run_until_complete(coro)
