"""The one-box Ray's environment (carpool/local_ray.py): token auth with an owner-only token,
loopback, and a taken HTTP port named before Ray starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from carpool import local_ray


def test_the_token_is_created_once_owner_only(tmp_path: Path) -> None:
    path = local_ray.ensure_token(tmp_path / "ray" / "auth_token")
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, as Ray's generator
    assert path.stat().st_mode & 0o777 == 0o600
    assert local_ray.ensure_token(path).read_text() == token  # kept, never replaced


def test_a_token_ray_left_world_readable_is_narrowed_to_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "auth_token"
    path.write_text("a" * 64)
    path.chmod(0o644)  # what Ray's own writer leaves
    local_ray.ensure_token(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text() == "a" * 64


def test_an_empty_token_file_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "auth_token"
    path.write_text("")
    with pytest.raises(ValueError, match="delete it"):
        local_ray.ensure_token(path)


def test_token_auth_and_loopback_by_default(tmp_path: Path) -> None:
    token = tmp_path / "token"
    env = local_ray.ray_environment({"RAY_AUTH_TOKEN_PATH": str(token)})
    assert env == {
        "RAY_AUTH_MODE": "token",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    assert token.exists()


def test_the_callers_choice_to_turn_auth_off_is_kept_and_creates_no_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    env = local_ray.ray_environment(
        {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN_PATH": str(token)}
    )
    assert env["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN_PATH" not in env
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # still loopback
    assert not token.exists()


def test_the_default_token_path_is_rays(tmp_path: Path) -> None:
    assert local_ray.token_path({}) == Path.home() / ".ray" / "auth_token"
    assert local_ray.token_path({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "t")}) == tmp_path / "t"


def test_a_taken_http_port_is_named_with_its_holder_and_how_to_clear_it() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        (problem,) = local_ray.preflight([port])
    assert f"127.0.0.1:{port}" in problem and f"pid {os.getpid()}" in problem
    assert "make stop" in problem
    assert local_ray.preflight([port]) == []  # free again once closed


def _cli(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "carpool.local_ray", "env", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


def test_the_cli_prints_exports_and_warns_when_auth_is_off(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "serve.yaml"
    config.write_text(f"http_options: {{host: 127.0.0.1, port: {port}}}\napplications: []\n")
    token = tmp_path / "token"
    done = _cli(config, {"RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_MODE": ""})
    assert done.returncode == 0, done.stderr
    assert "export RAY_AUTH_MODE=token" in done.stdout and token.exists()
    done = _cli(config, {"RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0 and "export RAY_AUTH_MODE=disabled" in done.stdout
    assert "WARNING" in done.stderr and "run shell commands" in done.stderr


def test_the_cli_refuses_at_once_when_the_http_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        config = tmp_path / "serve.yaml"
        config.write_text(f"http_options: {{port: {holder.getsockname()[1]}}}\n")
        done = _cli(config, {})
    assert done.returncode == 2 and done.stdout == ""
    assert "cannot start its own Ray" in done.stderr and "make stop" in done.stderr


def test_make_serve_runs_its_own_ray_with_this_environment() -> None:
    """The Makefile's serve recipe: token auth by default, the env above, `--address local`
    (never the address a stopped head left in ray_current_cluster)."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "export RAY_AUTH_MODE ?= token" in makefile
    recipe = makefile.split("\nserve: ", 1)[1].split("\n\n", 1)[0]
    assert "$(LOCAL_RAY_ENV)" in recipe
    assert "serve run --address local $(SERVE_CONFIG)" in recipe
    assert "carpool.local_ray env $(SERVE_CONFIG)" in makefile
    assert "SERVE_CONFIG ?= serve.yaml" in makefile
