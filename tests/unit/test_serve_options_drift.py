"""The shipped serve configs: every model's Serve options follow the knobs it runs with.

Serve options (``max_ongoing_requests``, ``max_queued_requests``, the autoscaling target) are
derived in ``build_*`` from the model's ``args`` batching knobs, while Serve applies the
``deployments[].user_config`` knobs to the running replica. When the two disagree the
options are sized for knobs that are not in force (serve-gpu.yaml's generators once
autoscaled at 16 ongoing requests while running 64 sequences), so the files must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

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


SERVE_FIELDS = ("max_ongoing_requests", "max_queued_requests", "num_replicas")


def serve_options(config: Any, deployment: str, batching: Any) -> dict[str, Any]:
    """The Serve options ``build_*`` derives for ``config`` run with ``batching``."""
    if isinstance(config, GeneratorConfig):
        return config.model_copy(update={"batching": batching}).serve_options(deployment)
    return config.replica.serve_options(deployment, batching)


def effective(options: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """``options`` with Serve's own fields of the deployments[] entry laid over them."""
    out = {k: v for k, v in options.items() if k in (*SERVE_FIELDS, "autoscaling_config")}
    out.update({k: entry[k] for k in SERVE_FIELDS if k in entry})
    if "autoscaling_config" in entry:
        out["autoscaling_config"] = {
            **out.get("autoscaling_config", {}),
            **entry["autoscaling_config"],
        }
    return out


@pytest.mark.parametrize("config_file", ["serve.yaml", "serve-gpu.yaml"])
def test_every_models_serve_options_follow_the_knobs_in_force(config_file: str) -> None:
    rows = model_deployments(ROOT / config_file)
    assert rows, f"{config_file}: no model deployments found"
    problems = []
    for app, deployment, config, entry in rows:
        applied = type(config.batching).model_validate(entry.get("user_config") or {})
        if not entry.get("user_config"):
            applied = config.batching  # no user_config: the args knobs are what runs
        built = effective(serve_options(config, deployment, config.batching), entry)
        wanted = effective(serve_options(config, deployment, applied), entry)
        if built != wanted:
            problems.append(
                f"{app}/{deployment}: Serve options {built} come from args batching, but the "
                f"knobs in force (deployments[].user_config) call for {wanted}: give args."
                f"{deployment}.batching the same sizes, or set those options in deployments[]"
            )
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_drift() -> None:
    embedder = EmbedderConfig.model_validate({"batching": {"max_batch_size": 8}})
    applied = type(embedder.batching).model_validate({"max_batch_size": 64})
    assert serve_options(embedder, "e", embedder.batching) != serve_options(embedder, "e", applied)
    # Serve's own field in deployments[] settles it whatever the knobs.
    entry = {"max_ongoing_requests": 100, "max_queued_requests": 100}
    assert effective(serve_options(embedder, "e", embedder.batching), entry) == effective(
        serve_options(embedder, "e", applied), entry
    )
