"""How many replicas each deployment runs now, and Serve's per-replica request limit.

Callers that size their own limits by the replicas behind a handle (the router's in-flight
caps, an ingress's refusal memory) read these numbers here. They come from Serve's
controller, polled in a worker thread at most every ``interval_s`` and only while someone
asks: asking never blocks the event loop, and an answer a few seconds old is fine for both
uses (Serve itself starts and stops replicas on a scale of seconds).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeploymentView:
    running: int
    max_ongoing_requests: int | None


Fetch = Callable[[], dict[str, DeploymentView]]


def parse_serve_details(details: dict[str, Any]) -> dict[str, DeploymentView]:
    """``{"app/deployment": DeploymentView}`` from Serve's instance details."""
    views = {}
    for app_name, app in (details.get("applications") or {}).items():
        for name, deployment in (app.get("deployments") or {}).items():
            replicas = deployment.get("replicas") or []
            running = sum(1 for r in replicas if str(r.get("state", "")).endswith("RUNNING"))
            config = deployment.get("deployment_config") or {}
            views[f"{app_name}/{name}"] = DeploymentView(
                running, config.get("max_ongoing_requests")
            )
    return views


def fetch_from_serve() -> dict[str, DeploymentView]:
    """Serve's controller's view of every deployment (a blocking call: run it in a thread)."""
    import ray
    from ray.serve.context import _get_global_client

    if not ray.is_initialized():  # Serve's client would start a Ray of its own here
        raise RuntimeError("not connected to a Ray cluster")

    client = _get_global_client()
    return parse_serve_details(client.get_serve_details())


class LiveReplicas:
    """Cached replica counts; a stale cache is refreshed in the background on access."""

    def __init__(
        self, fetch: Fetch = fetch_from_serve, interval_s: float = 3.0, clock: Any = time.monotonic
    ) -> None:
        self._fetch = fetch
        self.interval_s = interval_s
        self._clock = clock
        self._views: dict[str, DeploymentView] = {}
        self._fetched_at = -float("inf")
        self._refreshing = False
        self._lock = threading.Lock()
        self._warned = False

    def view(self, deployment: str) -> DeploymentView | None:
        self._maybe_refresh()
        return self._views.get(deployment)

    def count(self, deployment: str) -> int | None:
        """Running replicas of ``deployment`` ("app/name"); None while unknown."""
        view = self.view(deployment)
        return view.running if view is not None else None

    def refresh_now(self) -> None:
        """Blocking refresh (start-up, tests)."""
        self._refresh()

    async def recount(self, max_age_s: float = 1.0) -> bool:
        """Refreshes the counts now, unless they are younger than ``max_age_s``; True when
        they were refreshed. For a caller about to give up on a stage because every replica
        it knows of refused: a replica added since the last poll (a scale-out moments ago)
        is one more place to try. Bounded to one fetch per ``max_age_s``, so sustained
        refusals cost the controller no more than that.
        """
        if self._clock() - self._fetched_at < max_age_s:
            return False
        with self._lock:
            busy = self._refreshing
            if not busy:
                self._refreshing = True
        if busy:  # the background poll is fetching: wait (up to 2 s) for what it finds
            before = self._fetched_at
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not self._refreshing:
                    break
            return self._fetched_at != before
        await asyncio.get_running_loop().run_in_executor(None, self._refresh)
        return True

    def _maybe_refresh(self) -> None:
        if self._clock() - self._fetched_at < self.interval_s:
            return
        with self._lock:
            if self._refreshing:
                return
            self._refreshing = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            self._refresh()
        else:
            loop.run_in_executor(None, self._refresh)

    def _refresh(self) -> None:
        try:
            views = self._fetch()
        except Exception as exc:  # outside Serve, or the controller is restarting
            if not self._warned:
                logger.info("replica counts unavailable (%s); assuming one replica each", exc)
                self._warned = True
            views = None
        with self._lock:
            if views is not None:
                self._views = views
            self._fetched_at = self._clock()
            self._refreshing = False


_shared: LiveReplicas | None = None


def live_replicas() -> LiveReplicas:
    """This process's poller (one per ingress or router replica)."""
    global _shared
    if _shared is None:
        _shared = LiveReplicas()
    return _shared


def replica_context() -> Any:
    """Serve's context of the replica this code runs in; None outside one."""
    try:
        from ray.serve.context import _get_internal_replica_context
    except ImportError:
        return None
    return _get_internal_replica_context()


def current_replica() -> tuple[str, str] | None:
    """(``app/deployment``, replica id) of the Serve replica this code runs in, else None."""
    context = replica_context()
    if context is None:
        return None
    replica_id = context.replica_id
    deployment = replica_id.deployment_id
    return f"{deployment.app_name}/{deployment.name}", replica_id.unique_id
