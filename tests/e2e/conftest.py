"""The e2e tier: every application of the default serve config, deployed once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import deploy_declaratively

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "serve.yaml"


@pytest.fixture(scope="session")
def default_apps(serve_http: str) -> Iterator[str]:
    """Deploys serve.yaml's applications as `serve run serve.yaml` would; yields the base URL.

    The session's Serve listens on a free port instead of the file's :8000, so a running
    `make serve` does not collide with the tests.
    """
    from ray import serve

    config = yaml.safe_load(SERVE_CONFIG.read_text())
    applications = config["applications"]
    deploy_declaratively(applications)
    yield serve_http
    for app in applications:
        serve.delete(app["name"])
