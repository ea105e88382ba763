"""vLLM's engine core in a session of its own (``vllm.engine_session: own``), without vLLM.

A stand-in ``vllm.v1.engine.core`` module gives the wrapper an entry point to call; the
processes are real: a "replica" process starts the engine core as vLLM does (a
``multiprocessing`` child whose target is ``EngineCoreProc.run_engine_core``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="sessions and /proc: Linux")


def _install_fake_vllm(report: str) -> None:
    class EngineCoreProc:
        @staticmethod
        def run_engine_core(*_: object, **__: object) -> None:
            Path(report).write_text(f"{os.getpid()} {os.getsid(0)} {os.getpgid(0)}")
            while True:  # an engine's busy loop, until something kills it
                time.sleep(0.1)

    for name in ("vllm", "vllm.v1", "vllm.v1.engine"):
        sys.modules.setdefault(name, types.ModuleType(name))
    core = types.ModuleType("vllm.v1.engine.core")
    core.EngineCoreProc = EngineCoreProc  # type: ignore[attr-defined]
    sys.modules["vllm.v1.engine.core"] = core


def _replica(report: str, own_session: bool) -> None:
    """What a replica does: wrap (or not) vLLM's entry point, start the engine core, serve."""
    _install_fake_vllm(report)
    from vllm.v1.engine.core import EngineCoreProc  # the stand-in

    from carpool.generation.engine_session import start_engine_cores_in_own_session

    if own_session:
        start_engine_cores_in_own_session()
        start_engine_cores_in_own_session()  # idempotent: wrapped once
    engine = multiprocessing.get_context("fork").Process(target=EngineCoreProc.run_engine_core)
    engine.start()
    while True:
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"  # a zombie has ended: only its exit status is left


def _start(tmp_path: Path, own_session: bool) -> tuple[multiprocessing.Process, list[int]]:
    report = tmp_path / "engine.txt"
    replica = multiprocessing.get_context("fork").Process(
        target=_replica, args=(str(report), own_session)
    )
    replica.start()
    deadline = time.monotonic() + 30
    while not report.exists() or not report.read_text():
        assert time.monotonic() < deadline, "the engine core never started"
        time.sleep(0.05)
    return replica, [int(x) for x in report.read_text().split()]


@pytest.mark.parametrize("own_session", [True, False])
def test_the_engine_core_runs_in_its_own_session_only_when_asked(
    tmp_path: Path, own_session: bool
) -> None:
    replica, (pid, sid, pgid) = _start(tmp_path, own_session)
    try:
        if own_session:
            assert sid == pid and pgid == pid, "the engine core leads a session of its own"
        else:
            assert sid == os.getsid(replica.pid) and pgid == os.getpgid(replica.pid)
    finally:
        os.kill(pid, signal.SIGKILL)
        replica.kill()
        replica.join(10)


def test_an_engine_core_in_its_own_session_ends_with_its_replica(tmp_path: Path) -> None:
    replica, (pid, _, _) = _start(tmp_path, own_session=True)
    try:
        replica.kill()  # SIGKILL: no clean shutdown, as when Ray kills a replica
        replica.join(10)
        deadline = time.monotonic() + 15
        while _alive(pid):
            assert time.monotonic() < deadline, "the engine core outlived its replica"
            time.sleep(0.1)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
