"""The engine reaper ends a dead replica's children (issue 43, point 10).

A real parent process starts a child the way vLLM starts its engine core (multiprocessing,
spawn), then is killed with SIGKILL. Without the reaper the child lives on (the control case,
which is the bug); with it the child is gone within seconds. The vLLM tier
(tests/vllm/test_vllm_orphans.py) does the same with a real vLLM engine core.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from carpool.generation import engine_reaper

REAPER = Path(engine_reaper.__file__)

PARENT = textwrap.dedent(
    """
    import multiprocessing, sys, time, importlib.util
    def spin():
        while True:
            sum(range(1000))
            time.sleep(0.01)
    if __name__ == "__main__":
        if sys.argv[1] == "reaper":
            spec = importlib.util.spec_from_file_location("engine_reaper", sys.argv[2])
            reaper = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(reaper)
            reaper.start_reaper()
        child = multiprocessing.get_context("spawn").Process(target=spin, daemon=False)
        child.start()
        print(child.pid, flush=True)
        time.sleep(600)
    """
)


def _start_parent(tmp_path: Path, with_reaper: bool) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), "reaper" if with_reaper else "none", str(REAPER)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    return parent, child


def _gone_within(pid: int, started: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not engine_reaper.alive(pid, started):
            return True
        time.sleep(0.1)
    return False


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("with_reaper", [False, True], ids=["without", "with"])
def test_a_sigkilled_parents_child_is_ended_only_with_the_reaper(
    tmp_path: Path, with_reaper: bool
) -> None:
    parent, child = _start_parent(tmp_path, with_reaper)
    started = engine_reaper.start_time(child)
    assert started is not None
    try:
        time.sleep(engine_reaper.POLL_S * 2.5)  # the reaper has seen the child
        parent.kill()
        parent.wait()
        if with_reaper:
            assert _gone_within(child, started, engine_reaper.GRACE_S + 3), (
                "the child outlived its SIGKILLed parent for 6 s despite the reaper"
            )
        else:
            # The bug this guards against: an orphan lives on.
            assert not _gone_within(child, started, 3), "an orphan ended by itself"
    finally:
        if engine_reaper.alive(child, started):
            _kill(child)


def test_the_reaper_ignores_the_signal_that_ends_its_parents_group(tmp_path: Path) -> None:
    """SIGTERM to make serve's process group must not end the reaper before it reaps."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reaper = subprocess.Popen([sys.executable, "-S", str(REAPER), str(sleeper.pid)])
    try:
        time.sleep(0.5)
        reaper.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert reaper.poll() is None, "SIGTERM ended the reaper"
        sleeper.kill()
        sleeper.wait()
        assert reaper.wait(timeout=engine_reaper.POLL_S + 5) == 0  # and then it exits
    finally:
        reaper.kill()
        sleeper.kill()


def test_a_reused_pid_is_not_the_process_that_was_recorded() -> None:
    me = os.getpid()
    started = engine_reaper.start_time(me)
    assert started is not None and engine_reaper.alive(me, started)
    assert not engine_reaper.alive(me, started + 1)


def test_descendants_are_found_through_grandchildren() -> None:
    outer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert outer.stdout is not None
        grandchild = int(outer.stdout.readline())
        found = engine_reaper.descendants(os.getpid())
        assert outer.pid in found and grandchild in found
        assert grandchild not in engine_reaper.descendants(os.getpid(), exclude=outer.pid)
    finally:
        for pid in engine_reaper.descendants(outer.pid):
            _kill(pid)
        outer.kill()
        outer.wait()


def test_the_reaper_refuses_a_bad_command_line() -> None:
    assert engine_reaper.main([]) == 2
    assert engine_reaper.main(["not-a-pid"]) == 2


# A parent that starts one child (as Ray's HAProxy manager starts carpool-haproxy) and prints
# its pid; the child is what the guard watches.
GUARDED_PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def test_the_guard_ends_one_child_when_its_parent_is_sigkilled() -> None:
    """carpool-haproxy's watchdog: its HAProxy does not outlive Ray's manager (issue 43)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", GUARDED_PARENT], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    started = engine_reaper.start_time(child)
    assert started is not None
    guard = engine_reaper.start_guard(parent.pid, child)
    assert guard is not None
    try:
        time.sleep(engine_reaper.POLL_S * 1.5)
        parent.kill()
        parent.wait()
        assert _gone_within(child, started, engine_reaper.GRACE_S + 3), (
            "the guarded child outlived its SIGKILLed parent for 6 s"
        )
        assert guard.wait(timeout=10) == 0
    finally:
        if engine_reaper.alive(child, started):
            _kill(child)
        _kill(guard.pid)


def test_the_guard_leaves_when_its_child_ends_first() -> None:
    """An HAProxy reload retires the old process: its guard must not linger (or kill)."""
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    guard = engine_reaper.start_guard(parent.pid, child.pid)
    assert guard is not None
    try:
        child.wait()
        assert guard.wait(timeout=10) == 0
        assert parent.poll() is None  # the parent was never signalled
    finally:
        parent.kill()
        parent.wait()
        _kill(guard.pid)


def test_carpool_haproxy_guards_itself_before_it_becomes_haproxy(monkeypatch) -> None:
    """The wrapper starts the guard for (its parent, itself), then execs the real binary."""
    from carpool import haproxy

    calls: list[tuple] = []
    monkeypatch.setattr(
        haproxy, "start_guard", lambda parent, child: calls.append(("guard", parent, child))
    )
    monkeypatch.setattr(haproxy, "real_binary", lambda: "/bin/true")
    monkeypatch.setattr(haproxy.os, "execv", lambda path, argv: calls.append(("exec", path, argv)))
    haproxy.main(["-v"])
    assert calls == [
        ("guard", os.getppid(), os.getpid()),
        ("exec", "/bin/true", ["/bin/true", "-v"]),
    ]
