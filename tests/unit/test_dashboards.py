"""Dashboards: committed JSON matches the declarations, and panels read emitted metrics."""

from __future__ import annotations

import json

from carpool.generation.metrics import GENERATOR_METRICS
from carpool.metrics import BATCH_METRICS
from dashboards.__main__ import check
from dashboards.definitions import DASHBOARDS
from dashboards.monitor import prometheus_config
from dashboards.spec import metric_names, render
from router.deployment import ROUTER_METRICS

# Ray Serve's own series that the panels use (seen on a live 2.60 replica's metrics port).
RAY_SERVE_SERIES = {
    "ray_serve_num_http_requests_total",
    "ray_serve_http_request_latency_ms_bucket",
    "ray_serve_num_http_error_requests_total",
    "ray_serve_num_deployment_http_error_requests_total",
    "ray_serve_batch_wait_time_ms_bucket",
    "ray_serve_batch_execution_time_ms_bucket",
    "ray_serve_batches_processed_total",
    "ray_serve_batch_queue_length",
    "ray_serve_deployment_replica_healthy",
    "ray_serve_autoscaling_target_replicas",
    "ray_serve_num_ongoing_requests_at_replicas",
    "ray_serve_deployment_processing_latency_ms_bucket",
    "ray_serve_deployment_replica_starts_total",
}


def emitted_series() -> set[str]:
    names = set(RAY_SERVE_SERIES)
    for registry in (BATCH_METRICS, GENERATOR_METRICS, ROUTER_METRICS):
        for name, (kind, _, _) in registry.items():
            base = "ray_" + name
            if kind == "histogram":
                names |= {base + "_bucket", base + "_sum", base + "_count"}
            else:
                names.add(base)
    return names


def test_committed_json_matches_the_declarations() -> None:
    assert check() == 0, "run `python -m dashboards render` and commit dashboards/json"


def test_every_panel_reads_a_metric_the_code_emits() -> None:
    emitted = emitted_series()
    for dashboard in DASHBOARDS:
        for panel in dashboard.panels:
            for target in panel.targets:
                used = metric_names(target.expr)
                assert used, f"{dashboard.uid}/{panel.title}: no metric in {target.expr}"
                assert used <= emitted, f"{dashboard.uid}/{panel.title}: {used - emitted}"


def test_rendered_dashboards_are_grafana_shaped() -> None:
    uids = set()
    for dashboard in DASHBOARDS:
        body = render(dashboard)
        uids.add(body["uid"])
        assert body["panels"] and all(p["targets"] for p in body["panels"])
        for panel in body["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
    assert len(uids) == len(DASHBOARDS)


def test_prometheus_config_uses_rays_service_discovery_file() -> None:
    text = prometheus_config("/tmp/ray/prom_metrics_service_discovery.json")
    assert "file_sd_configs" in text and "prom_metrics_service_discovery.json" in text
    assert 'targets: ["127.0.0.1:1"]' in prometheus_config(static_targets=["127.0.0.1:1"])


class _FakeGrafana:
    """A local HTTP server answering like Grafana's /api/dashboards/db; records requests."""

    def __init__(self, token: str) -> None:
        import http.server
        import threading

        self.requests: list[dict] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
                ok = self.headers.get("Authorization") == f"Bearer {token}"
                uid = body["dashboard"]["uid"]
                answer = (
                    {"status": "success", "uid": uid, "url": f"/d/{uid}"}
                    if ok
                    else {"message": "invalid API key"}
                )
                data = json.dumps(answer).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_push_posts_every_dashboard_to_grafanas_api_with_the_token(monkeypatch, capsys) -> None:
    from dashboards.__main__ import push

    grafana = _FakeGrafana("sekret")
    try:
        monkeypatch.setenv("GRAFANA_URL", grafana.url + "/")
        monkeypatch.setenv("GRAFANA_TOKEN", "sekret")
        monkeypatch.delenv("CARPOOL_GRAFANA_CLIENT", raising=False)
        assert push() == 0
    finally:
        grafana.close()
    assert [r["path"] for r in grafana.requests] == ["/api/dashboards/db"] * len(DASHBOARDS)
    assert {r["auth"] for r in grafana.requests} == {"Bearer sekret"}
    sent = {r["body"]["dashboard"]["uid"]: r["body"] for r in grafana.requests}
    assert set(sent) == {d.uid for d in DASHBOARDS}
    for body in sent.values():
        assert body["overwrite"] is True and "version" not in body["dashboard"]
        assert body["dashboard"]["panels"]
    assert capsys.readouterr().out.count("success") == len(DASHBOARDS)


def test_push_with_a_bad_token_or_no_grafana_says_what_to_change(monkeypatch, capsys) -> None:
    from dashboards.__main__ import push

    grafana = _FakeGrafana("sekret")
    try:
        monkeypatch.setenv("GRAFANA_URL", grafana.url)
        monkeypatch.setenv("GRAFANA_TOKEN", "wrong")
        assert push() == 1
        assert "Editor role" in capsys.readouterr().err
    finally:
        grafana.close()
    monkeypatch.setenv("GRAFANA_URL", grafana.url)  # closed now: nothing listens
    assert push() == 1
    assert "check GRAFANA_URL" in capsys.readouterr().err
