"""carpool's HAProxy wrapper against the config Ray 2.60 really generates (no Ray cluster).

The config is rendered from Ray's own template with Ray's own ``HAProxyConfig`` defaults, so a
Ray upgrade that moves a bind shows up here; the hardened text is then checked by the real
HAProxy binary (``haproxy -c``), so a rewrite that breaks the syntax fails here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from carpool import haproxy


def ray_generated_config() -> str:
    jinja2 = pytest.importorskip("jinja2")
    from ray.serve._private.haproxy import HAProxyConfig
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    env = jinja2.Environment()
    env.filters["haproxy_fmt"] = lambda v: str(v)
    cfg = HAProxyConfig(socket_path="/tmp/carpool-test/admin.sock", metrics_enabled=False)
    # Ray ends the file with a newline (HAProxy refuses one without).
    return (
        "\n"
        + env.from_string(HAPROXY_CONFIG_TEMPLATE)
        .render(
            config=cfg,
            backends=[],
            grpc_backends=[],
            backends_with_health_config=[],
            route_info=cfg.build_health_route_info([]),
        )
        .strip("\n")
        + "\n"
    )


def binds(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^\s*bind\s+(\S+)", text, flags=re.M)]


def test_ray_template_opens_what_the_wrapper_closes() -> None:
    raw = ray_generated_config()
    # If Ray ever stops binding these everywhere, this test says so (and the wrapper's
    # reason to exist should be re-read).
    assert any(b.startswith(("*:", ":")) for b in binds(raw)), binds(raw)
    assert re.search(r"stats socket \S+ mode 666", raw)


def test_hardened_config_binds_only_the_given_hosts() -> None:
    hardened = haproxy.harden_config(ray_generated_config())
    addresses = binds(hardened)
    assert addresses, "no bind lines at all"
    assert not [b for b in addresses if b.startswith(("*:", ":", "0.0.0.0:"))], addresses
    assert "127.0.0.1:8404" in addresses  # stats page
    assert "127.0.0.1:9101" in addresses  # Prometheus exporter
    assert re.search(r"stats socket \S+ mode 600 level admin", hardened)
    assert "mode 666" not in hardened
    # A client's close must reach the server (tests/integration/test_haproxy_ingress.py).
    assert "splice-request" in ray_generated_config()
    assert "splice-request" not in hardened
    assert "splice-response" in hardened


def test_cluster_exporter_host_is_separate_from_the_stats_page() -> None:
    hardened = haproxy.harden_config(ray_generated_config(), metrics_host="0.0.0.0")
    assert "0.0.0.0:9101" in binds(hardened)  # Prometheus on other nodes scrapes it
    assert "127.0.0.1:8404" in binds(hardened)  # the unauthenticated page stays local


def test_ipv6_hosts_are_bracketed() -> None:
    hardened = haproxy.harden_config("listen stats\n  bind *:8404\n", stats_host="::1")
    assert binds(hardened) == ["[::1]:8404"]


def test_explicit_binds_are_left_alone() -> None:
    text = "frontend http_frontend\n    bind 10.0.0.5:8000\n"
    assert haproxy.harden_config(text) == text


def test_header_room_is_added_once() -> None:
    once = haproxy.harden_config(ray_generated_config())
    assert once.count(f"tune.http.maxhdr {haproxy.MAX_HEADERS}") == 1
    assert haproxy.harden_config(once) == once


def test_real_haproxy_accepts_the_hardened_config(tmp_path: Path) -> None:
    text = ray_generated_config().replace("/tmp/carpool-test", str(tmp_path))
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    env = {**os.environ, haproxy.STATS_HOST_VAR: "127.0.0.1"}
    env.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    # Through the wrapper as Ray runs it: rewrite in place, then exec the real binary.
    proc = subprocess.run(
        [sys.executable, "-c", "from carpool.haproxy import main; main()", "-c", "-f", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "127.0.0.1:8404" in binds(cfg.read_text())
    assert "tune.http.maxhdr" in cfg.read_text()


def test_wrapper_never_resolves_to_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(haproxy.REAL_BINARY_VAR, raising=False)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", haproxy.wrapper_path())
    binary = haproxy.real_binary()
    assert Path(binary).name != haproxy.WRAPPER_NAME
    assert os.access(binary, os.X_OK)
    # and the caller's environment is as it was
    assert os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] == haproxy.wrapper_path()


def test_environment_and_opt_out() -> None:
    env = haproxy.ray_environment(stats_port=18404, metrics_port=19101)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"]).name == haproxy.WRAPPER_NAME
    assert int(env["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"]) >= 3600
    assert int(env["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"]) >= 64 * 1024
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert haproxy.ray_environment(enabled=False) == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}


def test_env_command_prints_shell_exports() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "carpool.haproxy", "env", "--metrics-host", "0.0.0.0"],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "RAY_SERVE_ENABLE_HA_PROXY"},
    ).stdout
    assert "export RAY_SERVE_ENABLE_HA_PROXY=1" in out
    assert "export CARPOOL_HAPROXY_METRICS_HOST=0.0.0.0" in out
    off = subprocess.run(
        [sys.executable, "-m", "carpool.haproxy", "env"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "0"},
    ).stdout
    assert off.strip() == "export RAY_SERVE_ENABLE_HA_PROXY=0"


ROOT = Path(__file__).resolve().parents[2]


def start_environment(command: str) -> dict[str, str]:
    """The environment a cluster.yaml start command gives `ray start`, by running everything
    before it (with this venv's Python standing in for the image's `python`)."""
    before, sep, _ = command.partition("ray start")
    assert sep, command
    script = (
        before.replace("python -m carpool", f"{sys.executable} -m carpool")
        .replace("python -m pipelines", f"{sys.executable} -m pipelines")
        .replace("~/carpool/", f"{ROOT}/")  # file_mounts' copy of this checkout
        + " env -0"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_SERVE", "CARPOOL_"))}
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, check=True, env=env, cwd=ROOT
    ).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_every_cluster_yaml_node_starts_ray_with_the_haproxy_ingress(key: str) -> None:
    import yaml

    commands = yaml.safe_load((ROOT / "cluster.yaml").read_text())[key]
    env = start_environment(next(c for c in commands if "ray start" in c))
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"]).name == haproxy.WRAPPER_NAME
    assert env[haproxy.STATS_HOST_VAR] == "127.0.0.1"
    assert env[haproxy.METRICS_HOST_VAR] == "0.0.0.0"  # the cluster's Prometheus scrapes it
    assert env["RAY_AUTH_MODE"] == "token"
    # serve-gpu.yaml's direct routes: /v1 requests naming a pipeline's model skip /v1's hop
    routes = {r.path: r.target for r in haproxy.load_routes(env[haproxy.DIRECT_ROUTES_VAR])}
    assert routes["/v1/embeddings"] == "/embed/v1/embeddings"
    assert routes["/v1/chat/completions"] == "/generate/v1/chat/completions"


@pytest.mark.parametrize("manifest", ["rayservice.yaml", "rayservice-gpu.yaml"])
def test_every_kuberay_container_runs_the_haproxy_ingress(manifest: str) -> None:
    import yaml

    doc = yaml.safe_load((ROOT / "docs" / "kuberay" / manifest).read_text())
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    containers = [c for g in groups for c in g["template"]["spec"]["containers"]]
    assert containers
    for container in containers:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1", container["name"]
        assert env[haproxy.STATS_HOST_VAR] == "127.0.0.1"
        assert env["RAY_SERVE_HAPROXY_BINARY_PATH"].endswith("/" + haproxy.WRAPPER_NAME)


def test_make_serve_starts_ray_with_the_haproxy_ingress() -> None:
    out = subprocess.run(
        ["make", "-n", "serve", "-o", "models"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    serve_line = next(line for line in out.splitlines() if "serve run" in line)
    assert "carpool.haproxy env" in serve_line
    # ... with serve.yaml's direct routes, from the same Python
    assert "pipelines.direct_routes serve.yaml" in serve_line
    before = serve_line.split(" && ")[0]
    env_out = subprocess.run(
        ["bash", "-c", f"{before}; env -0"], capture_output=True, check=True, cwd=ROOT
    ).stdout.decode()
    env = dict(item.split("=", 1) for item in env_out.split("\0") if "=" in item)
    targets = [r.target for r in haproxy.load_routes(env[haproxy.DIRECT_ROUTES_VAR])]
    assert "/embed/v1/embeddings" in targets
