"""The KubeRay RayService manifest (docs/kuberay/rayservice.yaml) deploys serve.yaml (issue 15).

The manifest is generated; these tests fail when serve.yaml changes and the manifest is not
regenerated, when someone edits the manifest by hand, or when its Serve config is one Ray
Serve would refuse. No Ray cluster: Ray's own config schema validates it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "docs" / "kuberay" / "rayservice.yaml"


def _generator() -> ModuleType:
    path = ROOT / "docs" / "kuberay" / "make_rayservice.py"
    spec = importlib.util.spec_from_file_location("make_rayservice", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


@pytest.fixture(scope="module")
def serve_config(manifest: dict[str, Any]) -> dict[str, Any]:
    text = manifest["spec"]["serveConfigV2"]
    assert isinstance(text, str), "KubeRay takes serveConfigV2 as a YAML string"
    return yaml.safe_load(text)


def test_the_manifest_serves_exactly_serve_yamls_applications(
    serve_config: dict[str, Any],
) -> None:
    local = yaml.safe_load((ROOT / "serve.yaml").read_text())
    assert serve_config["applications"] == local["applications"], (
        "serve.yaml and docs/kuberay/rayservice.yaml drifted apart; run "
        ".venv/bin/python docs/kuberay/make_rayservice.py"
    )


def test_the_manifest_is_what_the_generator_writes() -> None:
    generator = _generator()
    assert MANIFEST.read_text() == generator.render((ROOT / "serve.yaml").read_text()), (
        "docs/kuberay/rayservice.yaml was edited by hand or is stale; change "
        "make_rayservice.py or serve.yaml and run it"
    )


def test_the_generator_notices_a_serve_yaml_without_applications() -> None:
    with pytest.raises(ValueError, match="applications"):
        _generator().render("proxy_location: HeadOnly\n")


def test_ray_serve_accepts_the_serve_config(serve_config: dict[str, Any]) -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    assert {app.name for app in schema.applications} == {
        "embed",
        "rank",
        "search",
        "generate",
        "rag",
        "openai",
    }
    # Reachable from a Kubernetes Service: not serve.yaml's 127.0.0.1.
    assert schema.http_options.host == "0.0.0.0"
    assert schema.http_options.port == 8000


def test_the_cluster_runs_the_pinned_ray(manifest: dict[str, Any]) -> None:
    import ray

    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"ray[serve]=={cluster["rayVersion"]}"' in pyproject


def test_the_pods_are_well_formed(manifest: dict[str, Any]) -> None:
    cluster = manifest["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    groups = [head, *cluster["workerGroupSpecs"]]
    for group in groups:
        # KubeRay passes these to `ray start` as strings; a number is rejected by the CRD.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        containers = group["template"]["spec"]["containers"]
        assert len(containers) == 1 and containers[0]["image"]
        requests = containers[0]["resources"]["requests"]
        assert float(requests["cpu"]) >= float(group["rayStartParams"]["num-cpus"])
    ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert ports["serve"] == 8000 and ports["dashboard"] == 8265 and ports["gcs-server"] == 6379
    for worker in cluster["workerGroupSpecs"]:
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]


def test_serve_yaml_fits_the_head_pod(
    serve_config: dict[str, Any], manifest: dict[str, Any]
) -> None:
    """Every replica's CPU reservation fits the head's CPUs, so the apps start without workers."""

    def cpus(node: Any) -> float:
        # Reservations are num_cpus blocks in the apps' args, one replica each.
        if isinstance(node, dict):
            own = node.get("num_cpus")
            total = own if isinstance(own, int | float) else 0.0
            return total + sum(cpus(v) for k, v in node.items() if k != "num_cpus")
        if isinstance(node, list):
            return sum(cpus(v) for v in node)
        return 0.0

    def extra_replicas(app: dict[str, Any]) -> float:
        # Replica counts are Serve's own deployments[] field: each replica past the first
        # reserves its deployment's num_cpus again (an ingress's block is args.ingress).
        extra = 0.0
        for entry in app.get("deployments") or []:
            count = entry.get("num_replicas", 1)
            autoscaling = entry.get("autoscaling_config") or {}
            count = max(
                count,
                autoscaling.get("initial_replicas") or 0,
                autoscaling.get("min_replicas") or 0,
            )
            block_key = "ingress" if entry["name"].endswith("_ingress") else entry["name"]
            block = app["args"][block_key]
            block = block.get("replica", block)
            extra += (count - 1) * block["num_cpus"]
        return extra

    apps = serve_config["applications"]
    reserved = cpus(apps) + sum(extra_replicas(app) for app in apps)
    assert cpus(apps) > 1  # the walk found the reservations
    assert any(extra_replicas(app) > 0 for app in apps)  # and a deployment with two replicas
    head_cpus = float(
        manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"]
    )
    assert reserved <= head_cpus
