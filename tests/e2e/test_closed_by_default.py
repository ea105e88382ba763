"""``make serve`` is closed to the network, and it starts whatever an earlier Ray left behind.

One ``make serve`` of the whole serve.yaml, started the README's way (tests/make_serve.py),
after a stopped benchmark's head left its dead address in Ray's ``ray_current_cluster``
(issue 52, point 2: ``serve run`` used to join that address and retry for minutes). Once
every application runs, it is probed like an attacker would (issue 52, point 1):

- every TCP socket its processes listen on is listed from /proc, by ancestry of the process
  started (never by name), and tried from each of the machine's non-loopback addresses: each
  must refuse the connection, or refuse a real Ray RPC without the token (UNAUTHENTICATED);
- on loopback too, Ray's control plane refuses a caller without the token: no job is
  accepted by the dashboard or its agent (a job is a shell command), no GCS, raylet, worker
  or replica RPC answers;
- HTTP serving on loopback still answers without a key, and the token, found where Ray
  looks, opens the dashboard API and ``serve status`` with no hand step.

With ``RAY_AUTH_MODE=disabled`` in the environment the loopback probes get answers and this
test fails, as it fails on the Makefile before token auth and loopback (Ray's GCS answered
from the node's address).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import psutil
import pytest

from carpool.local_ray import token_path
from tests import make_serve
from tests.make_serve import ListeningSocket, MakeServeRun

READY_S = 600  # every app of serve.yaml cold on a busy 2-core box, vLLM's compile included
pytestmark = [
    pytest.mark.own_ray,  # runs before the session's shared Ray starts (conftest)
    pytest.mark.timeout(READY_S + 300),  # the first test waits for the fixture's start
]
DASHBOARD = "http://127.0.0.1:8265"
# Real methods of each kind of Ray gRPC server: the GCS, a raylet, a core worker (every Ray
# process), a Serve replica. A server checks the token before it runs one; a method a
# server does not have answers UNIMPLEMENTED.
RAY_RPCS = (
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
    "/ray.rpc.JobInfoGcsService/GetAllJobInfo",
    "/ray.rpc.NodeManagerService/GetNodeStats",
    "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
    "/ray.serve.ASGIService/HandleRequest",
)
# The HTTP routes that take a job (a shell command): the dashboard's and its agent's.
JOB_ROUTES = ("/api/jobs/", "/api/job_agent/jobs/")


def _outside_addresses() -> list[str]:
    """The machine's own addresses that are not loopback (nor IPv6 link-local)."""
    found = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            with contextlib.suppress(ValueError):
                ip = ipaddress.ip_address(address.address.split("%")[0])
                if not (ip.is_loopback or ip.is_link_local):
                    found.append(str(ip))
    return sorted(set(found))


def _token() -> str:
    return token_path().read_text().strip()


def _applications(token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{DASHBOARD}/api/serve/applications/", headers=headers, timeout=10)


def _wait_until_running(served: MakeServeRun) -> dict[str, str]:
    deadline = time.monotonic() + READY_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        served.still_starting()
        log = served.log.read_text(errors="replace")
        if "Failed to connect to GCS" in log:
            pytest.fail(
                "make serve joined the dead head's address:\n" + make_serve.tail(served.log)
            )
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            reply = _applications(_token())
            last = f"{reply.status_code} {reply.text[:200]}"
            apps = reply.json().get("applications", {}) if reply.status_code == 200 else {}
            statuses = {name: app["status"] for name, app in apps.items()}
            if statuses and all(s == "RUNNING" for s in statuses.values()):
                return statuses
            if failed := {n: s for n, s in statuses.items() if s == "DEPLOY_FAILED"}:
                pytest.fail(f"make serve could not deploy {failed}:\n{make_serve.tail(served.log)}")
            last = str(statuses) or last
        time.sleep(3)
    pytest.fail(
        f"serve.yaml's apps not running within {READY_S} s ({last}):\n"
        + make_serve.tail(served.log)
    )


@pytest.fixture(scope="module")
def served() -> Iterator[MakeServeRun]:
    if (why := make_serve.can_run()) is not None:
        pytest.skip(why)
    with contextlib.suppress(httpx.HTTPError):
        httpx.get(DASHBOARD, timeout=2)
        pytest.skip(f"a Ray dashboard already listens on {DASHBOARD}: stop that Ray first")
    # A dead head's address in ray_current_cluster, as a stopped benchmark's head leaves it.
    run = make_serve.start(dead_head=True)
    try:
        run.statuses = _wait_until_running(run)
        yield run
    finally:
        run.terminate()
        time.sleep(5)
        run.cleanup()


def _rpc_status(target: str, method: str, token: str | None = None) -> str:
    """The gRPC status of ``method`` called at ``target`` with an empty request."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(method)  # raw bytes in and out
        try:
            call(b"", timeout=3, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name
        return "OK"


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


def _sockets(served: MakeServeRun) -> list[ListeningSocket]:
    sockets = make_serve.listening_sockets(served.run.scan())
    ports = {s.port for s in sockets}
    assert served.port in ports, f"the run's HTTP port {served.port} is not among {ports}"
    assert 8265 in ports, f"the run's dashboard (8265) is not among {ports}"
    return sockets


def test_make_serve_starts_past_a_dead_head_address(served: MakeServeRun) -> None:
    """Every app of serve.yaml runs although ``ray_current_cluster`` named a GCS nobody
    listens on (the fixture fails at once when ``serve run`` tries to join it)."""
    names = {app["name"] for app in make_serve.derived_config(served.port)["applications"]}
    assert set(served.statuses) == names


def _parallel(probes: list[Callable[[], str | None]]) -> list[str]:
    """Runs the probes at once (each may wait out its timeouts); the answers they found."""
    with ThreadPoolExecutor(max_workers=32) as pool:
        return [found for found in pool.map(lambda probe: probe(), probes) if found]


def _outside_probe(host: str, sock: ListeningSocket) -> Callable[[], str | None]:
    def probe() -> str | None:
        if not _connects(host, sock.port):
            return None
        statuses = {m: _rpc_status(_target(host, sock.port), m) for m in RAY_RPCS}
        refused = set(statuses.values()) <= {"UNAUTHENTICATED", "UNIMPLEMENTED"}
        if refused and "UNAUTHENTICATED" in statuses.values():
            return None
        return f"{host}:{sock.port} ({make_serve.describe(sock.pid)}): {statuses}"

    return probe


def test_nothing_answers_a_non_loopback_address_without_the_token(served: MakeServeRun) -> None:
    outside = _outside_addresses()
    if not outside:
        pytest.skip("this machine has no non-loopback address to probe from")
    probes = [_outside_probe(host, sock) for sock in _sockets(served) for host in outside]
    answered = _parallel(probes)
    assert not answered, "reachable from outside without the token:\n" + "\n".join(answered)


def _loopback_probes(port: int, job: dict) -> list[Callable[[], str | None]]:
    def post(route: str) -> str | None:
        with contextlib.suppress(httpx.HTTPError):
            reply = httpx.post(f"http://127.0.0.1:{port}{route}", json=job, timeout=5)
            if reply.is_success:
                return f"POST 127.0.0.1:{port}{route}: {reply.status_code}"
        return None

    def call(method: str) -> str | None:
        status = _rpc_status(f"127.0.0.1:{port}", method)
        return f"127.0.0.1:{port}{method}: {status}" if status == "OK" else None

    return [partial(post, r) for r in JOB_ROUTES] + [partial(call, m) for m in RAY_RPCS]


def test_rays_control_plane_refuses_a_caller_without_the_token_on_loopback(
    served: MakeServeRun, tmp_path: Path
) -> None:
    marker = tmp_path / "job-ran"
    job = {"entrypoint": f"touch {marker}", "submission_id": f"probe-{os.getpid()}"}
    ports = sorted({s.port for s in _sockets(served)})
    answered = _parallel([p for port in ports for p in _loopback_probes(port, job)])
    time.sleep(3)  # a job that was taken runs within a second or two
    assert not marker.exists(), f"a job posted without the token ran: {marker}"
    assert not answered, "answered on loopback without the token:\n" + "\n".join(answered)
    assert _applications(None).status_code in (401, 403)


def test_the_token_opens_the_dashboard_and_the_cli_with_no_hand_step(served: MakeServeRun) -> None:
    path = token_path()
    assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
    assert _applications(_token()).status_code == 200
    # The CLI as `make status` runs it: RAY_AUTH_MODE=token (the Makefile's) and nothing else.
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    env.pop("RAY_AUTH_TOKEN", None)
    status = subprocess.run(
        [str(make_serve.ROOT / ".venv" / "bin" / "serve"), "status"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert status.returncode == 0 and "RUNNING" in status.stdout, status.stderr[-2000:]


def test_http_serving_on_loopback_answers_without_a_key(served: MakeServeRun) -> None:
    reply = httpx.post(
        f"{served.base_url}/embed/v1/embeddings", json={"input": ["closed by default"]}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["data"][0]["embedding"]) == 384
