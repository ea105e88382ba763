"""``python -m dashboards.monitor``: a real Prometheus on 127.0.0.1 scraping Ray's metrics.

Ray writes its scrape targets (every node's metrics agent) to a service-discovery file in its
temp dir; Prometheus follows that file, so nodes and restarts are picked up on their own.
The Ray dashboard finds this Prometheus through ``RAY_PROMETHEUS_HOST``, which `make serve`
exports when it starts Ray, so the dashboard's Metrics view works.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"


def prometheus_config(
    sd_file: str | None = None,
    static_targets: list[str] | None = None,
    scrape_interval_s: float = 5.0,
    haproxy_targets: list[str] | None = None,
) -> str:
    """A Prometheus config scraping Ray's metrics agents (file SD or fixed targets), and the
    HAProxy ingress's own exporter (``haproxy_*``: queues, connections, per-server state)."""
    lines = [
        "global:",
        f"  scrape_interval: {scrape_interval_s}s",
        f"  evaluation_interval: {scrape_interval_s}s",
        "scrape_configs:",
        "  - job_name: ray",
    ]
    if static_targets:
        lines += [
            "    static_configs:",
            "      - targets: [" + ", ".join(f'"{t}"' for t in static_targets) + "]",
        ]
    else:
        lines += ["    file_sd_configs:", f'      - files: ["{sd_file or DEFAULT_SD_FILE}"]']
    if haproxy_targets:
        lines += [
            "  - job_name: haproxy",
            "    static_configs:",
            "      - targets: [" + ", ".join(f'"{t}"' for t in haproxy_targets) + "]",
        ]
    return "\n".join(lines) + "\n"


def find_prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError(
            "no `prometheus` binary on PATH; install it (Debian/Ubuntu: apt-get install "
            "prometheus) or run `make monitor`, which does"
        )
    return binary


def start_prometheus(config_text: str, workdir: Path, port: int) -> subprocess.Popen[bytes]:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(config_text)
    return subprocess.Popen(
        [
            find_prometheus(),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=9090)
    parser.add_argument("--sd-file", default=DEFAULT_SD_FILE)
    # Ray's HAProxy ingress exports on this port (RAY_SERVE_HAPROXY_METRICS_PORT, carpool binds
    # it to 127.0.0.1 on one box: carpool/haproxy.py).
    exporter = os.environ.get("RAY_SERVE_HAPROXY_METRICS_PORT", "9101")
    parser.add_argument("--haproxy-target", action="append", default=[f"127.0.0.1:{exporter}"])
    parser.add_argument("--workdir", default=os.path.expanduser("~/.cache/carpool/prometheus"))
    args = parser.parse_args(argv)
    process = start_prometheus(
        prometheus_config(args.sd_file, haproxy_targets=args.haproxy_target),
        Path(args.workdir),
        args.port,
    )
    print(f"Prometheus on http://127.0.0.1:{args.port}, scraping targets in {args.sd_file}")
    print("Grafana: provision dashboards/provisioning/*.yaml, or `python -m dashboards push`")
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        return process.wait()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
