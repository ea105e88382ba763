"""An ingress lowers the CPU priority of every thread it has, once, without privileges; Ray's
Serve proxy, a process carpool does not own, only where a config opts in, and loudly."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, threading
from carpool.priority import lower_cpu_priority

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

    from carpool import priority
    from carpool.priority import lower_proxy_priority

    # Another test may have built an ingress in this process, which lowered the process and
    # recorded where it started; here "where Ray started the workers" is this process now.
    monkeypatch.setattr(priority, "_base_niceness", None)

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


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Records what an ingress would renice instead of renicing the test runner (and a fresh
    process's state: no proxy levels, no warning given yet)."""
    from carpool import priority

    seen: dict[str, list[int]] = {"own": [], "proxy": []}
    monkeypatch.setattr(priority, "lower_cpu_priority", lambda n: seen["own"].append(n))

    def proxy(levels: int, parent: int | None = None) -> list[int]:
        seen["proxy"].append(levels)
        return [4242]

    monkeypatch.setattr(priority, "lower_proxy_priority", proxy)
    monkeypatch.setattr(priority, "_proxy_levels", 0)
    monkeypatch.setattr(priority, "_proxy_warned", False)
    monkeypatch.setattr(priority, "_proxy_checked_at", float("-inf"))
    return seen


def test_by_default_an_ingress_lowers_itself_and_leaves_rays_proxy_alone(
    calls: dict[str, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    from carpool.config import IngressConfig
    from carpool.http import apply_ingress_defaults, make_api
    from carpool.priority import recheck_proxy_priority

    ingress = IngressConfig()
    assert ingress.proxy_cpu_niceness == 0
    assert ingress.cpu_niceness == 5  # its own process: kept (see the field's description)
    api = make_api("test", "an ingress", 1024)
    with caplog.at_level(logging.WARNING, logger="carpool"):
        apply_ingress_defaults(api, ingress)
        recheck_proxy_priority()  # an overload refusal: still nothing reaches the proxy
    assert calls == {"own": [5], "proxy": []}
    assert "PROXY" not in caplog.text


def test_an_opted_in_proxy_renice_warns_loudly_once_per_process(
    calls: dict[str, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    from carpool.config import IngressConfig
    from carpool.priority import apply_ingress_priority

    ingress = IngressConfig(cpu_niceness=0, proxy_cpu_niceness=3)
    with caplog.at_level(logging.WARNING, logger="carpool"):
        apply_ingress_priority(ingress.cpu_niceness, ingress.proxy_cpu_niceness)
        apply_ingress_priority(ingress.cpu_niceness, ingress.proxy_cpu_niceness)
    assert calls == {"own": [], "proxy": [3, 3]}
    warnings = [r for r in caplog.records if "RENICING RAY SERVE'S HTTP PROXY" in r.message]
    assert len(warnings) == 1
    assert "4242" in warnings[0].message and "does not own" in warnings[0].message
    assert "proxy_cpu_niceness: 0" in warnings[0].message


def _applications(path: str) -> list[dict]:
    for doc in yaml.safe_load_all((ROOT / path).read_text()):
        if doc and doc.get("kind") == "RayService":  # its serve config is a YAML string
            return yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
        if doc and "applications" in doc:
            return doc["applications"]
    raise AssertionError(f"{path} has no serve applications")


@pytest.mark.parametrize(
    "path",
    [
        "serve.yaml",
        "serve-gpu.yaml",
        "docs/kuberay/rayservice.yaml",
        "docs/kuberay/rayservice-gpu.yaml",
    ],
)
def test_no_shipped_config_renices_rays_proxy(path: str) -> None:
    from carpool.config import IngressConfig

    apps = _applications(path)
    assert apps
    for app in apps:
        # As the ingress will run it: what the config sets, else the default.
        ingress = IngressConfig.model_validate((app.get("args") or {}).get("ingress") or {})
        assert ingress.proxy_cpu_niceness == 0, f"{path}: {app['name']} renices Ray's proxy"


REPLICA_SCRIPT = """
import json, multiprocessing, os, sys
from carpool.priority import apply_replica_priority

def report(queue):
    queue.put(os.getpriority(os.PRIO_PROCESS, 0))

if __name__ == "__main__":
    start = os.getpriority(os.PRIO_PROCESS, 0)
    apply_replica_priority(0)  # the default: nothing changes
    unchanged = os.getpriority(os.PRIO_PROCESS, 0)
    apply_replica_priority(int(sys.argv[1]))
    # A process started afterwards, the way vLLM starts its engine core: spawned, not forked.
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=report, args=(queue,))
    child.start()
    child_nice = queue.get(timeout=60)
    child.join()
    print(json.dumps({"start": start, "unchanged": unchanged,
                      "own": os.getpriority(os.PRIO_PROCESS, 0), "child": child_nice}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_replica_niceness_reaches_the_processes_it_starts_later(tmp_path: Path) -> None:
    script = tmp_path / "replica.py"
    script.write_text(REPLICA_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), "4"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    expected = min(19, result["start"] + 4)
    assert result["unchanged"] == result["start"]
    assert result["own"] == result["child"] == expected


class _Placed(Exception):
    """Stops a deployment shell where it would start loading the model."""


@pytest.mark.parametrize("stage", ["embedder", "ranker", "generator"])
def test_every_model_shell_lowers_itself_before_placing_the_model(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import deployments.embedder as embedder
    import deployments.generator as generator
    import deployments.ranker as ranker

    module, shell = {
        "embedder": (embedder, embedder.EmbeddingDeployment),
        "ranker": (ranker, ranker.RankingDeployment),
        "generator": (generator, generator.GeneratorDeployment),
    }[stage]
    events: list[tuple[str, int]] = []

    def place(config: object, engine: str) -> None:
        events.append(("place", 0))
        raise _Placed

    monkeypatch.setattr(
        module, "apply_replica_priority", lambda n, policy: events.append((policy, n))
    )
    monkeypatch.setattr(module, "place_replica", place)
    config = {"replica": {"num_cpus": 0.5, "cpu_niceness": 3, "cpu_scheduling": "idle"}}
    if stage == "generator":
        config["mode"] = "continuous"
    with pytest.raises(_Placed):
        shell(config)
    assert events == [("idle", 3), ("place", 0)]


def test_replica_niceness_is_bounded_and_off_by_default() -> None:
    from pydantic import ValidationError

    from carpool.config import ReplicaConfig

    assert ReplicaConfig().cpu_niceness == 0
    assert ReplicaConfig(cpu_niceness=4).cpu_niceness == 4
    for bad in (-1, 20):
        with pytest.raises(ValidationError, match="cpu_niceness"):
            ReplicaConfig(cpu_niceness=bad)


IDLE_SCRIPT = """
import json, multiprocessing, os, threading
from carpool.priority import apply_replica_priority

def report(queue):
    queue.put(os.sched_getscheduler(0))

if __name__ == "__main__":
    before = os.sched_getscheduler(0)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)  # exists before the call
    worker.start()
    apply_replica_priority(0, "idle")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=report, args=(queue,))
    child.start()
    child_policy = queue.get(timeout=60)
    child.join()
    threads = {t: os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
    stop.set()
    print(json.dumps({"before": before, "idle": os.SCHED_IDLE, "child": child_policy,
                      "threads": threads}))
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux scheduling classes")
def test_an_idle_replica_moves_every_thread_and_later_processes_to_sched_idle(
    tmp_path: Path,
) -> None:
    script = tmp_path / "idle.py"
    script.write_text(IDLE_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["before"] != result["idle"]  # the runner's class: a change to observe
    assert len(result["threads"]) >= 2
    assert set(result["threads"].values()) == {result["idle"]}
    assert result["child"] == result["idle"]
