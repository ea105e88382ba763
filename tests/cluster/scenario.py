"""The cluster tier: serve-gpu.yaml's shape on a head and two GPU workers, on one machine.

Run in its own process by test_cluster_tier.py (a Ray driver joins one cluster, and this one
needs its own). The nodes get the resources cluster.yaml gives its node types; the apps are
serve-gpu.yaml with tests/cluster/serve-gpu.cpu-overlay.yaml on top (CPU engines on tiny
models). What it checks, in order:

1. every replica runs on the node type its config asks for;
2. load on ``model: auto`` scales ``small`` from 1 to 2 replicas;
3. with 2 replicas, each serves at least a third of the auto traffic, and a load that one
   replica alone would refuse is answered without a single refusal;
4. with the load gone, ``small`` scales back to 1;
5. the worker holding ``small`` is removed under load: no non-streamed request fails, open
   streams end with [DONE] or an error event, and the service answers again within
   ``RECOVERY_LIMIT_S``.

Prints one ``CARPOOL_RESULT`` JSON line; exits non-zero on the first failed check.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_worker_niceness", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.cluster.overlay import load_overlaid  # noqa: E402
from tests.integration.multinode_scenario import free_port, wait_for  # noqa: E402

RECOVERY_LIMIT_S = 180.0
HTTP_TIMEOUT_S = 240.0


def node_resources(node_type: dict) -> dict[str, Any]:
    resources = dict(node_type["resources"])
    return {
        "num_cpus": resources.pop("CPU", 1),
        "num_gpus": resources.pop("GPU", 0),
        "resources": resources,
    }


class Load:
    """Closed-loop clients on /generate's completions with ``model: auto``."""

    def __init__(self, base: str, clients: int, max_tokens: int = 24) -> None:
        self.base, self.clients, self.max_tokens = base, clients, max_tokens
        self.statuses: list[tuple[float, int, str]] = []  # (sent at, status, body head)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                sent = time.monotonic()
                try:
                    r = client.post(
                        f"{self.base}/generate/v1/completions",
                        json={
                            "model": "auto",
                            "prompt": f"client {i} request {n}: tell me about bridges",
                            "max_tokens": self.max_tokens,
                            "ignore_eos": True,
                        },
                    )
                    status, head = r.status_code, r.text[:200]
                except httpx.HTTPError as exc:
                    status, head = -1, repr(exc)
                with self._lock:
                    self.statuses.append((sent, status, head))

    def start(self) -> Load:
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(self.clients)
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[tuple[float, int, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(HTTP_TIMEOUT_S)
        return self.statuses


def open_stream(base: str, outcome: dict[str, str], opened: threading.Event) -> None:
    """A long streamed completion; records how it ended: done, error_event or broken."""
    try:
        with (
            httpx.Client(timeout=HTTP_TIMEOUT_S) as client,
            client.stream(
                "POST",
                f"{base}/generate/v1/completions",
                json={
                    "model": "small",
                    "prompt": "a very long story",
                    "max_tokens": 480,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as r,
        ):
            if r.status_code != 200:
                outcome["end"] = f"status {r.status_code}"
                opened.set()
                return
            for line in r.iter_lines():
                opened.set()
                if line == "data: [DONE]":
                    outcome["end"] = "done"
                    return
                if line.startswith("data: ") and '"error"' in line:
                    outcome["end"] = "error_event"
                    return
            outcome["end"] = "broken"  # ended with neither
    except httpx.HTTPError as exc:
        outcome["end"] = f"broken: {exc!r}"
    finally:
        opened.set()


def main() -> int:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from router.core import share_of_cap
    from tests.conftest import deploy_declaratively
    from tests.factories import build_tiny_models

    report: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="carpool-cluster-"))
    models = build_tiny_models(work / "models")
    node_types = yaml.safe_load((ROOT / "cluster.yaml").read_text())["available_node_types"]
    head_args = node_resources(node_types["head"])
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    workers = [cluster.add_node(**node_resources(node_types["gpu_worker"])) for _ in range(2)]
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    config = load_overlaid(
        str(ROOT / "serve-gpu.yaml"),
        str(Path(__file__).with_name("serve-gpu.cpu-overlay.yaml")),
        {
            "PORT": str(port),
            "WORK": str(work),
            "ENCODER": models["encoder"],
            "CROSS_ENCODER": models["cross_encoder"],
            "CAUSAL_LM": models["causal_lm"],
        },
    )
    serve.start(http_options=config["http_options"], proxy_location=config["proxy_location"])
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    deploy_declaratively(config["applications"], timeout_s=480)
    report["deploy_s"] = round(time.monotonic() - started, 1)

    head_id = cluster.head_node.node_id
    worker_ids = {w.node_id for w in workers}

    def replicas() -> list[tuple[str, str]]:
        alive = list_actors(filters=[("state", "=", "ALIVE")], limit=2000)
        return [(a.class_name, a.node_id) for a in alive if a.class_name.startswith("ServeReplica")]

    # 1. Placement: where each deployment's config sends it.
    wanted: dict[str, str] = {}
    for app in config["applications"]:
        args = app["args"]
        ingress = (args.get("ingress") or {}).get("resources") or {}
        # carpool_ingress: the head and ingress_cpu nodes offer it; this tier starts no
        # ingress node, so the head (the tier's 8 ingress replicas fit its 8 units).
        on_cpu = {"carpool_head_node", "carpool_ingress"} & set(ingress)
        wanted[f"ServeReplica:{app['name']}:"] = "head" if on_cpu else ""
        for role in ("embedder", "ranker", "small", "large"):
            if isinstance(args.get(role), dict):
                res = (args[role].get("replica") or {}).get("resources") or {}
                if "carpool_gpu_node" in res:
                    wanted[f"ServeReplica:{app['name']}:{role}"] = "worker"
        for role in ("retriever",):  # the router runs in generate's ingress: its app's rule
            res = (args.get(role) or {}).get("resources") or {}
            if "carpool_head_node" in res:
                wanted[f"ServeReplica:{app['name']}:{role}"] = "head"
    placed = replicas()
    misplaced = []
    for class_name, node in placed:
        # A deployment's own rule, else its app's (the ingress's).
        rule = wanted.get(class_name, wanted.get(class_name.rsplit(":", 1)[0] + ":", ""))
        if (rule == "head" and node != head_id) or (rule == "worker" and node not in worker_ids):
            misplaced.append((class_name, rule))
        if not rule:  # the config leaves it to chance: it may land on a GPU worker
            misplaced.append((class_name, "no node type asked for"))
    report["replicas"] = sorted(c for c, _ in placed)
    assert not misplaced, f"replicas on the wrong node type: {misplaced}"
    report["placement_ok"] = True

    def small_running() -> int:
        deployment = serve.status().applications["generate"].deployments["small"]
        return int(deployment.replica_states.get("RUNNING", 0))

    def answered(model: str = "auto") -> bool:
        r = httpx.post(
            f"{base}/generate/v1/completions",
            json={"model": model, "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        return r.status_code == 200

    wait_for(answered, 120, "a first auto completion")
    assert small_running() == 1, f"small starts with {small_running()} replicas, not 1"
    # The router runs inside each generate_ingress replica (serve-gpu.yaml: 2 of them).
    router = serve.get_deployment_handle("generate_ingress", "generate")

    def small_caps() -> set[int]:
        return {router.route_stats.remote().result()["in_flight_caps"]["small"] for _ in range(8)}

    # 2. Auto load scales small out.
    load = Load(base, clients=10).start()
    started = time.monotonic()
    wait_for(lambda: small_running() >= 2, 180, "small scaled to 2 replicas under auto load")
    report["scale_up_s"] = round(time.monotonic() - started, 1)
    load.stop()

    # 3. Two replicas share auto traffic, and a load above one replica's room is all answered.
    logs = serve_log_dir()
    before = served_per_replica(logs)
    refused_before = refusals(logs)
    load = Load(base, clients=10).start()
    time.sleep(40)
    statuses = load.stop()
    after = served_per_replica(logs)
    served = {r: after.get(r, 0) - before.get(r, 0) for r in after}
    served = {r: n for r, n in served.items() if n > 0}
    # Refusals a replica answered (and the router or ingress retried on the other): what
    # "one replica full while the other has room" looked like in this run.
    report["refused_by_a_replica_then_retried"] = refusals(logs) - refused_before
    total = sum(served.values())
    codes: dict[str, int] = {}
    for _, status, _ in statuses:
        codes[str(status)] = codes.get(str(status), 0) + 1
    report["auto_requests"] = codes
    report["small_served_per_replica"] = served
    refused = [head for _, status, head in statuses if status != 200]
    assert not refused, f"{len(refused)} of {len(statuses)} auto requests failed: {refused[:3]}"
    assert len(served) == 2, f"small work by replica: {served}"
    assert min(served.values()) >= total / 3, f"one small replica took too little: {served}"

    # Each router's cap for small is Serve's per-replica limit x small's 2 replicas, split
    # between the 2 generate_ingress replicas hosting a router: read live from Serve's
    # controller.
    generate = next(a for a in config["applications"] if a["name"] == "generate")
    limit = next(d for d in generate["deployments"] if d["name"] == "small")
    expected = share_of_cap(limit["max_ongoing_requests"], 2, 2)
    report["router_small_caps"] = sorted(small_caps())
    assert report["router_small_caps"] == [expected], (report["router_small_caps"], expected)

    # The two routers (one per ingress replica) predict from all of it: their length
    # predictors merge through the ingress deployment's actor.
    answered_auto = sum(1 for _, status, _ in statuses if status == 200)

    def merged() -> list[int]:
        seen = [router.route_stats.remote().result()["predictor_observations"] for _ in range(12)]
        return seen if min(seen) >= answered_auto else []

    report["router_predictor_observations"] = sorted(set(wait_for(merged, 30, "merged")))
    report["auto_answered_in_phase"] = answered_auto

    # 4. With the load gone, small scales back in.
    started = time.monotonic()
    wait_for(lambda: small_running() == 1, 120, "small scaled back to 1 replica")
    report["scale_down_s"] = round(time.monotonic() - started, 1)

    # 5. Remove the worker holding small, under load and with streams open.
    small_nodes = {n for c, n in replicas() if c == "ServeReplica:generate:small"}
    victim = next(w for w in workers if w.node_id in small_nodes)
    # Within one replica's room (2 running + 4 waiting): every failure is the loss's doing.
    load = Load(base, clients=3).start()
    time.sleep(3)
    streams: list[dict[str, str]] = []
    threads = []
    for _ in range(2):
        outcome: dict[str, str] = {}
        opened = threading.Event()
        t = threading.Thread(target=open_stream, args=(base, outcome, opened), daemon=True)
        t.start()
        opened.wait(120)
        streams.append(outcome)
        threads.append(t)
    open_at_kill = sum(1 for s in streams if "end" not in s)
    killed_at = time.monotonic()
    cluster.remove_node(victim)

    def answered_after_kill() -> bool:
        return any(s > killed_at and code == 200 for s, code, _ in list(load.statuses))

    wait_for(answered_after_kill, RECOVERY_LIMIT_S, "an auto request answered after the loss")
    report["recovered_s"] = round(time.monotonic() - killed_at, 1)
    time.sleep(5)
    statuses = load.stop()
    for t in threads:
        t.join(HTTP_TIMEOUT_S)
    failed = [(round(s - killed_at, 1), code, head) for s, code, head in statuses if code != 200]
    report["node_loss_requests"] = len(statuses)
    report["node_loss_failed"] = failed[:5]
    report["streams"] = [s.get("end", "unfinished") for s in streams]
    assert not failed, f"{len(failed)} of {len(statuses)} requests failed: {failed[:3]}"
    report["streams_open_at_loss"] = open_at_kill
    assert all(s.get("end") in ("done", "error_event") for s in streams), report["streams"]
    # Streams still open when their replica's node went away end with an error event.
    assert open_at_kill >= 1, "no stream was still open when the worker went away"
    assert sum(1 for s in streams if s.get("end") == "error_event") >= open_at_kill, streams
    report["ok"] = True
    print("CARPOOL_RESULT " + json.dumps(report), flush=True)
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    return 0


def serve_log_dir() -> str:
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    return os.path.join(session, "logs", "serve")


ACCESS = re.compile(r"CALL (generate|stream) OK")


def served_per_replica(log_dir: str) -> dict[str, int]:
    """Requests each ``small`` replica answered, from Serve's replica access logs."""
    counts = {}
    for path in glob.glob(os.path.join(log_dir, "replica_generate_small_*.log")):
        with open(path, errors="replace") as fh:
            counts[os.path.basename(path)] = sum(1 for line in fh if ACCESS.search(line))
    return counts


def refusals(log_dir: str) -> int:
    """Overload refusals ``small``'s replicas answered, from their logs."""
    total = 0
    for path in glob.glob(os.path.join(log_dir, "replica_generate_small_*.log")):
        with open(path, errors="replace") as fh:
            total += sum(1 for line in fh if "waiting for a slot" in line)
    return total


if __name__ == "__main__":
    raise SystemExit(main())
