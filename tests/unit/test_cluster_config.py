"""cluster.yaml and the serve configs: valid for Ray, and placing models where they say."""

from __future__ import annotations

import copy
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
