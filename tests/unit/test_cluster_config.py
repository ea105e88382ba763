"""cluster.yaml and the serve configs: valid for Ray, and placing models where they say."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_validates_against_rays_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    # prepare_config fills in the provider's defaults as `ray up` does, then validates.
    validate_config(prepare_config(copy.deepcopy(config)))


def test_schema_validation_would_catch_a_broken_cluster_yaml() -> None:
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["available_node_types"]["gpu_worker"]["resources"] = "one GPU please"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("name", ["serve.yaml", "serve-gpu.yaml"])
def test_serve_configs_validate_against_serves_schema_and_our_args(name: str) -> None:
    import importlib

    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / name).read_text())
    ServeDeploySchema.model_validate(config)
    for app in config["applications"]:
        module_name, _ = app["import_path"].split(":")
        module = importlib.import_module(module_name)
        args_model = next(
            obj for key, obj in vars(module).items() if key.endswith("Args") and key != "Args"
        )
        args_model.model_validate(app.get("args", {}))


def test_gpu_config_puts_every_model_on_gpu_nodes() -> None:
    config = yaml.safe_load((ROOT / "serve-gpu.yaml").read_text())
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    gpu_resources = cluster["available_node_types"]["gpu_worker"]["resources"]
    models = 0
    for app in config["applications"]:
        for key, section in app.get("args", {}).items():
            if isinstance(section, dict) and "replica" in section:
                replica = section["replica"]
                assert replica.get("num_gpus", 0) > 0, f"{app['name']}.{key} asks for no GPU"
                for resource in replica.get("resources", {}):
                    assert resource in gpu_resources, f"{resource} is on no GPU node type"
                models += 1
    assert models >= 2


def test_gpu_config_pins_the_retriever_to_the_one_head_node() -> None:
    # Its index lives on one node's disk; a retriever scheduled anywhere else opens it empty.
    config = yaml.safe_load((ROOT / "serve-gpu.yaml").read_text())
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    (search,) = [app for app in config["applications"] if "retriever" in app.get("args", {})]
    pinned = search["args"]["retriever"].get("resources", {})
    holders = [name for name, t in types.items() if set(pinned) <= set(t.get("resources", {}))]
    assert pinned and holders == [cluster["head_node_type"]], holders


# Closed to strangers, and real GPU generation (issue 24, points 1 and 3).


def _cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def _start_commands(cluster: dict) -> list[str]:
    commands = cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    starts = [c for c in commands if "ray start" in c]
    assert len(starts) == 2, commands  # one for the head, one for the workers
    return starts


def test_every_node_starts_ray_with_token_auth() -> None:
    text = (ROOT / "cluster.yaml").read_text()
    assert "RAY_AUTH_MODE=disabled" not in text  # not even in a comment's example
    for command in _start_commands(_cluster()):
        before_start = command.split("ray start")[0]
        assert "RAY_AUTH_MODE=token" in before_start, command


def test_the_token_reaches_every_node_where_ray_reads_it() -> None:
    # `ray start` with RAY_AUTH_MODE=token reads ~/.ray/auth_token (Ray's default token path)
    # and refuses to start without one; the launcher copies file_mounts to every node.
    mounts = _cluster()["file_mounts"]
    assert mounts.get("~/.ray/auth_token") == "~/.ray/auth_token"


def test_the_dashboard_and_job_api_stay_on_loopback() -> None:
    head = next(c for c in _start_commands(_cluster()) if "--head" in c)
    assert "--dashboard-host=127.0.0.1" in head
    # The one wildcard: HAProxy's exporter, for the cluster's Prometheus (docs/ingress.md).
    commands = " ".join(_start_commands(_cluster())).replace("--metrics-host 0.0.0.0", "")
    assert "0.0.0.0" not in commands


def test_serve_api_keys_reach_every_ingress() -> None:
    cluster = _cluster()
    for command in _start_commands(cluster):
        assert "CARPOOL_API_KEYS_FILE=$HOME/.carpool/api_keys" in command, command
    assert cluster["file_mounts"].get("~/.carpool/api_keys") == "~/.carpool/api_keys"


def _make_target(name: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}:"))
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        body.append(line.strip())
    return body


def test_gpu_nodes_run_the_image_with_vllms_cuda_build() -> None:
    """Every node runs the Dockerfile's image (vLLM's CUDA build, models prepared); setup
    installs nothing, so a new GPU worker pulls the image and starts (issue 43, point 7)."""
    cluster = _cluster()
    dockerfile = (ROOT / "Dockerfile").read_text()
    image = cluster["docker"]["image"]
    assert f"docker build -t {image} ." in dockerfile
    assert re.search(r"pip install [^\n]*-e '\.\[vllm,models,cluster\]'", dockerfile)
    assert "python -m carpool.prepare serve-gpu.yaml" in dockerfile
    setup = (
        cluster.get("initialization_commands", [])
        + cluster["setup_commands"]
        + cluster["head_setup_commands"]
        + cluster["worker_setup_commands"]
    )
    for command in setup:
        for builds in ("pip install", "make ", "apt-get install", "carpool.prepare"):
            assert builds not in command, f"a node builds itself on start: {command}"
    # Ray and the replicas' Python are the image's.
    assert not any(".venv" in c for c in _start_commands(cluster))


def test_make_gpu_node_installs_vllms_cuda_build_and_no_dev_extras() -> None:
    makefile = (ROOT / "Makefile").read_text()
    phony = next(line for line in makefile.splitlines() if line.startswith(".PHONY:"))
    assert "gpu-node" in phony.split()
    # Not `install`: its recipe installs the `dev` extras (schemathesis, LangChain, ...).
    prerequisites = makefile.split("\ngpu-node:", 1)[1].split("\n", 1)[0].split()
    assert "install" not in prerequisites, prerequisites
    assert prerequisites == ["$(GPU_INSTALLED)"], prerequisites
    recipe = _make_target("gpu-node") + _make_target("$(GPU_INSTALLED)")
    pip_lines = [line for line in recipe if "pip install" in line]
    assert any("-e '.[vllm,models,cluster]'" in line for line in pip_lines), pip_lines
    assert not any("dev" in line.split("pip install", 1)[1] for line in pip_lines), pip_lines
    assert any("carpool.prepare serve-gpu.yaml" in line for line in recipe), recipe
    assert not any("vllm-venv" in line or "VLLM_PY" in line for line in recipe), recipe


def test_every_node_runs_the_python_vllm_needs() -> None:
    """cluster.yaml's nodes run the Dockerfile's image, whose Python vLLM installs on."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"docker build -t {_cluster()['docker']['image']} ." in dockerfile
    base = dockerfile.split("\nFROM ", 1)[1].split()[0]
    match = re.search(r"-py3(\d+)-", base)
    assert match and int(match.group(1)) >= 11  # vllm==0.32.0 requires Python >= 3.11


def _bound_deployments(app: object) -> list[object]:
    """Every deployment an application binds, its children included (Serve's own objects)."""
    from ray.serve.deployment import Application

    found, todo = [], [app]
    while todo:
        bound = todo.pop()._bound_deployment  # type: ignore[attr-defined]
        found.append(bound)
        args = [*bound.init_args, *bound.init_kwargs.values()]
        todo.extend(a for a in args if isinstance(a, Application))
    return found


def _head_units_asked(config: dict, resource: str) -> float:
    """Units of `resource` serve-gpu.yaml's apps take as deployed: replicas x their share,
    plus the deployment-scoped actors each replica set declares."""
    import importlib

    from carpool_twin.topology import replica_count

    total = 0.0
    for app in config["applications"]:
        module_name, attr = app["import_path"].split(":")
        built = getattr(importlib.import_module(module_name), attr)(app.get("args", {}))
        overrides = {d["name"]: d for d in app.get("deployments", [])}
        for deployment in _bound_deployments(built):
            options = deployment._deployment_config  # type: ignore[attr-defined]
            actor_options = deployment.ray_actor_options or {}  # type: ignore[attr-defined]
            share = (actor_options.get("resources") or {}).get(resource, 0.0)
            if share:
                override = overrides.get(deployment.name, {})  # type: ignore[attr-defined]
                total += share * replica_count(override)
            for actor in getattr(options, "deployment_actors", None) or []:
                total += (actor.actor_options.get("resources") or {}).get(resource, 0.0)
    return total


def test_the_gpu_configs_ingress_tier_fits_the_head_as_deployed() -> None:
    # Every ingress asks for one carpool_ingress, and the head offers 8: at min_workers the
    # apps must start on the head alone (an ingress_cpu node is for load, not for starting).
    # The router's length-predictor actor once took a whole unit here, so generate stayed
    # DEPLOYING on a packed head (the cluster tier caught it).
    config = yaml.safe_load((ROOT / "serve-gpu.yaml").read_text())
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    offered = cluster["available_node_types"]["head"]["resources"]["carpool_ingress"]
    asked = _head_units_asked(config, "carpool_ingress")
    assert 0 < asked <= offered, (
        f"serve-gpu.yaml asks {asked} carpool_ingress; the head has {offered}"
    )


def test_the_predictor_actor_follows_its_hosts_without_taking_a_unit() -> None:
    from router.deployment import actor_resources

    assert actor_resources({"carpool_ingress": 1, "carpool_gpu_node": 0.005}) == {
        "carpool_ingress": 0.01,
        "carpool_gpu_node": 0.005,
    }
    assert actor_resources(None) == {}
