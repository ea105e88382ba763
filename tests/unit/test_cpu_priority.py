"""An ingress lowers the CPU priority of every thread it has, once, without privileges."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, os, threading
from carpool.http import lower_cpu_priority

def niceness():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        stat = open(f"/proc/self/task/{tid}/stat").read()
        out[tid] = int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice
    return out

start = os.getpriority(os.PRIO_PROCESS, 0)
stop = threading.Event()
worker = threading.Thread(target=stop.wait)  # a thread that exists before the call
worker.start()
first = lower_cpu_priority(3)
second = lower_cpu_priority(3)  # idempotent: not 6
later = threading.Thread(target=stop.wait)  # created afterwards: inherits
later.start()
print(json.dumps({"start": start, "first": first, "second": second, "threads": niceness()}))
stop.set()
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_every_thread_runs_lower_and_a_second_call_changes_nothing() -> None:
    # A child process: the test runner's own priority stays as it is.
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    expected = min(19, result["start"] + 3)
    assert result["first"] == result["second"] == expected
    assert len(result["threads"]) >= 3
    assert set(result["threads"].values()) == {expected}


CHILD = """
import sys, threading
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def _thread_niceness(pid: int) -> set[int]:
    out = set()
    for tid in Path(f"/proc/{pid}/task").iterdir():
        stat = (tid / "stat").read_text()
        out.add(int(stat.rsplit(")", 1)[1].split()[16]))
    return out


def _spawn(title: str) -> subprocess.Popen:
    # argv[0] is what /proc/<pid>/cmdline starts with: Ray sets its workers' titles so.
    child = subprocess.Popen(
        [title, "-c", CHILD],
        executable=sys.executable,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_the_serve_proxy_on_this_node_runs_lower_and_nothing_else_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from carpool import http
    from carpool.http import lower_proxy_priority

    # Another test may have built an ingress in this process, which lowered the process and
    # recorded where it started; here "where Ray started the workers" is this process now.
    monkeypatch.setattr(http, "_base_niceness", None)

    proxy = _spawn("ray::ProxyActor")
    bystander = _spawn("ray::ServeReplica:embed:embedder")
    try:
        start = os.getpriority(os.PRIO_PROCESS, 0)
        expected = min(19, start + 4)
        # Another cluster's proxy (its raylet is not ours) is left alone.
        assert lower_proxy_priority(4, parent=proxy.pid) == []
        assert _thread_niceness(proxy.pid) == {start}
        # Ours: the children here have this process as their "raylet".
        assert lower_proxy_priority(4, parent=os.getpid()) == [proxy.pid]
        assert _thread_niceness(proxy.pid) == {expected}
        assert len(list(Path(f"/proc/{proxy.pid}/task").iterdir())) >= 2
        assert _thread_niceness(bystander.pid) == {start}
        lower_proxy_priority(4, parent=os.getpid())  # a refusal re-checks: not 8 levels down
        assert _thread_niceness(proxy.pid) == {expected}
    finally:
        for child in (proxy, bystander):
            child.kill()
            child.wait()
