"""carpool's shipped ingress on a real Ray: HAProxy in front of each ingress replica's own port.

The session's Ray starts with ``carpool.haproxy.ray_environment()`` (tests/conftest.py), as
``make serve`` and ``cluster.yaml`` start theirs. Checked here on the live processes:
nothing the ingress opens listens beyond loopback, the admin socket is private, and a long
stream survives the HAProxy reload that adding an ingress replica causes.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from carpool.local_ray import listening_sockets, socket_inodes
from tests.conftest import deploy_declaratively

pytestmark = pytest.mark.skipif(
    os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "0",
    reason="RAY_SERVE_ENABLE_HA_PROXY=0: the session runs Serve's Python proxy",
)


def haproxy_pids() -> list[int]:
    """Live HAProxy processes started from this session's Ray (its config under our node)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"/haproxy") and b"-f" in argv:
            pids.append(int(entry.name))
    return pids


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc/net/tcp{,6}."""
    sockets = listening_sockets()
    return [sockets[inode] for inode in socket_inodes(pid) if inode in sockets]


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1")


def stream_app_config(replicas: int) -> dict:
    return {
        "name": "hap-stream",
        "route_prefix": "/hap-stream",
        "import_path": "tests.integration.haproxy_apps:build_app",
        "deployments": [{"name": "Streamer", "num_replicas": replicas}],
    }


@pytest.fixture(scope="module")
def stream_app(serve_http: str) -> str:
    deploy_declaratively([stream_app_config(1)])
    deadline = time.monotonic() + 60
    while True:  # HAProxy learns the route after the app is RUNNING
        try:
            if httpx.get(f"{serve_http}/hap-stream/hi", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the ingress never answered through HAProxy"
        time.sleep(0.5)
    yield f"{serve_http}/hap-stream"
    serve.delete("hap-stream")


def test_everything_the_ingress_opens_is_on_loopback(stream_app: str) -> None:
    pids = haproxy_pids()
    assert pids, "no HAProxy process: the session's Ray did not start the HAProxy ingress"
    sockets = [s for pid in pids for s in listening(pid)]
    ports = {port for _, port in sockets}
    assert int(os.environ["RAY_SERVE_HAPROXY_STATS_PORT"]) in ports
    assert int(os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"]) in ports
    assert [s for s in sockets if not is_loopback(s[0])] == []
    # The stats page answers on loopback (it is there for operators on the box).
    stats = httpx.get(f"http://127.0.0.1:{os.environ['RAY_SERVE_HAPROXY_STATS_PORT']}/stats")
    assert stats.status_code == 200


def test_admin_socket_is_private(stream_app: str) -> None:
    sockets = [p for p in Path("/tmp/haproxy-serve").glob("*/admin.sock")]
    assert sockets
    # Ours is the newest (a `make serve` beside the tests may own an older one).
    newest = max(sockets, key=lambda p: p.stat().st_mtime)
    assert newest.stat().st_mode & 0o077 == 0, oct(newest.stat().st_mode)


def test_clients_that_leave_cancel_their_work(stream_app: str) -> None:
    """HAProxy must pass a client's close on to the replica, whose Serve then cancels the
    handler (with Ray's `option splice-request` most closes never arrived)."""

    async def leave_early() -> None:
        async with httpx.AsyncClient(timeout=0.8) as client:

            async def one() -> None:
                with pytest.raises(httpx.TimeoutException):
                    await client.post(f"{stream_app}/slow", json={"n": 1})

            await asyncio.gather(*(one() for _ in range(5)))

    before = httpx.get(f"{stream_app}/slow-stats", timeout=30).json()
    asyncio.run(leave_early())
    time.sleep(6)  # past the 5 s each would have run
    after = httpx.get(f"{stream_app}/slow-stats", timeout=30).json()
    assert after["cancelled"] - before["cancelled"] == 5, (before, after)
    assert after["finished"] == before["finished"], (before, after)


def test_long_stream_survives_an_ingress_replica_being_added(stream_app: str) -> None:
    before = set(haproxy_pids())
    lines: list[str] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            with httpx.stream("GET", f"{stream_app}/stream?n=1000&delay_ms=50", timeout=120) as r:
                assert r.status_code == 200
                lines.extend(r.iter_lines())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while not lines and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lines, "the stream never started"
    # A second ingress replica: a new HAProxy server line, so Ray reloads HAProxy.
    # A declarative update, as `serve deploy` with a new num_replicas: the first replica (the
    # stream's) stays. From a thread: it returns once the app is RUNNING again.
    scaler = threading.Thread(target=deploy_declaratively, args=([stream_app_config(2)],))
    scaler.start()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        states = serve.status().applications["hap-stream"].deployments["Streamer"].replica_states
        if states.get("RUNNING", 0) == 2 and set(haproxy_pids()) - before:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no second replica or no HAProxy reload within 90 s: {states}")
    assert len(lines) < 1000, "the stream ended before the reload: it tested nothing"
    reader.join(timeout=120)
    scaler.join(timeout=120)
    assert not errors, errors
    assert lines == [str(i) for i in range(1000)]
