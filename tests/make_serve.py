"""A ``make serve`` the tests start the README's way, and the processes it owns.

The Makefile's own ``serve`` target runs (``make -C <tmp> -f Makefile -o models serve``) in a
process group of its own, as a user's shell gives it, over a ``serve.yaml`` derived from the
repository's. Differences from a user's run, each so that a test never touches what it did
not start:

- the recipe runs in a temporary folder that holds the derived ``serve.yaml``: the HTTP port
  is a free one (``make serve`` has no variable for it, so a developer's ``make serve`` on
  :8000 keeps its port) and a test may keep only some applications (their sections unchanged);
- ``-o models``: the install and model preparation are taken as done (``make test`` did them);
- ``RAY_TMPDIR`` is the run's own folder, and HAProxy's stats, exporter and fallback ports
  are free ones;
- every process of the run is found by ancestry, session, a marker in its environment or the
  run's ``RAY_TMPDIR`` on its command line (``RunProcesses``), never by name: other Ray
  instances may be running here, and only this run's processes are read or, in clean-up,
  killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from carpool import local_ray

ROOT = Path(__file__).resolve().parents[1]
MARKER = "CARPOOL_MAKE_SERVE_TEST_RUN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:  # gone meanwhile, or another user's
        return b""


def _stat(pid: int) -> tuple[int, int, int, str] | None:
    """(parent, session, start time, state) from /proc/<pid>/stat; None once it is gone."""
    raw = _read(f"/proc/{pid}/stat").decode(errors="replace")
    if ")" not in raw:
        return None
    fields = raw.rsplit(")", 1)[1].split()  # the name (field 2) may hold spaces
    return int(fields[1]), int(fields[3]), int(fields[19]), fields[0]


def comm(pid: int) -> str:
    return _read(f"/proc/{pid}/comm").decode(errors="replace").strip()


def describe(pid: int) -> str:
    cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
    stat = _stat(pid)
    return f"{pid} (parent {stat[0] if stat else '?'}, {comm(pid)}): {cmdline.strip()[:160]}"


class RunProcesses:
    """The processes one ``make serve`` started, found without touching anything else.

    A process counts as this run's when any of these holds:

    - it descends (by parent pid) from ``make``, seen while the run serves: Ray's processes
      are re-parented to init once ``make`` and ``serve run`` are gone, so the tree is
      recorded as it grows (pid and start time, so a reused pid is never taken);
    - it is in the session ``make`` leads (started with ``start_new_session``);
    - its environment holds the run's marker (watchdogs start their own session). Not enough
      alone: a process that sets its title (``ray::DashboardAgent``, ``VLLM::EngineCore``)
      may overwrite the start of its environment block, marker included;
    - its command line names the run's own ``RAY_TMPDIR`` (Ray's agents, raylet, GCS).

    Zombies are not running: they do not count.
    """

    def __init__(self, leader: int, run_id: str, ray_tmp: Path) -> None:
        self.leader = leader
        self.needle = f"{MARKER}={run_id}".encode()
        self.ray_tmp = str(ray_tmp).encode()
        stat = _stat(leader)
        self.known: dict[int, int] = {leader: stat[2]} if stat else {}  # pid: start time

    def scan(self) -> dict[int, str]:
        """This run's live processes now, {pid: description}; remembers them."""
        table = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                stat = _stat(int(entry.name))
                if stat is not None:
                    table[int(entry.name)] = stat
        live = {pid: stat for pid, stat in table.items() if stat[3] != "Z"}
        ours = {pid for pid in self.known if pid in live and live[pid][2] == self.known[pid]}
        for pid, (_, session, _, _) in live.items():
            if session == self.leader or self._marked(pid):
                ours.add(pid)
        grew = True
        while grew:  # and everything below any of them
            below = {pid for pid, stat in live.items() if stat[0] in ours} - ours
            grew = bool(below)
            ours |= below
        ours &= set(live)
        for pid in ours:
            self.known[pid] = live[pid][2]
        return {pid: describe(pid) for pid in sorted(ours)}

    def _marked(self, pid: int) -> bool:
        if self.needle in _read(f"/proc/{pid}/environ").split(b"\0"):
            return True
        return self.ray_tmp in _read(f"/proc/{pid}/cmdline")


@dataclass(frozen=True)
class ListeningSocket:
    host: str  # as the kernel holds it: "0.0.0.0", "::", "127.0.0.1", "::ffff:127.0.0.1"...
    port: int
    pid: int

    @property
    def loopback_only(self) -> bool:
        return self.host in ("127.0.0.1", "::1", "::ffff:127.0.0.1") or self.host.startswith("127.")


def listening_sockets(pids: Iterable[int]) -> list[ListeningSocket]:
    """Every TCP socket in LISTEN state that one of ``pids`` holds, read from /proc."""
    listening = local_ray.listening_sockets()
    found = {
        ListeningSocket(*listening[inode], pid)
        for pid in pids
        for inode in local_ray.socket_inodes(pid)
        if inode in listening
    }
    return sorted(found, key=lambda s: (s.port, s.host, s.pid))


def derived_config(port: int, apps: Iterable[str] | None = None) -> dict:
    """serve.yaml with a free HTTP port and only ``apps`` (all when None; sections unchanged)."""
    config = yaml.safe_load((ROOT / "serve.yaml").read_text())
    config["http_options"]["port"] = port
    if apps is not None:
        keep = set(apps)
        config["applications"] = [a for a in config["applications"] if a["name"] in keep]
        assert {a["name"] for a in config["applications"]} == keep, "serve.yaml lost an app"
    return config


def tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class MakeServeRun:
    """One ``make serve`` started by ``start``; ``stop`` ends every process it owns."""

    make: subprocess.Popen[bytes]
    run: RunProcesses
    port: int
    work: Path
    ray_tmp: Path
    env: dict[str, str] = field(repr=False)
    statuses: dict[str, str] = field(default_factory=dict)  # the apps', once a test saw them

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.work / "make-serve.log"

    def still_starting(self) -> None:
        """Records the process tree while ``make`` is its root; fails the test when ``make``
        has exited (it serves until stopped)."""
        self.run.scan()
        if self.make.poll() is not None:
            pytest.fail(
                f"make serve exited ({self.make.returncode}) before serving:\n{tail(self.log)}"
            )

    def terminate(self) -> None:
        """SIGTERM to the run's process group: the README's way to stop."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.make.pid, signal.SIGTERM)

    def cleanup(self) -> None:
        """Kills what is left of this run (only its processes), then removes its folders."""
        for pid in self.run.scan():
            if pid != self.make.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.make.poll() is None:
            self.make.kill()
        self.make.wait(timeout=30)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)


def start(
    apps: Iterable[str] | None = None, env: dict[str, str] | None = None, dead_head: bool = False
) -> MakeServeRun:
    """Starts ``make serve`` over the derived config, in the caller's environment plus
    ``env``. ``dead_head``: first leave in the run's ``ray_current_cluster`` the address of a
    GCS nobody listens on, as a stopped ``ray start --head`` does. The caller must
    ``cleanup()``."""
    work = Path(tempfile.mkdtemp(prefix="carpool-serve-"))
    # Short: Ray's unix sockets live under it (107-byte path limit).
    ray_tmp = Path(tempfile.mkdtemp(prefix="cps-", dir="/tmp"))
    if dead_head:
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    port = free_port()
    (work / "serve.yaml").write_text(yaml.safe_dump(derived_config(port, apps), sort_keys=False))
    run_id = uuid.uuid4().hex
    run_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MAKEFLAGS")}
    run_env.update(
        {
            MARKER: run_id,
            "RAY_TMPDIR": str(ray_tmp),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            **(env or {}),
        }
    )
    command = ["make", "-C", str(work), "-f", str(ROOT / "Makefile"), "-o", "models", "serve"]
    command.append(f"VENV={ROOT / '.venv'}")
    with (work / "make-serve.log").open("wb") as out:
        # Its own process group, as a user's shell gives `make serve`.
        make = subprocess.Popen(
            command, env=run_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return MakeServeRun(make, RunProcesses(make.pid, run_id, ray_tmp), port, work, ray_tmp, run_env)


def can_run() -> str | None:
    """Why a ``make serve`` cannot start here (None: it can)."""
    serve_bin = ROOT / ".venv" / "bin" / "serve"
    if not serve_bin.exists() or shutil.which("make") is None:
        return f"{serve_bin} or make is missing: run `make install` first"
    return None
