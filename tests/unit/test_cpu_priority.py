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


SHIPPED_CONFIGS = [
    "serve.yaml",
    "serve-gpu.yaml",
    "docs/kuberay/rayservice.yaml",
    "docs/kuberay/rayservice-gpu.yaml",
]


def _applications(path: str) -> list[dict]:
    for doc in yaml.safe_load_all((ROOT / path).read_text()):
        if doc and doc.get("kind") == "RayService":  # its serve config is a YAML string
            return yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
        if doc and "applications" in doc:
            return doc["applications"]
    raise AssertionError(f"{path} has no serve applications")


@pytest.mark.parametrize("path", SHIPPED_CONFIGS)
def test_no_shipped_config_renices_rays_proxy(path: str) -> None:
    from carpool.config import IngressConfig

    apps = _applications(path)
    assert apps
    for app in apps:
        # As the ingress will run it: what the config sets, else the default.
        ingress = IngressConfig.model_validate((app.get("args") or {}).get("ingress") or {})
        assert ingress.proxy_cpu_niceness == 0, f"{path}: {app['name']} renices Ray's proxy"


REPLICA_SCRIPT = """
import json, os, subprocess, sys, threading
from carpool.priority import apply_replica_priority

def state(tid=0):
    return [os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid),
            sorted(os.sched_getaffinity(tid))]

if __name__ == "__main__":
    start = state()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)  # a thread that exists before the call
    worker.start()
    apply_replica_priority(0)  # the default: nothing changes
    unchanged = state()
    cores = json.loads(sys.argv[3])
    apply_replica_priority(int(sys.argv[1]), sys.argv[2], cores)
    # A process started afterwards, the way vLLM starts its engine core (spawn: fork, then
    # exec of a fresh interpreter). Read from here, as the OS set it at fork: the child needs
    # no CPU to be checked, so a SCHED_IDLE one starved by a busy machine still answers.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    child_state = state(child.pid)
    child.kill()
    child.wait()
    threads = [state(int(t)) for t in os.listdir("/proc/self/task")]
    stop.set()
    print(json.dumps({"start": start, "unchanged": unchanged, "threads": threads,
                      "child": child_state, "idle": os.SCHED_IDLE}), flush=True)
    worker.join()
    os._exit(0)  # no interpreter teardown: a SCHED_IDLE process on a busy machine is slow
"""


def _run_replica(
    tmp_path: Path, niceness: int, scheduling: str, cores: list[int] | None = None
) -> dict:
    """Applies a replica priority in a child process (spawn needs a file, and the runner's
    own priority must stay as it is) and returns what its threads and its child run at."""
    script = tmp_path / "replica.py"
    script.write_text(REPLICA_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(niceness), scheduling, json.dumps(cores)],
        capture_output=True,
        text=True,
        timeout=600,  # SCHED_IDLE gets CPU only when no one else wants it
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["unchanged"] == result["start"]
    assert len(result["threads"]) >= 2
    return result


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_replica_niceness_reaches_its_threads_and_the_processes_it_starts_later(
    tmp_path: Path,
) -> None:
    result = _run_replica(tmp_path, 4, "normal")
    lowered = [min(19, result["start"][0] + 4), *result["start"][1:]]
    assert all(t == lowered for t in result["threads"])
    assert result["child"] == lowered


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux scheduling classes")
def test_an_idle_replica_moves_every_thread_and_later_processes_to_sched_idle(
    tmp_path: Path,
) -> None:
    result = _run_replica(tmp_path, 0, "idle")
    assert result["start"][1] != result["idle"]  # the runner's class: a change to observe
    idle = [result["start"][0], result["idle"], result["start"][2]]
    assert all(t == idle for t in result["threads"])
    assert result["child"] == idle


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
    events: list[tuple[str, int, list[int] | None]] = []

    def place(config: object, engine: str) -> None:
        events.append(("place", 0, None))
        raise _Placed

    monkeypatch.setattr(
        module,
        "apply_replica_priority",
        lambda n, policy, cores: events.append((policy, n, cores)),
    )
    monkeypatch.setattr(module, "place_replica", place)
    config = {
        "replica": {
            "num_cpus": 0.5,
            "cpu_niceness": 3,
            "cpu_scheduling": "idle",
            "cpu_cores": [0],
        }
    }
    if stage == "generator":
        config["mode"] = "continuous"
    with pytest.raises(_Placed):
        shell(config)
    assert events == [("idle", 3, [0]), ("place", 0, None)]


def test_replica_niceness_is_bounded_and_off_by_default() -> None:
    from pydantic import ValidationError

    from carpool.config import ReplicaConfig

    assert ReplicaConfig().cpu_niceness == 0
    assert ReplicaConfig(cpu_niceness=4).cpu_niceness == 4
    for bad in (-1, 20):
        with pytest.raises(ValidationError, match="cpu_niceness"):
            ReplicaConfig(cpu_niceness=bad)


# The only model replica a shipped config lowers: serve.yaml's embedder, so that on its 2
# cores vLLM's engine keeps its core under mixed load (docs/configuration.md, "A model that
# yields"). A generator is never lowered, and no cluster config lowers anything.
LOWERED = {("serve.yaml", "embed", "embedder"): 10}


@pytest.mark.parametrize("path", SHIPPED_CONFIGS)
def test_only_the_single_box_embedder_is_lowered(path: str) -> None:
    # Ingress niceness (IngressConfig.cpu_niceness) is another field.
    def replicas(node: object, where: tuple[str, ...]) -> list[tuple[tuple[str, ...], dict]]:
        if isinstance(node, dict):
            found = [(where, node["replica"])] if isinstance(node.get("replica"), dict) else []
            return found + [r for k, v in node.items() for r in replicas(v, (*where, str(k)))]
        if isinstance(node, list):
            return [r for v in node for r in replicas(v, where)]
        return []

    models = [
        (app["name"], where[-1], replica)
        for app in _applications(path)
        for where, replica in replicas(app.get("args", {}), ())
    ]
    assert models, f"{path}: no model replica settings found"
    for app, model, replica in models:
        wanted = LOWERED.get((path, app, model), 0)
        assert replica.get("cpu_niceness", 0) == wanted, f"{path}: {app}/{model}: {replica}"
        assert replica.get("cpu_scheduling", "normal") == "normal", f"{path}: {replica}"
        assert replica.get("cpu_cores") is None, f"{path}: {replica}"
    if path == "serve.yaml":
        assert ("embed", "embedder") in {(a, m) for a, m, _ in models}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to narrow to one")
def test_replica_cores_reach_its_threads_and_the_processes_it_starts_later(
    tmp_path: Path,
) -> None:
    core = max(os.sched_getaffinity(0))
    result = _run_replica(tmp_path, 0, "normal", [core])
    assert len(result["start"][2]) >= 2  # the runner's cores: a change to observe
    bound = [*result["start"][:2], [core]]
    assert all(t == bound for t in result["threads"])
    assert result["child"] == bound


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_replica_cores_outside_what_it_may_use_are_refused_by_name() -> None:
    from carpool.priority import bind_cpu_cores

    before = os.sched_getaffinity(0)
    outside = max(before) + 1
    with pytest.raises(ValueError, match=rf"replica.cpu_cores names cores \[{outside}\]"):
        bind_cpu_cores([min(before), outside])
    assert os.sched_getaffinity(0) == before  # nothing narrowed on the way


def test_replica_cores_are_bounded_and_off_by_default() -> None:
    from pydantic import ValidationError

    from carpool.config import ReplicaConfig

    assert ReplicaConfig().cpu_cores is None
    assert ReplicaConfig(cpu_cores=[1]).cpu_cores == [1]
    for bad in ([], [-1], "1"):
        with pytest.raises(ValidationError, match="cpu_cores"):
            ReplicaConfig(cpu_cores=bad)
