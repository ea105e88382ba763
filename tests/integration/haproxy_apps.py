"""A streaming ingress without a model, for tests/integration/test_haproxy_ingress.py.

Its own module so a declarative deploy (``import_path``) finds it, as ``serve deploy`` would:
only a declarative update changes ``num_replicas`` in place, where ``serve.run`` restarts the
replicas (and, 20 s later, kills the one a stream is on).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray import serve

stream_api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0.05}, max_ongoing_requests=64)
@serve.ingress(stream_api)
class Streamer:
    """1,000 lines, one every few ms: a token stream without a model."""

    @stream_api.get("/stream")
    async def stream(self, n: int = 1000, delay_ms: float = 10.0) -> StreamingResponse:
        async def lines():
            for i in range(n):
                yield f"{i}\n"
                await asyncio.sleep(delay_ms / 1000)

        return StreamingResponse(lines(), media_type="text/plain")

    @stream_api.get("/hi")
    def hi(self) -> dict[str, bool]:
        return {"ok": True}

    @stream_api.post("/slow")
    async def slow(self, body: dict) -> dict[str, bool]:
        """5 s of 'work' that counts whether it was cancelled (its client left)."""
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            self.cancelled = getattr(self, "cancelled", 0) + 1
            raise
        self.finished = getattr(self, "finished", 0) + 1
        return {"ok": True}

    @stream_api.get("/slow-stats")
    def slow_stats(self) -> dict[str, int]:
        return {
            "cancelled": getattr(self, "cancelled", 0),
            "finished": getattr(self, "finished", 0),
        }


def build_app(args: dict[str, Any]) -> Any:
    return Streamer.bind()
