"""HAProxy's direct routes (``/v1`` requests naming one pipeline's model go to its prefix),
on a real HAProxy with the config Ray 2.60 generates for serve.yaml's apps (no Ray).

Each app's backend is a small HTTP server that answers with the path it was sent, so each
test reads where HAProxy put the request. The routes come from ``pipelines.direct_routes``
on the shipped serve.yaml, so a served name changed there is followed here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from carpool import haproxy
from pipelines.direct_routes import direct_routes, routes_of_file
from pipelines.embed import EmbedArgs, served_model_name

ROOT = Path(__file__).resolve().parents[2]
APPS = {"embed": "/embed", "generate": "/generate", "rank": "/rank", "openai": "/"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Echo(BaseHTTPRequestHandler):
    """Answers every request with the backend's name and the path it arrived at."""

    app = ""

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = json.dumps({"app": self.app, "path": self.path}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def ray_config(ports: dict[str, int], state: Path, frontend_port: int) -> str:
    """Ray's own template, rendered as Ray renders it, with one server per app."""
    jinja2 = pytest.importorskip("jinja2")
    from ray.serve._private.haproxy import BackendConfig, HAProxyConfig, ServerConfig
    from ray.serve._private.haproxy_templates import (
        HAPROXY_CONFIG_TEMPLATE,
        HAPROXY_HEALTHZ_RULES_TEMPLATE,
    )
    from ray.serve.config import HTTPOptions

    env = jinja2.Environment()
    env.filters["haproxy_fmt"] = lambda v: str(v)
    cfg = HAProxyConfig(
        socket_path=str(state / "admin.sock"),
        server_state_base=str(state),
        server_state_file=str(state / "server-state"),
        metrics_enabled=False,
        http_options=HTTPOptions(host="127.0.0.1", port=frontend_port),
        metrics_port=_free_port(),
        stats_port=_free_port(),
        bufsize=haproxy.BUFSIZE_BYTES,  # as carpool's environment sets it
        has_received_routes=True,
        has_received_servers=True,
    )
    backends = sorted(
        (
            BackendConfig(
                name=name,
                path_prefix=prefix,
                servers=[ServerConfig(name=f"{name}-0", host="127.0.0.1", port=ports[name])],
                app_name=name,
            )
            for name, prefix in APPS.items()
        ),
        key=lambda b: (-len(b.path_prefix), b.path_prefix),
    )
    info = cfg.build_health_route_info(backends)
    healthz = env.from_string(HAPROXY_HEALTHZ_RULES_TEMPLATE).render(
        config=cfg, backends=backends, health_info=info
    )
    text = env.from_string(HAPROXY_CONFIG_TEMPLATE).render(
        config=cfg,
        backends=backends,
        grpc_backends=[],
        backends_with_health_config=[
            {"backend": b, "health_config": b.build_health_check_config(cfg)} for b in backends
        ],
        healthz_rules=healthz,
        route_info=info,
    )
    return text.strip("\n") + "\n"


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real HAProxy (through carpool's wrapper) over echo backends; yields its base URL."""
    state = tmp_path_factory.mktemp("haproxy-routes")
    servers = []
    ports: dict[str, int] = {}
    for name in APPS:
        server = ThreadingHTTPServer(("127.0.0.1", 0), type(name, (Echo,), {"app": name}))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        ports[name] = server.server_address[1]
    port = _free_port()
    config = state / "haproxy.cfg"
    config.write_text(ray_config(ports, state, port))
    env = {
        **{k: v for k, v in os.environ.items() if k != "RAY_SERVE_HAPROXY_BINARY_PATH"},
        haproxy.DIRECT_ROUTES_VAR: haproxy.dump_routes(routes_of_file(ROOT / "serve.yaml")),
    }
    proc = subprocess.Popen(
        [haproxy.wrapper_path(), "-db", "-f", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{base}/embed/x", timeout=1)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(proc.stderr.read().decode() if proc.stderr else "") from None
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)
        for server in servers:
            server.shutdown()


def where(response: httpx.Response) -> tuple[str, str]:
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["app"], answer["path"]


EMBEDDER = routes_of_file(ROOT / "serve.yaml")[0].models[0]


def test_a_v1_embedding_naming_the_embedder_goes_to_the_embed_app(routed: str) -> None:
    sent = httpx.post(f"{routed}/v1/embeddings", json={"input": "hi", "model": EMBEDDER})
    assert where(sent) == ("embed", "/embed/v1/embeddings")
    # Any JSON spacing, the model first or last, a query string kept.
    spaced = httpx.post(
        f"{routed}/v1/embeddings?x=1",
        content=f'{{ "model" :  "{EMBEDDER}", "input": ["a"] }}',
        headers={"content-type": "application/json"},
    )
    assert where(spaced) == ("embed", "/embed/v1/embeddings?x=1")


@pytest.mark.parametrize(
    "body",
    [
        {"input": "hi"},  # no model: /v1's default applies there
        {"input": "hi", "model": "small"},  # another endpoint's model: /v1 says where it is
        {"input": "hi", "model": EMBEDDER + "-2"},  # a longer name is another name
        {"input": f'"model": "{EMBEDDER}"', "model": "nope"},  # the name inside a text
    ],
)
def test_anything_else_at_v1_embeddings_goes_to_v1(routed: str, body: dict) -> None:
    assert where(httpx.post(f"{routed}/v1/embeddings", json=body)) == ("openai", "/v1/embeddings")


def test_chat_and_completions_naming_a_tier_go_to_generate(routed: str) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        for model in ("auto", "small", "large"):
            sent = httpx.post(f"{routed}{path}", json={"model": model, "messages": []})
            assert where(sent) == ("generate", f"/generate{path}")
    rag = httpx.post(f"{routed}/v1/chat/completions", json={"model": "rag", "messages": []})
    assert where(rag) == ("openai", "/v1/chat/completions")


def test_other_paths_and_methods_are_untouched(routed: str) -> None:
    assert where(httpx.get(f"{routed}/v1/embeddings")) == ("openai", "/v1/embeddings")
    rerank = httpx.post(f"{routed}/v1/rerank", json={"model": "x", "query": "q"})
    assert where(rerank) == ("openai", "/v1/rerank")
    own = httpx.post(f"{routed}/embed/v1/embeddings", json={"model": EMBEDDER, "input": "x"})
    assert where(own) == ("embed", "/embed/v1/embeddings")


def test_a_body_past_the_buffer_goes_the_ordinary_way(routed: str) -> None:
    # The model named after 70 KB of text: HAProxy matches only what its buffer holds, so
    # the request goes where its path goes (answered the same, one hop slower).
    text = "x" * (haproxy.BUFSIZE_BYTES + 6000)
    late = httpx.post(
        f"{routed}/v1/embeddings",
        content=json.dumps({"input": text, "model": EMBEDDER}),
        headers={"content-type": "application/json"},
    )
    assert where(late) == ("openai", "/v1/embeddings")


def test_a_body_sent_after_the_headers_is_waited_for(routed: str) -> None:
    host, port = routed.removeprefix("http://").split(":")
    body = json.dumps({"model": EMBEDDER, "input": "late"}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        )
        time.sleep(0.3)  # the body in a later packet
        conn.sendall(body)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert b'"app": "embed"' in answer, answer


def test_routes_whose_app_is_not_in_the_config_are_left_out() -> None:
    route = haproxy.DirectRoute("/v1/embeddings", "/embed/v1/embeddings", ("m",))
    assert haproxy.route_lines([route], ["/embed/", "/"])
    assert not haproxy.route_lines([route], ["/other/", "/"])
    assert not haproxy.route_lines([route], ["/"])


def test_names_the_config_cannot_quote_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot quote"):
        haproxy.DirectRoute("/v1/embeddings", "/embed/v1/embeddings", ("it's",))
    with pytest.raises(ValueError, match="plain URL path"):
        haproxy.DirectRoute("/v1/embeddings if TRUE", "/embed", ("m",))
    # The wrapper leaves a bad variable out (HAProxy still starts) and says so.
    os.environ[haproxy.DIRECT_ROUTES_VAR] = "not json"
    try:
        assert haproxy._env_routes() == []
    finally:
        del os.environ[haproxy.DIRECT_ROUTES_VAR]


def test_routes_follow_the_openai_apps_args() -> None:
    apps = [
        {"name": "openai", "route_prefix": "/", "import_path": "pipelines.openai_api:app"},
        {"name": "embed", "route_prefix": "/embed", "import_path": "pipelines.embed:app"},
        {
            "name": "generate",
            "route_prefix": "/gen",
            "import_path": "pipelines.generate:build_generate_app",
            "args": {"router": None, "large": None, "small": {"source": {"model": "m"}}},
        },
    ]
    routes = {r.path: r for r in direct_routes(apps)}
    assert routes["/v1/embeddings"].target == "/embed/v1/embeddings"
    assert routes["/v1/embeddings"].models == (served_model_name(EmbedArgs()),)
    # Only the tiers this generate app serves: no large, no auto without a router.
    assert set(routes["/v1/completions"].models) == {"small", "m"}
    assert routes["/v1/chat/completions"].target == "/gen/v1/chat/completions"
    # The OpenAI app under a prefix, its embed app elsewhere, generate not fronted.
    apps[0] = {**apps[0], "route_prefix": "/api", "args": {"generate_app": None}}
    assert {r.path for r in direct_routes(apps)} == {"/api/v1/embeddings"}
    # No OpenAI app, or its embed app not a pipelines.embed app: no routes.
    assert direct_routes(apps[1:]) == []
    apps[1] = {**apps[1], "import_path": "mine:app"}
    assert [r.path for r in direct_routes(apps)] == []
