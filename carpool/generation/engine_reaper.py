"""Ends what a replica started when the replica dies without its cleanup (issue 43, point 10).

vLLM's ``AsyncLLM`` runs its engine core in a child process (spawned: vLLM forces spawn in a
Ray actor). When the replica process ends without calling ``shutdown()`` (SIGKILL from Ray's
OOM killer or a graceful-shutdown timeout, ``ray stop``, SIGTERM to ``make serve``'s process
group) the engine core is re-parented to init and keeps running: on CPU it spins at most of a
core, on a GPU it keeps its memory and the replacement replica fails vLLM's free-memory check.

The engine core is spawned by vLLM, so carpool cannot run code in it before it starts (no
``PR_SET_PDEATHSIG`` there). Instead ``start_reaper()`` starts this file as a small watchdog
process beside the replica. Every ``POLL_S`` it records the replica's descendants (pid and
start time, so a reused pid is never hit); when the replica is gone it sends SIGTERM to the
last recorded ones, SIGKILL after ``GRACE_S`` to any still there, and exits. One watchdog
per process, however many engines it starts; it lives as long as the process. It ignores
SIGTERM/SIGINT/SIGHUP and runs in its own session, so the signal that ends the replica's
group does not end it before it has done its job (it must outlive its parent).

``start_guard()`` is the same watchdog for one process that becomes another program: the
``carpool-haproxy`` wrapper starts one for itself before it execs HAProxy, so an HAProxy whose
Ray manager died (``ray stop``, SIGKILL) does not keep port 8000 and its CPU.

Standard library only, Linux only (``/proc``); run as ``python engine_reaper.py <pid>``
(``--child <pid>``: guard that one process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 1.0  # how stale the descendant list may be; a scan of /proc costs a few ms
GRACE_S = 3.0  # SIGTERM, then SIGKILL: vLLM's engine core exits on SIGTERM in under 1 s


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])


def _parents() -> dict[int, int]:
    """Every process's parent pid, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int, exclude: int | None = None) -> dict[int, int]:
    """The process's descendants as {pid: start time}, without ``exclude`` and its own."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: dict[int, int] = {}
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        if child == exclude:
            continue
        started = start_time(child)
        if started is not None:
            found[child] = started
        stack.extend(children.get(child, []))
    return found


def alive(pid: int, started: int) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` (and not a zombie)."""
    if start_time(pid) != started:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def reap(processes: dict[int, int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM, then after ``grace_s`` SIGKILL, to the processes still alive; their pids."""
    hit = []
    for pid, started in processes.items():
        if alive(pid, started):
            hit.append(pid)
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p, processes[p]) for p in hit):
        time.sleep(0.05)
    for pid in hit:
        if alive(pid, processes[pid]):
            _signal(pid, signal.SIGKILL)
    return hit


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def watch(parent: int, poll_s: float = POLL_S) -> list[int]:
    """Waits for ``parent`` to die, then reaps its last known descendants; their pids."""
    parent_started = start_time(parent)
    if parent_started is None:
        return []
    me = os.getpid()
    known: dict[int, int] = {}
    while alive(parent, parent_started):
        known = descendants(parent, exclude=me)
        time.sleep(poll_s)
    # The parent is gone; its children are now init's (or a subreaper's). Include what they
    # started since the last look (e.g. a vLLM worker process).
    for pid, started in list(known.items()):
        if alive(pid, started):
            known.update(descendants(pid, exclude=me))
    return reap(known)


def guard(parent: int, child: int, poll_s: float = POLL_S) -> list[int]:
    """Ends ``child`` if ``parent`` dies first; returns at once when ``child`` ends first.

    For a process that becomes another program (``carpool-haproxy`` execs HAProxy): only that
    one process is watched, so nothing else its parent started is ever signalled.
    """
    parent_started, child_started = start_time(parent), start_time(child)
    if parent_started is None or child_started is None:
        return []
    while alive(parent, parent_started):
        if not alive(child, child_started):
            return []  # it ended on its own (an HAProxy reload retires the old one)
        time.sleep(poll_s)
    return reap({child: child_started})


def start_guard(parent: int, child: int) -> subprocess.Popen[bytes] | None:
    """A watchdog that ends ``child`` when ``parent`` dies (``guard``); None off Linux."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-S", str(Path(__file__).resolve()), str(parent), "--child", str(child)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


_REAPERS: dict[int, subprocess.Popen[bytes]] = {}


def start_reaper() -> subprocess.Popen[bytes] | None:
    """This process's watchdog, started on first use; None off Linux."""
    if not Path("/proc/self/stat").exists():
        return None
    parent = os.getpid()
    running = _REAPERS.get(parent)
    if running is not None and running.poll() is None:
        return running
    _REAPERS[parent] = subprocess.Popen(
        [sys.executable, "-S", str(Path(__file__).resolve()), str(parent)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # out of the replica's process group and session
        close_fds=True,
    )
    return _REAPERS[parent]


def main(argv: list[str]) -> int:
    child: int | None = None
    if len(argv) == 3 and argv[1] == "--child" and argv[2].isdigit():
        argv, child = argv[:1], int(argv[2])
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: engine_reaper.py <parent pid> [--child <pid>]", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    reaped = watch(int(argv[0])) if child is None else guard(int(argv[0]), child)
    if reaped:
        print(f"engine_reaper: parent {argv[0]} died; ended {sorted(reaped)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
