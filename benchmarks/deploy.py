"""Starting Ray and Serve for a benchmark, and deploying the systems under test side by side.

Every system gets the same model source and the same replica resources (``Resources``):
the same ``num_cpus`` reservation and the same torch thread count. Ray's *logical* CPU count
is raised to fit all replicas at once (three model replicas at 0.8 CPU each would not fit in
2); that is bookkeeping only, because the systems are measured one after another and an idle
replica uses no CPU, while the torch thread count is what bounds each replica's compute.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from carpool import local_ray

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = REPO_ROOT / "serve.yaml"
DEFAULT_PORT = 8100  # not 8000: a developer's `make serve` may hold that one
DEFAULT_MODEL = "packaged:all-MiniLM-L6-v2"
METRICS_INTERVAL_MS = 2000


def shipped_ingress_env() -> dict[str, str]:
    """Puts carpool's shipped ingress (Ray's HAProxy, ``carpool.haproxy``) in the environment
    the benchmark's Ray starts with, unless the caller already chose one
    (``RAY_SERVE_ENABLE_HA_PROXY`` set, e.g. ``=0`` for Serve's Python proxy). HAProxy's side
    ports are free ones, so a ``make serve`` on the same machine keeps 8404, 9101 and 8500."""
    if "RAY_SERVE_ENABLE_HA_PROXY" in os.environ:
        return {}
    from carpool.haproxy import ray_environment

    env = ray_environment(
        stats_port=free_port(), metrics_port=free_port(), fallback_port=free_port()
    )
    os.environ.update(env)
    return env


def serve_yaml_app(module: str, deployment: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """serve.yaml's app from ``pipelines.<module>``: its ``args`` and ``deployment``'s
    ``user_config``.

    The batching knobs may sit in either place (``args.<model>.batching`` is the app's
    default; a ``deployments: [{name: ..., user_config: ...}]`` entry overrides it, as
    ``serve deploy`` would), so both are read.
    """
    if not SERVE_CONFIG.is_file():
        return {}, {}
    with open(SERVE_CONFIG) as fh:
        config = yaml.safe_load(fh) or {}
    for app in config.get("applications", []):
        if app.get("import_path", "").startswith(f"pipelines.{module}:"):
            user_config: dict[str, Any] = {}
            for dep in app.get("deployments") or []:
                if dep.get("name") == deployment:
                    user_config = dict(dep.get("user_config") or {})
            return dict(app.get("args") or {}), user_config
    return {}, {}


def serve_yaml_embed() -> tuple[dict[str, Any], dict[str, Any]]:
    """serve.yaml's embed app: its ``args`` and the embedder's ``user_config``."""
    return serve_yaml_app("embed", "embedder")


def carpool_rank_args(resources: Resources) -> dict[str, Any]:
    """``pipelines.rank`` args: serve.yaml's rank entry (its ranker model and replica as they
    ship: the ranker is a different model, so the embedder's resources do not apply), with
    the ranker's ``user_config`` folded into ``ranker.batching``."""
    args, user_config = serve_yaml_app("rank", "ranker")
    ranker = dict(args.get("ranker") or {})
    ranker["batching"] = {**(ranker.get("batching") or {}), **user_config}
    # Equal threads with the naive ranker it is compared with (see carpool_embed_args).
    replica = {**(ranker.get("replica") or {}), "thread_policy": "reserved"}
    replica.pop("max_torch_threads", None)
    ranker["replica"] = replica
    args["ranker"] = ranker
    ingress = dict(args.get("ingress") or {})
    ingress["num_cpus"] = resources.ingress_num_cpus
    args["ingress"] = ingress
    return args


def _serve_yaml_num_cpus(fallback: float = 0.8) -> float:
    args, _ = serve_yaml_embed()
    value = (args.get("embedder") or {}).get("replica", {}).get("num_cpus")
    return float(value) if value else fallback


class Resources(BaseModel):
    """What every model replica gets, whichever system it belongs to."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(
        default_factory=_serve_yaml_num_cpus,
        gt=0,
        le=64,
        description="CPU reservation per model replica (default: serve.yaml's embedder's).",
    )
    torch_threads: int = Field(default=1, ge=1, le=64, description="torch intra-op threads.")
    ingress_num_cpus: float = Field(default=0.1, gt=0, le=8, description="carpool's ingress.")
    model: str = Field(default=DEFAULT_MODEL, description="Model source for every system.")


@dataclass(frozen=True)
class SystemSpec:
    """A system under test: its Serve app, route prefix and request kind."""

    name: str
    prefix: str
    kind: str
    description: str
    build: Callable[[Resources, dict[str, Any]], Any]  # (resources, overrides) -> Application


def carpool_embed_args(resources: Resources, batching: dict[str, Any] | None = None) -> dict:
    """``pipelines.embed`` args: serve.yaml's embed entry, with the common resources applied.

    Reading serve.yaml means the benchmark measures what ships; ``batching`` overrides the
    knobs for tuning experiments (its ``ingress`` key, if any, the ingress's settings; its
    ``replica`` key the embedder replica's, applied after the equal-threads pins below).
    """
    batching = dict(batching or {})
    ingress_knobs = batching.pop("ingress", {})
    replica_knobs = batching.pop("replica", {})
    args, user_config = serve_yaml_embed()
    embedder = dict(args.get("embedder") or {})
    source = dict(embedder.get("source") or {})
    source["model"] = resources.model
    embedder["source"] = source
    replica = dict(embedder.get("replica") or {})
    # The suite compares batching strategies at equal threads: the baselines cannot take
    # idle cores, so carpool's thread_policy is pinned to the same fixed count here (the
    # peers comparison, benchmarks/peers/, runs serve.yaml's idle_cores as shipped).
    replica.update(
        num_cpus=resources.num_cpus, torch_threads=resources.torch_threads, thread_policy="reserved"
    )
    replica.pop("max_torch_threads", None)
    embedder["replica"] = {**replica, **replica_knobs}
    embedder["batching"] = {
        **(embedder.get("batching") or {}),
        **user_config,
        **(batching or {}),
    }
    args["embedder"] = embedder
    ingress = dict(args.get("ingress") or {})
    ingress["num_cpus"] = resources.ingress_num_cpus
    args["ingress"] = {**ingress, **ingress_knobs}
    return args


def baseline_args(resources: Resources, overrides: dict[str, Any] | None = None) -> dict:
    return {
        "embedder": {
            "source": {"model": resources.model},
            "replica": {"num_cpus": resources.num_cpus, "torch_threads": resources.torch_threads},
        },
        **(overrides or {}),
    }


def _build_carpool(resources: Resources, overrides: dict[str, Any]) -> Any:
    from pipelines.embed import build_embed_app

    return build_embed_app(carpool_embed_args(resources, overrides))


def _build_carpool_rank(resources: Resources, overrides: dict[str, Any]) -> Any:
    from pipelines.rank import build_rank_app

    return build_rank_app(carpool_rank_args(resources))


def _build_naive_rank(resources: Resources, overrides: dict[str, Any]) -> Any:
    from benchmarks.baselines import build_naive_rank_app

    ranker = {k: v for k, v in carpool_rank_args(resources)["ranker"].items() if k != "batching"}
    return build_naive_rank_app({"ranker": ranker, **overrides})


def _build_carpool_wide(resources: Resources, overrides: dict[str, Any]) -> Any:
    from benchmarks.experimental import build_wide_embed_app

    return build_wide_embed_app(carpool_embed_args(resources, overrides))


def _build_naive(resources: Resources, overrides: dict[str, Any]) -> Any:
    from benchmarks.baselines import build_naive_app

    return build_naive_app(baseline_args(resources, overrides))


def _build_servebatch(resources: Resources, overrides: dict[str, Any]) -> Any:
    from benchmarks.baselines import build_servebatch_app

    return build_servebatch_app(baseline_args(resources, overrides))


SYSTEMS: dict[str, SystemSpec] = {
    "carpool": SystemSpec(
        "carpool",
        "/embed",
        "embed",
        "pipelines.embed: ingress + embedder with length-aware batching (serve.yaml knobs)",
        _build_carpool,
    ),
    "carpool-wide": SystemSpec(
        "carpool-wide",
        "/embed-wide",
        "embed",
        "carpool with room for 1024 ongoing requests per embedder (its former experiment, "
        "64 collected batches in flight, is now carpool's default; benchmarks/experimental.py)",
        _build_carpool_wide,
    ),
    "naive": SystemSpec(
        "naive",
        "/bench-naive",
        "embed",
        "one forward pass per request, no batching",
        _build_naive,
    ),
    "carpool-rank": SystemSpec(
        "carpool-rank",
        "/rank",
        "rank",
        "pipelines.rank: serve.yaml's rank app (SmolLM2 pointwise ranker, its knobs)",
        _build_carpool_rank,
    ),
    "naive-rank": SystemSpec(
        "naive-rank",
        "/bench-naive-rank",
        "rank",
        "one scoring pass per request through the same ranker model wrapper",
        _build_naive_rank,
    ),
    "serve-batch": SystemSpec(
        "serve-batch",
        "/bench-servebatch",
        "embed",
        "plain @serve.batch(max_batch_size=32 texts), one pass per batch padded to its longest",
        _build_servebatch,
    ),
}


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeCluster:
    """A private Ray + Serve for one benchmark process, torn down at the end."""

    def __init__(
        self, port: int = DEFAULT_PORT, logical_cpus: float | None = None, own_session: bool = False
    ) -> None:
        self.port = port
        self.logical_cpus = logical_cpus
        # Ray in a session of its own (start_head_in_own_session), apart from the load generator.
        self.own_session = own_session
        self.session_id: int | None = None
        self.metrics_port = free_port()
        self.started = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if not port_is_free(self.port):
            raise RuntimeError(
                f"port {self.port} on 127.0.0.1 is in use; pass --port with a free one, or "
                "--url to benchmark the server already there"
            )
        os.environ.update(local_ray.ray_environment())
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray starts its workers (every replica and the proxy) at nice 15, below the load
        # generator and any stray process on the machine: a benchmark would then measure who else
        # ran. Servers under test compete as equals; Ray's job drivers do the same.
        os.environ.setdefault("RAY_worker_niceness", "0")
        shipped_ingress_env()
        import ray
        from ray import serve

        cpus = self.logical_cpus or float(os.cpu_count() or 2)
        # Replicas push metrics every 10 s by default; 2 s lets the batch-size histogram be
        # read a few seconds after a run instead of ten.
        system_config = {"metrics_report_interval_ms": METRICS_INTERVAL_MS}
        object_store = 256 * 1024 * 1024  # requests are small; keep /dev/shm free
        if self.own_session:
            self.session_id, address = start_head_in_own_session(
                [
                    f"--num-cpus={math.ceil(cpus)}",
                    f"--object-store-memory={object_store}",
                    f"--metrics-export-port={self.metrics_port}",
                    f"--system-config={json.dumps(system_config)}",
                ]
            )
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(
                address="local",  # always a fresh cluster, never another agent's
                num_cpus=math.ceil(cpus),
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=object_store,
                _metrics_export_port=self.metrics_port,
                _system_config=system_config,
            )
        self.started = True
        _exit_on_sigterm_after_ray()
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": "127.0.0.1", "port": self.port},
        )

    def deploy(self, systems: list[SystemSpec], resources: Resources, overrides: dict) -> None:
        """Deploys all systems at once (model loads overlap) and waits until they run."""
        from ray import serve

        serve.run_many(
            [
                serve.RunTarget(
                    s.build(resources, overrides.get(s.name, {})),
                    name=f"bench-{s.name}",
                    route_prefix=s.prefix,
                )
                for s in systems
            ]
        )

    def shutdown(self) -> None:
        if not self.started:
            return
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self.started = False
            stop_session(self.session_id)
            self.session_id = None


def start_head_in_own_session(args: list[str]) -> tuple[int, str]:
    """Starts a fresh Ray head (``ray start --head`` + ``args``) in a session of its own;
    returns the session's id and the head's address. ``stop_session`` ends it.

    Linux groups a session's processes for CPU fairness (autogroup): a peer server started
    in its own session competes with the load generator as one group, while a Ray started by
    ``ray.init`` in the benchmark's process shares the load generator's session and each of
    its processes competes with the load generator thread by thread. A head in its own
    session puts the servers under test where a user's ``serve run`` is: apart from clients.
    """
    gcs_port = free_port()
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={gcs_port}"]
    cmd += ["--include-dashboard=false", "--disable-usage-stats", *args]
    with _current_cluster_file_kept():
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        sid = proc.pid  # setsid: a session's id is its first process's pid
        _LIVE_SESSIONS.add(sid)  # a killed benchmark must not leave a Ray behind (atexit below)
        out, _ = proc.communicate(timeout=300)
    if proc.returncode != 0:
        stop_session(sid)
        raise RuntimeError(f"`ray start --head` failed:\n{out.decode(errors='replace')[-3000:]}")
    return sid, f"127.0.0.1:{gcs_port}"


@contextlib.contextmanager
def _current_cluster_file_kept() -> Iterator[None]:
    """Puts Ray's ``ray_current_cluster`` back as it was: ``ray start --head`` writes its
    address there, and every ``ray``/``serve`` command without an address (a user's ``serve
    run``, ``serve status``) would then join the benchmark's head, or, once it is stopped,
    retry its dead GCS for minutes. The benchmark connects by the address it is given."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    before = path.read_bytes() if path.exists() else None
    try:
        yield
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(before)


# Sessions started and not yet stopped; only these are ended at exit (a stopped session's id
# is a pid the OS may hand to an unrelated process later).
_LIVE_SESSIONS: set[int] = set()


def _stop_live_sessions() -> None:
    for sid in list(_LIVE_SESSIONS):
        stop_session(sid)


atexit.register(_stop_live_sessions)


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (this process excluded)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            with contextlib.suppress(OSError):
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
    return pids


def session_processes(sid: int) -> list[Any]:
    """``psutil.Process`` of every live process of session ``sid`` (this one excluded)."""
    import psutil

    procs = []
    for pid in session_pids(sid):
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    return procs


def stop_session(sid: int | None) -> None:
    """Ends every process of session ``sid`` (Ray's daemons, workers, replicas, engines)."""
    if sid is None:
        return
    _LIVE_SESSIONS.discard(sid)
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = session_pids(sid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = session_pids(sid)
        if not pids:
            return


def _exit_on_sigterm_after_ray() -> None:
    """Makes SIGTERM raise SystemExit so ``shutdown()`` runs in the caller's ``finally``.

    ``ray.init`` installs a SIGTERM handler that only logs and dies, which leaves the
    cluster's agent processes behind; ours replaces it (main thread only, as Python requires).
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def logical_cpus_needed(systems: list[SystemSpec], resources: Resources) -> float:
    """Logical CPUs to reserve so every replica schedules (see the module docstring)."""
    rank = carpool_rank_args(resources).get("ranker", {}).get("replica", {}).get("num_cpus", 0.5)
    need = sum(float(rank) if s.kind == "rank" else resources.num_cpus for s in systems)
    need += resources.ingress_num_cpus * sum(1 for s in systems if s.name.startswith("carpool"))
    return max(float(os.cpu_count() or 2), need + 0.1)
