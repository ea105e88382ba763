"""Test tiers by folder, one shared Ray instance per session, and tiny-model factories.

- tests/unit: no Ray at all.
- tests/integration: ``serve.run`` with tiny random models built here.
- tests/e2e: HTTP against the default serve config with the packaged models.

Ray and Serve start once, lazily, the first time a test asks for ``serve_http``; every
integration and e2e test shares them. Serve listens on a free port so a developer's own
``make serve`` on :8000 does not collide.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

# Every Ray the tests start is closed as `make serve`'s is: token auth (the token created
# once, owner-only, where Ray looks), its ports on 127.0.0.1 (carpool/local_ray.py). Set
# here, before anything imports Ray: a driver reads its auth mode once, at import.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Ray's usage stats reporter phones home; nothing here may reach the network.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Serve kills a proxy that is not ready within 5 s (and one whose health check takes over
# 10 s); beside two busy processes on 2 cores the proxy took longer, and every e2e app
# failed to start. Generous, as a loaded CI machine needs.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
# Ray starts its workers at nice 15, so every replica of the cluster under test yields to any
# ordinary process: beside two busy loops the embedder ran 20x slower than alone (6.7 ms per
# token against 0.33), its queue really was 30 s deep, and a 64-request burst was refused.
# Tests compete for the CPU as equals (Ray's own job drivers do the same).
os.environ.setdefault("RAY_worker_niceness", "0")
# HAProxy is the tests' ingress (ray_session sets the rest of its environment), decided here
# too: Serve reads the switch once, at import, and a driver that builds an app with carpool's
# placement router (pipelines.placement) must agree with the cluster it deploys to.
os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
# A direct-ingress replica being stopped stays open 30 s (Ray's default), so that a load
# balancer in front of a cluster can deregister it; here HAProxy is that balancer, on the same
# box, reloaded within a second or two, and it retries a refused connection. At 30 s every
# app a test deletes held the suite for half a minute (93 s for one module's three apps).
# Test-only: the shipped configs keep Ray's default.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5")

TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).relative_to(TESTS).parts[0]
        if tier in ("unit", "integration", "e2e", "cluster"):
            item.add_marker(getattr(pytest.mark, tier))
    # Tests that start a Ray of their own the README's way (`make serve`) run first, before
    # the session's shared Ray starts: two whole serve.yaml stacks at once would not fit 2
    # cores. sort() is stable: the order within each group stays.
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    from carpool.haproxy import ray_environment
    from pipelines.direct_routes import routes_of_file

    # The tests' Ray runs carpool's shipped ingress (Ray's HAProxy, carpool/haproxy.py) unless
    # RAY_SERVE_ENABLE_HA_PROXY=0 asks for Serve's Python proxy; its stats page and exporter
    # and Serve's fallback proxy on free ports, so a `make serve` beside the tests keeps 8404,
    # 9101 and 8500.
    os.environ.update(
        ray_environment(
            enabled=os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "0",
            stats_port=_free_port(),
            metrics_port=_free_port(),
            fallback_port=_free_port(),
            # As `make serve` runs it: they act only where serve.yaml's apps are (tests/e2e)
            direct_routes=routes_of_file(Path(__file__).resolve().parents[1] / "serve.yaml"),
        )
    )
    from carpool.local_ray import ray_environment

    os.environ.update(ray_environment())
    # Logical CPUs above the 2 real cores: tiny test replicas need scheduling room, not cores.
    # address="local": always a fresh cluster of our own, never one a `ray start` left running.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_http(ray_session: None) -> str:
    """Base URL of the session's Serve HTTP proxy."""
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny randomly initialised models saved as local folders (replicas load them by path)."""
    from tests.factories import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny-models"))


def deploy_declaratively(applications: list[dict], timeout_s: float = 600) -> None:
    """Deploys apps the way `serve deploy`/`serve run config.yaml` do, and waits for RUNNING.

    The declarative path is the one that applies a changed ``user_config`` in place (the
    imperative ``serve.run(app)`` always restarts replicas).
    """
    import time

    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    client = serve.context._get_global_client()
    # Apps deployed imperatively (serve.run) would be torn down by a config deploy, which
    # replaces the whole declarative set; so tests keep all declarative apps in one call site.
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": applications}))
    names = {a["name"] for a in applications}
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications
        states = {n: status[n].status for n in names if n in status}
        if len(states) == len(names) and all(s == "RUNNING" for s in states.values()):
            return
        failed = {n: status[n].message for n, s in states.items() if s == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"deploy failed: {failed}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"apps not running after {timeout_s}s: {states}")
        time.sleep(0.5)
