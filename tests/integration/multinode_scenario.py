"""Multi-node scenario, run in its own process by test_multinode.py (a Ray driver can join
only one cluster, and this one needs a simulated cluster of its own).

A head and two worker nodes with logical GPUs: models land on GPU nodes, /search works across
nodes, and removing the worker that hosts the retriever and the embedder reschedules them
while the ingested corpus survives (the index persists to a shared directory).
Prints one JSON line with what it observed; exits non-zero on failure.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FACT = "The Quillon bridge was painted bright orange in 1987 by the fishermen's guild."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:
            last = exc
        time.sleep(1)
    raise TimeoutError(f"{what} not reached in {timeout_s}s (last error: {last})")


def main() -> int:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from tests.conftest import deploy_declaratively
    from tests.factories import build_tiny_models

    work = Path(tempfile.mkdtemp(prefix="carpool-multinode-"))
    models = build_tiny_models(work / "models")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"carpool_head_node": 1}},
    )
    workers = [
        cluster.add_node(num_cpus=2, num_gpus=2, resources={"carpool_gpu_node": 1})
        for _ in range(2)
    ]
    # Pin the state API (list_actors) to this cluster: other Ray instances may run on the
    # machine, and it would otherwise pick "the latest" one.
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    on_gpu = {"num_cpus": 0.25, "num_gpus": 0.5, "resources": {"carpool_gpu_node": 0.01}}
    batching = {"max_batch_size": 16, "max_batch_tokens": 1024}
    apps = [
        {
            "name": "embed",
            "route_prefix": "/embed",
            "import_path": "pipelines.embed:build_embed_app",
            "args": {
                "embedder": {
                    "source": {"model": models["encoder"], "device": "cpu"},
                    "replica": on_gpu,
                    "batching": batching,
                }
            },
        },
        {
            "name": "rank",
            "route_prefix": "/rank",
            "import_path": "pipelines.rank:build_rank_app",
            "args": {
                "ranker": {
                    "backend": "cross_encoder",
                    "source": {"model": models["cross_encoder"], "device": "cpu"},
                    "replica": on_gpu,
                    "batching": batching,
                }
            },
        },
        {
            "name": "search",
            "route_prefix": "/search",
            "import_path": "pipelines.search:build_search_app",
            "args": {
                # Pinned to GPU workers too, so removing a worker can take the index's replica.
                "retriever": {
                    "index_dir": str(work / "index"),
                    "seed_default_corpus": False,
                    "resources": {"carpool_gpu_node": 0.01},
                },
                # Tiny random ranker: keep retrieval order so the check is about placement.
                "rerank_weight": 0.0,
            },
        },
    ]
    apps += [
        {
            "name": "generate",
            "route_prefix": "/generate",
            "import_path": "pipelines.generate:build_generate_app",
            "args": {
                "small": {
                    "source": {
                        "model": models["causal_lm"],
                        "served_model_name": "tiny",
                        "device": "cpu",
                    },
                    "replica": on_gpu,
                    "limits": {"max_seq_len": 512, "default_max_tokens": 8},
                },
                "large": None,
            },
        },
        {
            "name": "rag",
            "route_prefix": "/rag",
            "import_path": "pipelines.rag:build_rag_app",
            "args": {"rerank_weight": 0.0, "default_max_tokens": 6},
        },
    ]
    deploy_declaratively(apps, timeout_s=300)

    worker_ids = {w.node_id for w in workers}
    head_id = cluster.head_node.node_id

    def replicas() -> dict[str, str]:
        alive = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        return {a.class_name: a.node_id for a in alive if a.class_name.startswith("ServeReplica")}

    placed = replicas()
    for name in (
        "ServeReplica:embed:embedder",
        "ServeReplica:rank:ranker",
        "ServeReplica:search:retriever",
    ):
        assert placed[name] in worker_ids, f"{name} on {placed[name]}, not a GPU worker"

    added = httpx.post(
        f"{base}/search/v1/documents",
        json={"documents": [{"id": "quillon", "text": FACT}]},
        timeout=120,
    )
    assert added.status_code == 200, added.text

    def found() -> bool:
        r = httpx.post(
            f"{base}/search/v1/search",
            json={"query": "Quillon bridge orange", "top_n": 1},
            timeout=60,
        )
        return r.status_code == 200 and r.json()["results"][0]["doc_id"] == "quillon"

    wait_for(found, 60, "search across nodes")

    def answered() -> bool:
        r = httpx.post(
            f"{base}/rag/v1/chat/completions",
            timeout=120,
            json={
                "messages": [{"role": "user", "content": "Quillon bridge orange?"}],
                "max_tokens": 4,
            },
        )
        return r.status_code == 200 and r.json()["citations"][0] == "quillon"

    wait_for(answered, 120, "rag across nodes")
    victim_id = placed["ServeReplica:search:retriever"]
    victim = next(w for w in workers if w.node_id == victim_id)
    moved_embedder = placed["ServeReplica:embed:embedder"] == victim_id
    started = time.monotonic()
    cluster.remove_node(victim)
    moving = (
        "ServeReplica:embed:embedder",
        "ServeReplica:rank:ranker",
        "ServeReplica:search:retriever",
        "ServeReplica:generate:small",
    )
    wait_for(
        lambda: all(replicas().get(m) not in (None, victim_id) for m in moving),
        180,
        "replicas rescheduled off the lost node",
    )
    wait_for(found, 180, "search answering again after node loss")
    wait_for(answered, 180, "rag answering again after node loss")
    recovered_s = time.monotonic() - started
    after = replicas()
    assert after["ServeReplica:search:retriever"] in worker_ids - {victim_id}
    assert head_id not in {after["ServeReplica:embed:embedder"], after["ServeReplica:rank:ranker"]}
    print(
        "CARPOOL_RESULT "
        + json.dumps(
            {
                "placement_ok": True,
                "removed_node_hosted_embedder": moved_embedder,
                "recovered_s": round(recovered_s, 1),
            }
        ),
        flush=True,
    )
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
