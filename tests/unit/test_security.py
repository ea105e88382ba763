"""Security properties that are easy to lose in a refactor: exposure, CORS, secrets, eval."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVING_CODE = ("carpool", "deployments", "pipelines", "router", "dashboards")
PIPELINES = ("embed", "rank", "search", "rag", "generate", "openai_api")

# Shapes of real credentials; a match in a tracked file is a leaked secret.
SECRET_PATTERNS = {
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "AWS access key": re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    "OpenAI key": re.compile(r"\bsk-[A-Za-z0-9_-]{32,}"),
    "GitHub token": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36}\b"),
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{34}\b"),
    "Grafana token": re.compile(r"\bglsa_[A-Za-z0-9]{32}_[0-9a-f]{8}\b"),
    "Slack token": re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"),
}


def _tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    if not out:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def test_no_credentials_are_committed() -> None:
    leaks = []
    for path in _tracked_files():
        if path.stat().st_size > 5_000_000:
            continue
        text = path.read_text(errors="ignore")
        for what, pattern in SECRET_PATTERNS.items():
            if pattern.search(text):
                leaks.append(f"{path.relative_to(ROOT)}: {what}")
    assert not leaks, f"remove these secrets and rotate them: {leaks}"


def test_the_secret_scan_finds_a_planted_key() -> None:
    planted = "token = " + "sk-" + "a1B2" * 10
    assert SECRET_PATTERNS["OpenAI key"].search(planted)


def test_default_serve_config_listens_on_loopback_only() -> None:
    config = yaml.safe_load((ROOT / "serve.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"


def test_prometheus_from_make_monitor_listens_on_loopback_only() -> None:
    source = (ROOT / "dashboards" / "monitor.py").read_text()
    assert "--web.listen-address=127.0.0.1:" in source


@pytest.mark.parametrize("name", PIPELINES)
def test_no_pipeline_enables_cors(name: str) -> None:
    from tests.factories import pipeline_api

    api = pipeline_api(name)
    middleware = [m.cls.__name__ for m in api.user_middleware]
    assert "CORSMiddleware" not in middleware
    # Auth runs first, so an unauthenticated body is never read.
    assert middleware[0] == "ApiKeyAuth", middleware


def test_serving_code_never_unpickles_or_evaluates() -> None:
    risky = re.compile(r"pickle\.loads?\(|(?<![.\w])eval\(|(?<![.\w])exec\(|allow_pickle=True")
    found = []
    for folder in SERVING_CODE:
        for path in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if risky.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, found
