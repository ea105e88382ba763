"""The e2e tier: every application of the default serve config, deployed once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import deploy_declaratively

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "serve.yaml"


def default_applications(index_dir: Path) -> list[dict]:
    """serve.yaml's applications, with indexes in ``index_dir`` (not the user's cache)."""
    applications = yaml.safe_load(SERVE_CONFIG.read_text())["applications"]
    for app in applications:
        if "retriever" in app.get("args", {}):
            app["args"]["retriever"]["index_dir"] = str(index_dir / app["name"])
    return applications


@pytest.fixture(scope="session")
def e2e_index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e-index")


@pytest.fixture(scope="session")
def default_apps(serve_http: str, e2e_index_dir: Path) -> Iterator[str]:
    """Deploys serve.yaml's applications as `serve run serve.yaml` would; yields the base URL.

    The session's Serve listens on a free port instead of the file's :8000, so a running
    `make serve` does not collide with the tests.
    """
    from ray import serve

    applications = default_applications(e2e_index_dir)
    deploy_declaratively(applications)
    yield serve_http
    for app in applications:
        serve.delete(app["name"])
