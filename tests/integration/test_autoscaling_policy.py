"""carpool's autoscaling policy on a live Serve: the scaling target follows the batching
knobs in force, including after an in-place ``user_config`` change (issue 15).

The app is deployed declaratively, as ``serve run serve.yaml`` does, with the autoscaling
config in its ``deployments[]`` entry: Serve imports the policy by name, the replicas report
their capacity (``record_autoscaling_stats``) and the controller scales on it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from ray import serve

from tests.conftest import deploy_declaratively

APP = "scale-embed"
BATCHING = {"batch_wait_timeout_s": 0.0, "max_batch_tokens": 65536}


def _app(encoder: str, max_batch_size: int) -> dict[str, Any]:
    return {
        "name": APP,
        "route_prefix": f"/{APP}",
        "import_path": "pipelines.embed:build_embed_app",
        "args": {
            "embedder": {"source": {"model": encoder}, "replica": {"num_cpus": 0.1}},
            "ingress": {"num_cpus": 0.05},
        },
        "deployments": [
            {
                "name": "embedder",
                "user_config": {**BATCHING, "max_batch_size": max_batch_size},
                "autoscaling_config": {
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "metrics_interval_s": 1.0,
                    "look_back_period_s": 3.0,
                    "upscale_delay_s": 0.0,
                    "downscale_delay_s": 2.0,
                    "policy": {"policy_function": "carpool.autoscaling:follow_batch_capacity"},
                },
            }
        ],
    }


def _running_replicas() -> int:
    deployment = serve.status().applications[APP].deployments["embedder"]
    return int(deployment.replica_states.get("RUNNING", 0))


def _wait_for_replicas(count: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _running_replicas() != count:
        assert time.monotonic() < deadline, f"embedder did not reach {count} replicas"
        time.sleep(0.5)


class SteadyLoad:
    """Clients that keep requests outstanding until stopped (a real client's retry on 503)."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.stop = threading.Event()
        self.answered = 0
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _client(self) -> None:
        body = {"input": ["a sentence long enough to be worth a batch " * 6] * 8}
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                if client.post(self.url, json=body).status_code == 200:
                    self.answered += 1

    def __enter__(self) -> SteadyLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


def test_the_target_follows_the_batch_size_in_force(serve_http: str, tiny_models: dict) -> None:
    deploy_declaratively([_app(tiny_models["encoder"], max_batch_size=1)])
    try:
        assert _running_replicas() == 1
        with SteadyLoad(f"{serve_http}/{APP}/v1/embeddings", clients=12) as load:
            # One request per replica at a time under max_batch_size 1: twelve clients need
            # more replicas than max_replicas allows.
            _wait_for_replicas(2)
            # Same load, batches of 64 applied in place: one replica carries it, so the
            # policy scales back (Serve's own policy, aiming at 2 per replica, would not).
            deploy_declaratively([_app(tiny_models["encoder"], max_batch_size=64)])
            _wait_for_replicas(1)
            assert load.answered > 0
    finally:
        serve.delete(APP)
