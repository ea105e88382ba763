"""The serve.yaml deployment under test: start it (or attach to one), find, kill and watch replicas.

By default the tool starts a private Ray (no dashboard, 127.0.0.1) and deploys serve.yaml's
applications to it exactly as ``serve run serve.yaml`` does (``ServeDeploySchema`` through
the controller), on a free port so a developer's ``make serve`` on 8000 is left alone.
Knobs come from serve.yaml; ``--set app.deployment.knob=value`` overrides a deployment's
``user_config`` (applied in place by a redeploy, like ``serve deploy``).
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.deploy import (
    REPO_ROOT,
    _exit_on_sigterm_after_ray,
    free_port,
    session_processes,
    shipped_ingress_env,
    start_head_in_own_session,
    stop_session,
)
from carpool import local_ray

SERVE_CONFIG = REPO_ROOT / "serve.yaml"
NAMESPACE = "serve"
OBJECT_STORE_BYTES = 256 * 1024 * 1024


def load_config(path: str | Path = SERVE_CONFIG) -> dict[str, Any]:
    with open(path) as fh:
        return yaml.safe_load(fh) or {}


def parse_set(items: Iterable[str]) -> dict[tuple[str, str], dict[str, Any]]:
    """``["embed.embedder.max_queued_items=64"]`` -> ``{("embed", "embedder"): {...: 64}}``."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        parts = key.split(".")
        if not sep or len(parts) != 3 or not all(parts):
            raise ValueError(f"--set {item!r}: expected app.deployment.knob=value")
        app, dep, knob = parts
        out.setdefault((app, dep), {})[knob] = yaml.safe_load(raw)
    return out


def apply_overrides(
    config: dict[str, Any], overrides: dict[tuple[str, str], dict[str, Any]]
) -> dict[str, Any]:
    """A copy of ``config`` with the deployments' ``user_config`` knobs overridden."""
    config = copy.deepcopy(config)
    apps = {a["name"]: a for a in config.get("applications", [])}
    for (app, dep), knobs in overrides.items():
        if app not in apps:
            raise ValueError(f"no application {app!r} in the serve config; have {sorted(apps)}")
        deployments = apps[app].setdefault("deployments", [])
        entry = next((d for d in deployments if d.get("name") == dep), None)
        if entry is None:
            entry = {"name": dep}
            deployments.append(entry)
        entry.setdefault("user_config", {}).update(knobs)
    return config


def user_config(config: dict[str, Any], app: str, deployment: str) -> dict[str, Any]:
    for a in config.get("applications", []):
        if a.get("name") == app:
            for d in a.get("deployments") or []:
                if d.get("name") == deployment:
                    return dict(d.get("user_config") or {})
    return {}


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def app_closure(config: dict[str, Any], wanted: Iterable[str]) -> list[str]:
    """``wanted`` plus every app they reach by name in their ``args`` (search -> embed, rank)."""
    apps = {a["name"]: a for a in config.get("applications", [])}
    todo = list(wanted)
    unknown = [a for a in todo if a not in apps]
    if unknown:
        raise ValueError(f"no application(s) {unknown} in the serve config; have {sorted(apps)}")
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(s for s in _strings(apps[name].get("args") or {}) if s in apps)
    return [a for a in apps if a in seen]  # serve.yaml's order


def subset(config: dict[str, Any], apps: Iterable[str]) -> dict[str, Any]:
    keep = set(apps)
    config = copy.deepcopy(config)
    config["applications"] = [a for a in config["applications"] if a["name"] in keep]
    return config


@dataclass
class Replica:
    """One Serve replica actor: ``SERVE_REPLICA::<app>#<deployment>#<id>``."""

    name: str
    app: str
    deployment: str

    @property
    def key(self) -> str:
        return f"{self.app}/{self.deployment}"


def parse_replica_name(name: str) -> Replica | None:
    if not name.startswith("SERVE_REPLICA::"):
        return None
    parts = name.removeprefix("SERVE_REPLICA::").split("#")
    if len(parts) < 3:
        return None
    return Replica(name, parts[0], parts[1])


def direct_routes_env(config: dict[str, Any]) -> dict[str, str]:
    """HAProxy's direct routes for ``config``'s apps, as ``make serve`` derives them for
    serve.yaml (``pipelines.direct_routes``); none behind Serve's Python proxy or when the
    caller set them."""
    from carpool.haproxy import DIRECT_ROUTES_VAR, ENABLE_VAR, dump_routes
    from pipelines.direct_routes import direct_routes

    if os.environ.get(ENABLE_VAR) != "1" or DIRECT_ROUTES_VAR in os.environ:
        return {}
    routes = direct_routes(config.get("applications") or [])
    return {DIRECT_ROUTES_VAR: dump_routes(routes)} if routes else {}


class Cluster:
    """A Serve deployment of serve.yaml, started here (default) or attached to (``--url``)."""

    def __init__(
        self,
        config: dict[str, Any],
        url: str | None = None,
        ray_address: str | None = None,
        port: int | None = None,
        own_session: bool = False,
    ) -> None:
        self.config = config
        self.own_session = own_session
        self.session_id: int | None = None  # the head's session, with own_session
        self.external = url is not None
        self.port = port or free_port()
        self.url = url.rstrip("/") if url else f"http://127.0.0.1:{self.port}"
        self.ray_address = ray_address
        self.started = False
        self.connected = False
        self.client: Any = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> float:
        """Starts Ray + Serve and deploys the config; returns seconds until all apps RUN."""
        os.environ.update(local_ray.ray_environment())
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray starts its workers (every replica and the proxy) at nice 15, below the load
        # generator and any stray process on the machine: a benchmark would then measure who else
        # ran. Servers under test compete as equals; Ray's job drivers do the same.
        os.environ.setdefault("RAY_worker_niceness", "0")
        if not self.external:
            shipped_ingress_env()  # serve.yaml as `make serve` runs it: behind HAProxy
        routes = direct_routes_env(self.config) if not self.external else {}
        os.environ.update(routes)  # read by HAProxy's wrapper, started with Serve below
        try:
            return self._start(timeout_s)
        finally:
            for key in routes:
                os.environ.pop(key, None)  # the next cluster in this process derives its own

    def _start(self, timeout_s: float) -> float:
        import ray

        t0 = time.monotonic()
        if self.external:
            if self.ray_address:
                ray.init(address=self.ray_address, namespace=NAMESPACE, log_to_driver=False)
                self.connected = True
            return 0.0
        if self.own_session:
            cpus = math.ceil(os.cpu_count() or 2)
            self.session_id, address = start_head_in_own_session(
                [f"--num-cpus={cpus}", f"--object-store-memory={OBJECT_STORE_BYTES}"]
            )
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        else:
            ray.init(
                address="local",  # always a fresh cluster, never someone else's
                num_cpus=math.ceil(os.cpu_count() or 2),
                include_dashboard=False,
                log_to_driver=False,
                namespace=NAMESPACE,
                object_store_memory=OBJECT_STORE_BYTES,
            )
        self.started = self.connected = True
        _exit_on_sigterm_after_ray()
        from ray.serve._private import api as serve_api
        from ray.serve.config import ProxyLocation

        self.client = serve_api.serve_start(
            http_options={"host": "127.0.0.1", "port": self.port},
            proxy_location=ProxyLocation.HeadOnly,
        )
        self.deploy(self.config, timeout_s)
        return time.monotonic() - t0

    def deploy(self, config: dict[str, Any], timeout_s: float = 600.0) -> None:
        """(Re)deploys ``config``; only user_config changed -> replicas reconfigure in place."""
        from ray.serve.schema import ServeDeploySchema

        body = {k: v for k, v in config.items() if k in ("applications",)}
        schema = ServeDeploySchema.model_validate(
            {
                **body,
                "proxy_location": "HeadOnly",
                "http_options": {"host": "127.0.0.1", "port": self.port},
            }
        )
        if self.client is None:
            from ray.serve.context import _get_global_client

            self.client = _get_global_client()
        self.client.deploy_apps(schema, _blocking=False)
        self.config = config
        self.wait_running([a["name"] for a in config["applications"]], timeout_s)

    def wait_running(self, apps: list[str], timeout_s: float = 600.0) -> None:
        from ray import serve

        deadline = time.monotonic() + timeout_s
        last: dict[str, str] = {}
        time.sleep(1.0)  # let the controller take the new config before reading status
        while time.monotonic() < deadline:
            status = serve.status().applications
            last = {a: str(status[a].status) if a in status else "MISSING" for a in apps}
            if all(s.endswith("RUNNING") for s in last.values()):
                return
            bad = {a: s for a, s in last.items() if "DEPLOY_FAILED" in s}
            if bad:
                msgs = {a: status[a].message[:500] for a in bad}
                raise RuntimeError(f"deploy failed: {msgs}")
            time.sleep(1.0)
        raise TimeoutError(f"apps not RUNNING after {timeout_s:g} s: {last}")

    def shutdown(self) -> None:
        import ray

        if self.started:
            from ray import serve

            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                self.started = self.connected = False
                stop_session(self.session_id)
                self.session_id = None
        elif self.connected:
            ray.shutdown()
            self.connected = False

    # --- replicas -------------------------------------------------------------------------

    def replicas(self) -> list[Replica]:
        import ray

        names = ray.util.list_named_actors(all_namespaces=True)
        out = []
        for n in names:
            if n.get("namespace") == NAMESPACE:
                r = parse_replica_name(n["name"])
                if r is not None:
                    out.append(r)
        return out

    def replicas_of(self, app: str, deployment: str) -> list[Replica]:
        return [r for r in self.replicas() if r.app == app and r.deployment == deployment]

    def running_count(self, app: str, deployment: str) -> int:
        from ray import serve

        status = serve.status().applications.get(app)
        if status is None or deployment not in status.deployments:
            return 0
        states = status.deployments[deployment].replica_states
        return int(sum(v for k, v in states.items() if str(k).endswith("RUNNING")))

    def kill(self, replica: Replica) -> None:
        import ray

        ray.kill(ray.get_actor(replica.name, namespace=NAMESPACE), no_restart=True)

    def replacement_running(self, victim: Replica, target: int) -> bool:
        """True once the victim is gone and ``target`` replicas of its deployment RUN."""
        names = {r.name for r in self.replicas_of(victim.app, victim.deployment)}
        if victim.name in names or len(names) < target:
            return False
        return self.running_count(victim.app, victim.deployment) >= target

    # --- processes ------------------------------------------------------------------------

    def processes(self) -> dict[str, int]:
        """``{"embed/embedder": pid, ..., "proxy": pid, "controller": pid}`` from proc titles.

        Ray titles its worker processes ``ray::ServeReplica:<app>:<deployment>``,
        ``ray::ProxyActor`` and ``ray::ServeController``. A cluster started here is searched
        among this process's descendants, or its head's session (never another agent's Ray);
        an attached one among all processes. Several replicas of one deployment get ``#2``,
        ``#3`` suffixes.
        """
        if self.started and self.session_id is not None:
            procs = session_processes(self.session_id)
        elif self.started:
            procs = psutil.Process(os.getpid()).children(recursive=True)
        else:
            procs = list(psutil.process_iter())
        out: dict[str, int] = {}
        for p in sorted(procs, key=lambda p: p.pid):
            try:
                title = " ".join(p.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            key = process_key(title)
            if key is None:
                continue
            name, i = key, 2
            while name in out:
                name, i = f"{key}#{i}", i + 1
            out[name] = p.pid
        return out


def process_key(title: str) -> str | None:
    """The name a Serve process's title maps to (see ``Cluster.processes``), else None."""
    if title.startswith("ray::ServeReplica:"):
        rest = title.removeprefix("ray::ServeReplica:").split()[0]
        app, _, dep = rest.partition(":")
        # While a replica runs a method Ray appends it: ``...:embedder.handle_request``.
        dep = dep.split(".", 1)[0]
        return f"{app}/{dep}" if dep else app
    if title.startswith("ray::ProxyActor"):
        return "proxy"
    if title.startswith("ray::ServeController"):
        return "controller"
    head = title.split(" ", 1)[0]
    if head.endswith("/raylet/raylet"):
        return "raylet"
    if head.endswith("/gcs/gcs_server"):
        return "gcs"
    return None


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    """Resident memory (MB) of each named pid; NaN for one that is gone."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            out[name] = math.nan
    return out
