"""Every dashboard panel's PromQL returns data from a real Prometheus scraping real replicas.

No Grafana server installs here, so the dashboards are checked at the level that matters:
the queries, against a real Prometheus (Debian's `prometheus`), fed by Serve apps under
traffic. Skipped, with the reason, only when no prometheus binary exists (`make monitor`
and `make test` install it where they can).
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from carpool.admission import RequestControls
from carpool.errors import find_request_error
from dashboards.definitions import DASHBOARDS
from dashboards.monitor import prometheus_config, start_prometheus
from pipelines.embed import build_embed_app
from pipelines.generate import build_generate_app

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="no prometheus binary (apt-get install prometheus)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traffic(base: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            client.post(
                f"{base}/dash-embed/v1/embeddings",
                json={"input": ["a short text", "a longer text " * 20, "mid text " * 5]},
            )
            client.post(f"{base}/dash-embed/v1/embeddings", json={"input": []})  # a 400
            client.post(
                f"{base}/dash-generate/v1/completions",
                json={"prompt": "the river and the", "max_tokens": 6},
            )
            # Through the router: the tiny small model runs out of tokens, so it escalates.
            client.post(
                f"{base}/dash-generate/v1/completions",
                json={"model": "auto", "prompt": "explain the river", "max_tokens": 4},
            )


def _wait_ready(prom: str, process) -> None:
    deadline = time.monotonic() + 120  # a loaded 2-core machine starts it slowly
    while time.monotonic() < deadline:
        assert process.poll() is None, f"prometheus exited: {process.stderr.read()[-2000:]}"
        try:
            if httpx.get(f"{prom}/-/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("prometheus not ready after 120 s")


def _query(prom: str, expr: str) -> list[dict]:
    expr = expr.replace("$application", ".*").replace("$deployment", ".*")
    body = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_every_panel_query_returns_data(serve_http: str, tiny_models: dict, tmp_path: Path) -> None:
    serve.run(
        build_embed_app(
            {
                "embedder": {
                    "source": {"model": tiny_models["encoder"]},
                    "replica": {"num_cpus": 0.25},
                }
            }
        ),
        name="dash-embed",
        route_prefix="/dash-embed",
    )
    generator = {
        "source": {"model": tiny_models["causal_lm"], "served_model_name": "tiny"},
        "replica": {"num_cpus": 0.25, "torch_threads": 1},
        "limits": {"max_seq_len": 256, "default_max_tokens": 8},
        "batching": {"max_num_seqs": 4, "max_step_tokens": 128},
    }
    serve.run(
        build_generate_app({"small": generator, "large": generator}),
        name="dash-generate",
        route_prefix="/dash-generate",
    )
    targets = [f"127.0.0.1:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]]
    # The HAProxy ingress's own exporter, when the session runs it (tests/conftest.py).
    exporter = os.environ.get("RAY_SERVE_HAPROXY_METRICS_PORT")
    haproxy_on = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and exporter
    haproxy_targets = [f"127.0.0.1:{exporter}"] if haproxy_on else None
    port = _free_port()
    prometheus = start_prometheus(
        # 5 s, and so a 5 s scrape timeout: on a busy machine Ray's metrics agent took over
        # 1 s to answer, and every scrape of a 1 s interval timed out (all panels empty).
        prometheus_config(
            static_targets=targets,
            scrape_interval_s=5,
            haproxy_targets=haproxy_targets,
        ),
        tmp_path,
        port,
    )
    prom = f"http://127.0.0.1:{port}"
    _wait_ready(prom, prometheus)
    stop = threading.Event()
    sender = threading.Thread(target=_traffic, args=(serve_http, stop), daemon=True)
    sender.start()
    # A request that arrives past its deadline is dropped by the replica (the panel of
    # dropped items needs one); through the handle, so the ingress cannot refuse it first.
    embedder = serve.get_deployment_handle("embedder", app_name="dash-embed")
    with pytest.raises(Exception) as info:
        late = RequestControls(deadline=time.time() - 1)
        embedder.embed.remote(["too late"], True, late).result(timeout_s=60)
    found = find_request_error(info.value)
    assert found is not None and found.status_code == 504
    try:
        missing: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            missing = []
            for dashboard in DASHBOARDS:
                for panel in dashboard.panels:
                    values = [
                        float(r["value"][1]) for t in panel.targets for r in _query(prom, t.expr)
                    ]
                    if not any(math.isfinite(v) for v in values):
                        missing.append(f"{dashboard.uid}/{panel.title}")
            if haproxy_targets and not _query(
                prom, 'haproxy_process_uptime_seconds{job="haproxy"}'
            ):
                missing.append("haproxy exporter (job haproxy)")
            if not missing:
                break
            time.sleep(3)
        assert not missing, f"panels without data: {missing}"
    finally:
        stop.set()
        sender.join(timeout=60)
        prometheus.terminate()
        prometheus.wait(timeout=30)
        serve.delete("dash-embed")
        serve.delete("dash-generate")
