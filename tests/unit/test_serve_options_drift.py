"""The shipped serve configs: every model's Serve options fit the knobs it runs with.

``build_*`` derives ``max_ongoing_requests`` and ``max_queued_requests`` from the ``args``
batching knobs (Serve gives an app builder nothing else), while Serve applies the
``deployments[].user_config`` knobs to the running replica; a config that raises the knobs
there must raise those options beside them. Autoscaling must aim at what a replica runs at
once: serve-gpu.yaml's generators once autoscaled at 16 ongoing requests while running 64
sequences; carpool.autoscaling's policy follows the knobs in force instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.autoscaling import POLICY
from deployments.embedder import EmbedderConfig
from deployments.generator import GeneratorConfig
from deployments.ranker import RankerConfig

ROOT = Path(__file__).resolve().parents[2]
# args key of a model -> its config class; the deployment carries the same name except
# where noted.
MODELS: dict[str, tuple[type, str]] = {
    "embedder": (EmbedderConfig, "embedder"),
    "ranker": (RankerConfig, "ranker"),
    "small": (GeneratorConfig, "small"),
    "large": (GeneratorConfig, "large"),
}


def model_deployments(path: Path) -> list[tuple[str, str, Any, dict[str, Any]]]:
    """(app, deployment, parsed args config, its deployments[] entry) of every model."""
    found = []
    for app in yaml.safe_load(path.read_text())["applications"]:
        entries = {d["name"]: d for d in app.get("deployments", [])}
        for key, (config_cls, deployment) in MODELS.items():
            if key in app.get("args", {}):
                config = config_cls.model_validate(app["args"][key])
                found.append((app["name"], deployment, config, entries.get(deployment, {})))
    return found


SERVE_FIELDS = ("max_ongoing_requests", "max_queued_requests")


def serve_options(config: Any, deployment: str, batching: Any) -> dict[str, Any]:
    """The Serve options ``build_*`` derives for ``config`` run with ``batching``."""
    if isinstance(config, GeneratorConfig):
        return config.model_copy(update={"batching": batching}).serve_options(deployment)
    return config.replica.serve_options(deployment, batching)


def in_force(config: Any, deployment: str, entry: dict[str, Any]) -> dict[str, Any]:
    """What Serve runs: options derived from ``args``, Serve's own fields of the
    deployments[] entry laid over them (as Serve's config override does)."""
    options = serve_options(config, deployment, config.batching)
    out = {k: options[k] for k in SERVE_FIELDS}
    out.update({k: entry[k] for k in SERVE_FIELDS if k in entry})
    return out


def applied_knobs(config: Any, entry: dict[str, Any]) -> Any:
    """The batching knobs the replica runs with: deployments[].user_config, else args'."""
    if entry.get("user_config"):
        return type(config.batching).model_validate(entry["user_config"])
    return config.batching


def capacity(knobs: Any) -> int:
    """Requests one replica runs at once under ``knobs`` (what it reports to autoscaling)."""
    return getattr(knobs, "max_num_seqs", None) or knobs.max_batch_size


def drift_problems(config_file: Path) -> list[str]:
    problems = []
    for app, deployment, config, entry in model_deployments(config_file):
        knobs = applied_knobs(config, entry)
        wanted = serve_options(config, deployment, knobs)
        got = in_force(config, deployment, entry)
        for key in SERVE_FIELDS:
            if got[key] < wanted[key]:
                problems.append(
                    f"{app}/{deployment}: {key} {got[key]} is below the {wanted[key]} its "
                    f"user_config in force needs; set {key}: {wanted[key]} in its deployments[] "
                    "entry"
                )
        autoscaling = entry.get("autoscaling_config")
        if autoscaling:
            policy = (autoscaling.get("policy") or {}).get("policy_function")
            target = autoscaling.get("target_ongoing_requests")
            if policy != POLICY and (target is None or target < capacity(knobs)):
                problems.append(
                    f"{app}/{deployment}: autoscaling aims at {target or 2} ongoing requests "
                    f"per replica while one replica runs {capacity(knobs)} at once; use "
                    f"policy: {{policy_function: {POLICY}}}"
                )
    return problems


@pytest.mark.parametrize("config_file", ["serve.yaml", "serve-gpu.yaml"])
def test_every_models_serve_options_fit_the_knobs_in_force(config_file: str) -> None:
    assert model_deployments(ROOT / config_file), f"{config_file}: no model deployments found"
    assert not drift_problems(ROOT / config_file)


def test_the_check_sees_a_drift(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "serve-gpu.yaml").read_text())
    generate = next(a for a in config["applications"] if a["name"] == "generate")
    small = next(d for d in generate["deployments"] if d["name"] == "small")
    small["user_config"]["max_num_seqs"] = 128  # outgrows max_ongoing_requests 320
    small["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 4}  # Serve's target 2
    drifted = tmp_path / "serve.yaml"
    drifted.write_text(yaml.safe_dump(config))
    problems = "\n".join(drift_problems(drifted))
    assert "generate/small: max_ongoing_requests 320 is below the 384" in problems
    assert "generate/small: autoscaling aims at 2" in problems
