"""A user's stop of ``make serve`` leaves nothing running (issue 43, point 10).

What the README and docs/development.md tell a user to do: ``make serve``, wait for the
apps, then SIGTERM to its process group. Before the fix, vLLM's ``VLLM::EngineCore`` and an
HAProxy lived on with parent 1 after that. Here the Makefile's own ``serve`` target runs (its
recipe: ``carpool.haproxy env`` into Ray's environment, then ``serve run serve.yaml``) in a
process group of its own; once ``/generate`` has answered through vLLM's engine the group
gets SIGTERM, and within ``STOP_S`` no process of this run may remain: no engine core, no
HAProxy (nor its guard), no raylet or GCS, no reaper.

With ``start_reaper`` / ``start_guard`` made to return None (checked once by hand, 2026-11-28)
this test still passes: on this stop path Serve's graceful shutdown closes the engine and
HAProxy by itself, so the test guards the user's stop as a whole, not the watchdogs. They
are for the replica that dies without its cleanup (SIGKILL, the OOM killer, a lost node),
which tests/vllm/test_vllm_orphans.py proves.

Differences from a user's run, each so that the test never touches what it did not start:

- The recipe runs in a temporary folder (``make -C <tmp> -f Makefile``) that holds a
  ``serve.yaml`` derived from the repository's: the HTTP port is a free one (``make serve``
  has no variable for it, so a developer's ``make serve`` on :8000 keeps its port) and only
  the ``generate`` application is kept (the one whose small generator runs vLLM; the other
  apps add minutes of start-up on 2 cores and no process kind: HAProxy and Ray's are the
  same). The ``generate`` section itself is serve.yaml's, unchanged.
- ``-o models``: the install and model preparation are taken as done (``make test`` did
  them; a missing model skips, as the rest of this tier does).
- ``RAY_TMPDIR`` is the run's own folder, so ``serve run``'s ``ray.init()`` can never join
  another Ray on this machine (a test session's, a benchmark's), and HAProxy's stats,
  exporter and fallback ports are free ones.
- Every process of the run is found by a marker in its environment (``MARKER``, set only
  for this ``make``; every process Ray, vLLM and HAProxy start inherits it, the watchdogs
  that leave the process group included), never by name: other Ray instances may be running
  here, and only this run's processes are read or, in clean-up, killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm")

ROOT = Path(__file__).resolve().parents[2]
MARKER = "CARPOOL_STOP_TEST_RUN"
APPS = ("generate",)  # serve.yaml's applications this run keeps (see the module docstring)
READY_S = 600  # cold start of the generate app on a busy 2-core box, vLLM's load included
STOP_S = 60  # the bound the issue asks for; Ray's own processes end in about 5 s
# What must be among the run's processes while it serves, so that "nothing left" cannot pass
# because they were never found: (label, /proc/<pid>/comm, which the kernel cuts at 15 chars).
EXPECTED = (
    ("vLLM engine core", "VLLM::EngineCor"),
    ("HAProxy", "haproxy"),
    ("raylet", "raylet"),
    ("GCS", "gcs_server"),
)


def _free_port() -> int:
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


def _comm(pid: int) -> str:
    return _read(f"/proc/{pid}/comm").decode(errors="replace").strip()


def _describe(pid: int) -> str:
    cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
    comm = _comm(pid)
    stat = _stat(pid)
    return f"{pid} (parent {stat[0] if stat else '?'}, {comm}): {cmdline.strip()[:160]}"


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
        return {pid: _describe(pid) for pid in sorted(ours)}

    def _marked(self, pid: int) -> bool:
        if self.needle in _read(f"/proc/{pid}/environ").split(b"\0"):
            return True
        return self.ray_tmp in _read(f"/proc/{pid}/cmdline")


def derived_config(port: int) -> dict:
    """serve.yaml with a free HTTP port and only ``APPS`` (their sections unchanged)."""
    config = yaml.safe_load((ROOT / "serve.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"] = [a for a in config["applications"] if a["name"] in APPS]
    assert {a["name"] for a in config["applications"]} == set(APPS), "serve.yaml lost an app"
    small = next(a for a in config["applications"] if a["name"] == "generate")["args"]["small"]
    assert small["mode"] == "vllm", "serve.yaml's small generator no longer runs vLLM"
    return config


def _tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _wait_until_generating(
    base: str, make: subprocess.Popen[bytes], log: Path, run: RunProcesses
) -> None:
    body = {"model": "small", "prompt": "The capital of France is", "max_tokens": 4}
    deadline = time.monotonic() + READY_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        run.scan()  # record the tree while make is its root
        if make.poll() is not None:
            pytest.fail(f"make serve exited ({make.returncode}) before serving:\n{_tail(log)}")
        try:
            reply = httpx.post(f"{base}/generate/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            last = repr(e)
        else:
            if reply.status_code == 200:
                answer = reply.json()
                assert answer["model"] == "small" and answer["usage"]["completion_tokens"] > 0
                return
            last = f"{reply.status_code} {reply.text[:200]}"
        time.sleep(2)
    pytest.fail(f"/generate did not answer within {READY_S} s ({last}):\n{_tail(log)}")


@pytest.mark.timeout(READY_S + STOP_S + 120)
def test_sigterm_to_make_serve_leaves_no_process_behind(smollm2: str) -> None:
    serve_bin = ROOT / ".venv" / "bin" / "serve"
    if not serve_bin.exists() or shutil.which("make") is None:
        pytest.skip(f"{serve_bin} or make is missing: run `make install` first")
    work = Path(tempfile.mkdtemp(prefix="carpool-stop-"))
    # Short: Ray's unix sockets live under it (107-byte path limit).
    ray_tmp = Path(tempfile.mkdtemp(prefix="cps-", dir="/tmp"))
    port = _free_port()
    (work / "serve.yaml").write_text(yaml.safe_dump(derived_config(port), sort_keys=False))
    run_id = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MAKEFLAGS")}
    env.update(
        {
            MARKER: run_id,
            "RAY_TMPDIR": str(ray_tmp),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(_free_port()),
        }
    )
    command = ["make", "-C", str(work), "-f", str(ROOT / "Makefile"), "-o", "models", "serve"]
    command.append(f"VENV={ROOT / '.venv'}")
    log = work / "make-serve.log"
    with log.open("wb") as out:
        # Its own process group, as a user's shell gives `make serve`.
        make = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    run = RunProcesses(make.pid, run_id, ray_tmp)
    try:
        _wait_until_generating(f"http://127.0.0.1:{port}", make, log, run)
        serving = run.scan()
        comms = {_comm(pid) for pid in serving}
        listing = "\n".join(serving.values())
        for label, comm in EXPECTED:
            assert comm in comms, f"no {label} ({comm}) found in the run:\n{listing}"

        os.killpg(make.pid, signal.SIGTERM)  # the README's way to stop
        deadline = time.monotonic() + STOP_S
        left = serving
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            make.poll()  # reap make itself (our child) once it exits
            left = run.scan()
        assert not left, (
            f"{len(left)} processes of the stopped `make serve` still run {STOP_S} s after "
            "SIGTERM to its group:\n" + "\n".join(left.values())
        )
    finally:
        # Only this run's processes, and only those still there.
        for pid in run.scan():
            if pid != make.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if make.poll() is None:
            make.kill()
        make.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
