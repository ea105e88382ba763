"""Every shipped cluster config (serve-gpu.yaml, the KubeRay manifests) keeps carpool's
single-box tricks off: no thread_policy idle_cores, no renicing Serve's proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.config import IngressConfig

ROOT = Path(__file__).resolve().parents[2]


def _serve_apps(path: Path) -> list[dict]:
    data = yaml.safe_load(path.read_text())
    if "applications" in data:
        return data["applications"]
    return yaml.safe_load(data["spec"]["serveConfigV2"])["applications"]


def _walk(node: Any, key: str) -> list[Any]:
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                found.append(v)
            found += _walk(v, key)
    elif isinstance(node, list):
        for v in node:
            found += _walk(v, key)
    return found


CLUSTER_CONFIGS = [
    ROOT / "serve-gpu.yaml",
    ROOT / "docs/kuberay/rayservice.yaml",
    ROOT / "docs/kuberay/rayservice-gpu.yaml",
]


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_cluster_configs_keep_single_box_tricks_off(path: Path) -> None:
    apps = _serve_apps(path)
    assert apps, f"{path} has no applications"
    assert "idle_cores" not in _walk(apps, "thread_policy"), f"{path}: idle_cores"
    assert not any(_walk(apps, "proxy_cpu_niceness")), f"{path}: renices Serve's proxy"


def test_renicing_serves_proxy_is_opt_in() -> None:
    assert IngressConfig().proxy_cpu_niceness == 0
