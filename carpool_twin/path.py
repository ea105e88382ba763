"""The serving path's CPU per request, and the request-rate ceilings it puts on a cluster.

Before a model sees a request it crosses the same CPU stages: the HTTP process of the node it
lands on (Ray's HAProxy, in C, as carpool ships; or Serve's Python proxy), its pipeline's
ingress replica (one Python process: parsing, validation, fan-out, the answer's JSON), and
for ``model: auto`` the router. ``python -m benchmarks path`` measures each one's CPU-ms per
request from /proc; ``python -m carpool_twin path-profile`` keeps those figures, with where
they came from, in a path profile (``profiles/path-cpu-2core.json``, loaded by default). A
component's ceiling is then arithmetic::

    requests/s = cores it can use x 1000 / its CPU-ms per request

with the cores from the serve config and the cluster's shape (``Layout``): HAProxy's threads
on every node, one core per ingress replica (a Python process runs one thread at a time
under the GIL; the router runs inside generate's), and the head node's cores for what may
land there. serve-gpu.yaml's ingresses take ``carpool_ingress``, one unit a replica, which the
head and cluster.yaml's CPU-only ``ingress_cpu`` workers offer: the ingress tier grows by
nodes, and ``ServingPath.size_ingress`` sizes it for a load (replicas per ingress deployment,
then the nodes they need), as the planner sizes model replicas. ``carpool_twin.project`` and
the planner's ``bottlenecks`` compare a mix with the ceilings; ``ServingPath.overheads`` makes
them the whole-cluster twin's path stages (the head's shared cores are a bound there, not a
stage). This module reads the benchmark's JSON file; it never imports the benchmarks package.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool_twin.sim import Overheads, PathStage
from carpool_twin.traffic import KINDS, Traffic

PATH_KIND = "carpool-path-profile"
SCHEMA_VERSION = 1
DEFAULT_PATH_PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "path-cpu-2core.json"
MODES = ("haproxy", "python-proxy")
# The benchmark system measured for each mode, and the process class that is its HTTP layer.
# For Serve's proxy, either system: carpool-previous differs from carpool-python-proxy only in
# the embed app's own URL, which no row read here uses (they read /v1).
SYSTEMS: dict[str, tuple[tuple[str, ...], str]] = {
    "haproxy": (("carpool",), "haproxy"),
    "python-proxy": (("carpool-python-proxy", "carpool-previous"), "ray_proxy"),
}
# HTTP servers per node: HAProxy runs RAY_SERVE_HAPROXY_NBTHREAD threads (Ray's default, 4,
# ray/serve/_private/constants.py), assumed to find that many free cores on every node;
# Serve's proxy is one Python process, so one core.
HTTP_THREADS = {"haproxy": 4, "python-proxy": 1}
HTTP_NAME = {"haproxy": "HTTP (HAProxy)", "python-proxy": "HTTP (Serve proxy)"}
# cluster.yaml's head (m6i.2xlarge, CPU: 8): its HAProxy, and the ingress replicas Ray places
# there (the router runs inside generate's).
HEAD_CORES = 8.0
# The ingress tier (cluster.yaml): the custom resource serve-gpu.yaml's ingresses ask for, one
# unit per replica (one Python process uses at most a core), and the units each node type
# offers, one per core: the head's 8 and each `ingress_cpu` worker's 8 (m6i.2xlarge, no GPU).
# tests/unit/test_twin_path.py checks these against cluster.yaml and serve-gpu.yaml.
INGRESS_RESOURCE = "carpool_ingress"
HEAD_INGRESS_UNITS = 8
INGRESS_NODE_UNITS = 8
INGRESS_NODE_TYPE = "ingress_cpu"
# size_ingress keeps each ingress replica at most this busy at the load it is sized for: one
# process near a full core queues requests behind its GIL, and the CPU-ms are a 2-core VM's.
INGRESS_TARGET = 0.8
# The deployment taking a kind's HTTP in its app, and the args flag under which the kind's
# model replicas take it themselves (no ingress process). The names are pipelines' own
# (EMBED_INGRESS, ...; pipelines import Ray, the twin does not): tests/unit/test_twin_path.py
# checks that they match.
INGRESS = {"embed": "embed_ingress", "rank": "rank_ingress", "generate": "generate_ingress"}
DIRECT = {"embed": ("direct_ingress", "embedder"), "generate": ("direct_streaming", "small")}
ROLE_OF = {"embed": "embedder", "rank": "ranker", "generate": "small"}  # finds a kind's app
# Which benchmark row each kind's HTTP and ingress costs are read from. The rerank row runs
# at ~3 requests/s (the ranker's passes on 2 CPU cores are the limit), where each Serve
# process's idle CPU (~9 ms/s: the idle embed_ingress and rank_ingress in the same rows) is
# several ms per request; the embed row (one short text) stands in for rank.
ROW_OF = {"embed": "embed", "rank": "embed", "generate": "completion"}
DERIVATION = {
    "http.embed": "row embed: the HTTP process's CPU-ms per answer",
    "http.rank": "stand-in: row embed's figure (row rerank, at ~3 requests/s, is mostly idle CPU)",
    "http.generate": "row completion (model small, 1 token)",
    "ingress.embed": "row embed: the ingress replicas' CPU-ms per answer (one short text; 8 "
    "texts cost more: a floor)",
    "ingress.rank": "stand-in: row embed's figure (row rerank, at ~3 requests/s, is mostly "
    "idle CPU)",
    "ingress.generate": "row completion (model small, 1 token)",
    "router.generate": "the router runs in the process that takes generate's HTTP (no process "
    "of its own): row auto's path CPU per answer (all but model and engine) less row chat's, "
    "the same request naming small; at least 0",
}


class PathProfileError(ValueError):
    """A path profile or benchmark file that cannot be used; the message says what to change."""


# --- extraction from `python -m benchmarks path`'s JSON -------------------------------------


def _row(rnd: Mapping[str, Any], system: str, row: str) -> Mapping[str, Any]:
    body = (rnd.get(system) or {}).get(row)
    if not isinstance(body, Mapping) or "cpu_ms_per_req" not in body:
        raise PathProfileError(
            f"the path benchmark has no {system!r} row {row!r} with cpu_ms_per_req; run "
            f"`python -m benchmarks path` with that system and request kind"
        )
    return body


def router_ms(rnd: Mapping[str, Any], system: str) -> float:
    """The router's CPU-ms per ``auto`` request in one round.

    A layout with a router process (before the router moved into the generate ingress): that
    process's CPU in row auto, its idle CPU (row completion, where small skips it) taken
    out. Without one: row auto's path CPU per answer less row chat's (the same request naming
    small), at least 0.
    """
    auto, idle = _row(rnd, system, "auto"), _row(rnd, system, "completion")
    if auto["cpu_ms"].get("router", 0.0) <= 0.0:
        if auto["answered"] < 1:
            raise PathProfileError(f"{system} row auto has no answers; rerun it")
        chat = _row(rnd, system, "chat")
        return max(0.0, auto["path_cpu_ms_per_req"] - chat["path_cpu_ms_per_req"])
    idle_per_s = idle["cpu_ms"]["router"] / idle["window_s"]
    net = auto["cpu_ms"]["router"] - idle_per_s * auto["window_s"]
    if auto["answered"] < 1 or net <= 0:
        raise PathProfileError(
            f"{system} row auto: {auto['answered']} answers, router CPU {net:.0f} ms above "
            "idle; the router's cost needs a run whose auto requests were answered"
        )
    return net / auto["answered"]


def _one_round(rnd: Mapping[str, Any], system: str, http: str) -> dict[str, dict[str, float]]:
    def per(cls: str) -> dict[str, float]:
        return {k: float(_row(rnd, system, ROW_OF[k])["cpu_ms_per_req"][cls]) for k in KINDS}

    return {
        "http": per(http),
        "ingress": per("ingress"),
        "router": {"generate": router_ms(rnd, system)},
    }


def extract_path(bench: Mapping[str, Any], bench_file: str, command: str) -> dict[str, Any]:
    """A path profile from a path benchmark's JSON: per mode (each system it measured),
    component and kind the median CPU-ms per request over its rounds."""
    rounds = bench.get("rounds") or []
    if not rounds:
        raise PathProfileError(f"{bench_file} has no rounds; is it `python -m benchmarks path`'s?")
    modes: dict[str, Any] = {}
    for mode, (candidates, http) in SYSTEMS.items():
        system = next((c for c in candidates if all(c in rnd for rnd in rounds)), None)
        if system is None:
            continue
        each = [_one_round(rnd, system, http) for rnd in rounds]
        ms = {
            c: {k: round(statistics.median(r[c][k] for r in each), 4) for k in each[0][c]}
            for c in each[0]
        }
        modes[mode] = {"system": system, "http_process": http, "cpu_ms_per_request": ms}
    if not modes:
        names = [name for names, _ in SYSTEMS.values() for name in names]
        raise PathProfileError(f"{bench_file} measured none of {names}")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": PATH_KIND,
        "name": f"path-cpu-{(bench.get('machine') or {}).get('nproc', '?')}core",
        "source": "measured",
        "command": command,
        "benchmark": {
            "file": bench_file,
            "command": bench.get("command"),
            "finished": bench.get("finished"),
            "rounds": len(rounds),
            "machine": bench.get("machine"),
        },
        "default_mode": "haproxy" if "haproxy" in modes else next(iter(modes)),
        "derivation": DERIVATION,
        "modes": modes,
    }


# --- the file ------------------------------------------------------------------------------


def validate_path_profile(doc: Mapping[str, Any]) -> None:
    """Raises ``PathProfileError`` naming the first field that is missing or not usable."""
    if doc.get("kind") != PATH_KIND or doc.get("schema_version") != SCHEMA_VERSION:
        raise PathProfileError(
            f"kind {doc.get('kind')!r}, schema_version {doc.get('schema_version')!r}: expected "
            f"{PATH_KIND!r} version {SCHEMA_VERSION}; write one with `python -m carpool_twin "
            "path-profile`"
        )
    for key in ("name", "command", "benchmark", "modes", "default_mode"):
        if key not in doc:
            raise PathProfileError(f"the path profile has no {key!r}; add it")
    if doc["default_mode"] not in doc["modes"]:
        raise PathProfileError(f"default_mode {doc['default_mode']!r} is not in modes")
    for mode, body in doc["modes"].items():
        if mode not in MODES:
            raise PathProfileError(f"mode {mode!r}: use one of {list(MODES)}")
        ms = body.get("cpu_ms_per_request") or {}
        need = [(c, k) for c in ("http", "ingress") for k in KINDS] + [("router", "generate")]
        for c, k in need:
            value = (ms.get(c) or {}).get(k)
            if not isinstance(value, int | float) or not value > 0:
                raise PathProfileError(
                    f"modes.{mode}.cpu_ms_per_request.{c}.{k} is {value!r}; a positive CPU-ms"
                )


def load_path_profile(path: str | Path | None = None) -> dict[str, Any]:
    """Reads and validates a path profile (default: ``DEFAULT_PATH_PROFILE``)."""
    path = Path(path or DEFAULT_PATH_PROFILE)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PathProfileError(f"cannot read path profile {path}: {exc}") from exc
    validate_path_profile(doc)
    return doc


# --- where the path runs, and its ceilings --------------------------------------------------


def _replicas(deployment: Mapping[str, Any]) -> int:
    """The most replicas a deployment entry allows: num_replicas, else autoscaling's max;
    none of either is Serve's default, one."""
    if isinstance(deployment.get("num_replicas"), int):
        return int(deployment["num_replicas"])
    auto = deployment.get("autoscaling_config") or {}
    return int(auto.get("max_replicas") or auto.get("min_replicas") or 1)


def ingress_deployments(config: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """Per kind the config serves: (the deployment that takes its HTTP, its replicas)."""
    out: dict[str, tuple[str, int]] = {}
    for app in config.get("applications") or []:
        args = app.get("args") or {}
        entries = {d.get("name"): d for d in app.get("deployments") or []}
        for kind, role in ROLE_OF.items():
            if kind in out or not isinstance(args.get(role), dict):
                continue
            flag, model = DIRECT.get(kind, ("", ""))
            name = model if flag and args.get(flag) else INGRESS[kind]
            out[kind] = (name, _replicas(entries.get(name) or {}))
    return out


def router_host(config: Mapping[str, Any]) -> tuple[str, int] | None:
    """The deployment hosting the router (the one taking generate's HTTP: the router runs in
    it, router.deployment.HostedRouter) and its replicas; None without a router."""
    for app in config.get("applications") or []:
        args = app.get("args") or {}
        if isinstance(args.get("router"), dict) or (
            isinstance(args.get(ROLE_OF["generate"]), dict) and "router" not in args
        ):
            return ingress_deployments({"applications": [app]}).get("generate")
    return None


def auto_rate(traffic: Traffic) -> float:
    """Generation requests/s that ask for ``model: auto`` (through the router); a trace's do."""
    mix = traffic.kinds.get("generate")
    if mix is not None and mix.model != "auto":
        return 0.0
    return traffic.rates().get("generate", 0.0)


def tier_units(config: Mapping[str, Any]) -> int | None:
    """The ``carpool_ingress`` units the config's ingress replicas take (None: no ingress asks
    for it, so every ingress stays on the head, as a ``carpool_head_node`` pin keeps it).
    Apps serving no kind of the mix (search, rag, openai) list no ingress deployment: one
    replica each, Serve's default."""
    units, tiered = 0, False
    for app in config.get("applications") or []:
        args = app.get("args") or {}
        want = ((args.get("ingress") or {}).get("resources") or {}).get(INGRESS_RESOURCE)
        if not want:
            continue
        tiered = True
        served = ingress_deployments({"applications": [app]})
        names = {name for name, _ in served.values()} & set(INGRESS.values())
        entries = {d.get("name"): d for d in app.get("deployments") or []}
        replicas = sum(_replicas(entries.get(n) or {}) for n in names) if names else 1
        units += math.ceil(replicas * float(want))
    return units if tiered else None


def ingress_nodes(units: int | None, head_units: int = HEAD_INGRESS_UNITS) -> int:
    """``ingress_cpu`` workers Ray's autoscaler starts for ``units``: what the head cannot hold."""
    if not units:
        return 0
    return max(0, math.ceil((units - head_units) / INGRESS_NODE_UNITS))


def with_replicas(config: Mapping[str, Any], replicas: Mapping[str, int]) -> dict[str, Any]:
    """The config with these deployments at fixed ``num_replicas`` (autoscaling dropped);
    a deployment the app does not list gets an entry."""
    doc = copy.deepcopy(dict(config))
    for app in doc.get("applications") or []:
        served = {name for name, _ in ingress_deployments({"applications": [app]}).values()}
        entries = app.setdefault("deployments", [])
        for name in sorted(served & set(replicas)):
            entry = next((d for d in entries if d.get("name") == name), None)
            if entry is None:
                entry = {"name": name}
                entries.append(entry)
            entry.pop("autoscaling_config", None)
            entry["num_replicas"] = int(replicas[name])
    return doc


@dataclass(frozen=True)
class Layout:
    """Where the path's processes run, from the serve config and the cluster's shape."""

    nodes: int  # nodes with an HTTP process: GPU nodes, the head, ingress nodes (EveryNode)
    ingress: dict[str, tuple[str, int]]  # kind -> (deployment taking its HTTP, replicas)
    router: tuple[str, int] | None  # the deployment hosting the router, its replicas
    # carpool_ingress units the ingress replicas take (None: all on the head), and the
    # ingress_cpu workers they need beyond the head's units.
    units: int | None = None
    ingress_nodes: int = 0


@dataclass(frozen=True)
class Bound:
    """One component's ceiling on the traffic it serves: cores x 1000 / CPU-ms per request."""

    component: str  # http, ingress or head
    name: str  # as reported: "HTTP (HAProxy)", "ingress embed_ingress", "router", ...
    cores: float
    rate: float  # requests/s it serves at the traffic as given
    ms_per_request: float  # CPU-ms per request over those, mix-weighted

    @property
    def ceiling_rps(self) -> float:
        return self.cores * 1000.0 / self.ms_per_request

    @property
    def load(self) -> float:
        return self.rate / self.ceiling_rps

    @property
    def scale(self) -> float:
        """The multiple of the traffic at which this component is fully busy."""
        return self.ceiling_rps / self.rate if self.rate > 0 else math.inf


def _bound(
    component: str,
    name: str,
    cores: float,
    parts: list[tuple[float, float]],
    rate: float | None = None,
) -> Bound:
    """From (requests/s, CPU-ms each) parts; ``rate``: the requests counted (default: theirs)."""
    rate = sum(r for r, _ in parts) if rate is None else rate
    cpu = sum(r * ms for r, ms in parts)
    return Bound(component, name, cores, rate, cpu / rate if rate > 0 else 1.0)


@dataclass(frozen=True)
class ServingPath:
    """One ingress mode's measured CPU per request, and the cores the cluster gives each
    component (HAProxy threads per node; the head's cores, None: not bounded)."""

    mode: str
    ms: Mapping[str, Mapping[str, float]]  # component -> kind -> CPU-ms per request
    http_threads: int
    head_cores: float | None = HEAD_CORES
    source: str = ""

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        mode: str | None = None,
        http_threads: int | None = None,
        head_cores: float | None = HEAD_CORES,
    ) -> ServingPath:
        doc = load_path_profile(path)
        mode = mode or doc["default_mode"]
        if mode not in doc["modes"]:
            raise PathProfileError(f"ingress mode {mode!r}: this profile has {list(doc['modes'])}")
        threads = http_threads or HTTP_THREADS[mode]
        source = str(path or DEFAULT_PATH_PROFILE.relative_to(DEFAULT_PATH_PROFILE.parents[1]))
        return cls(mode, doc["modes"][mode]["cpu_ms_per_request"], threads, head_cores, source)

    def layout(self, config: Mapping[str, Any], gpus: float, gpus_per_node: int) -> Layout:
        head_only = config.get("proxy_location") == "HeadOnly"
        units = tier_units(config)
        extra = ingress_nodes(units)
        nodes = 1 if head_only else max(1, math.ceil(gpus / gpus_per_node)) + 1 + extra
        return Layout(nodes, ingress_deployments(config), router_host(config), units, extra)

    def deployment_cpu(self, config: Mapping[str, Any], traffic: Traffic) -> dict[str, float]:
        """CPU-ms per second each separate ingress deployment spends on ``traffic`` (the
        router's share in its host's); model replicas taking HTTP themselves are not here."""
        rates, auto = traffic.rates(), auto_rate(traffic)
        host = router_host(config)
        out: dict[str, float] = {}
        for name, _, kinds in _grouped(ingress_deployments(config)):
            if name not in INGRESS.values():
                continue
            cpu = sum(rates.get(k, 0.0) * self.ms["ingress"][k] for k in kinds)
            if host and name == host[0]:
                cpu += auto * self.ms["router"]["generate"]
            out[name] = cpu
        return out

    def size_ingress(
        self, config: Mapping[str, Any], traffic: Traffic, target: float = INGRESS_TARGET
    ) -> dict[str, int]:
        """Replicas per ingress deployment that keep each at most ``target`` of a core busy
        at ``traffic``, from the measured CPU-ms per request (at least one each)."""
        return {
            name: max(1, math.ceil(cpu / (1000.0 * target) - 1e-9))
            for name, cpu in self.deployment_cpu(config, traffic).items()
        }

    def bounds(
        self, config: Mapping[str, Any], traffic: Traffic, gpus: float, gpus_per_node: int = 8
    ) -> list[Bound]:
        """Every shared component's bound on ``traffic`` (those it does not reach: omitted)."""
        lay = self.layout(config, gpus, gpus_per_node)
        rates, auto = traffic.rates(), auto_rate(traffic)
        http, ingress = self.ms["http"], self.ms["ingress"]
        router = self.ms["router"]["generate"]
        out = [
            _bound(
                "http",
                HTTP_NAME[self.mode],
                lay.nodes * self.http_threads,
                [(r, http[k]) for k, r in rates.items()],
            )
        ]
        host = lay.router[0] if lay.router else None
        for name, replicas, kinds in _grouped(lay.ingress):
            parts = [(rates.get(k, 0.0), ingress[k]) for k in kinds]
            rate = sum(r for r, _ in parts)
            if name == host:  # the router's decisions run in these processes too
                parts.append((auto, router))
            out.append(_bound("ingress", f"ingress {name}", replicas, parts, rate))
        if self.head_cores:
            # The head's HTTP process's share of the requests, and the ingress replicas Ray
            # may place there: all of them without an ingress tier, else the head's units'
            # worth, the busiest first (Ray picks the node, so the worst case).
            parts = [(r, http[k] / lay.nodes) for k, r in rates.items()]
            each: list[float] = []
            for name, cpu in self.deployment_cpu(config, traffic).items():
                replicas = next(n for d, n, _ in _grouped(lay.ingress) if d == name)
                each += [cpu / replicas] * replicas
            each.sort(reverse=True)
            held = each if lay.units is None else each[:HEAD_INGRESS_UNITS]
            parts += [(1.0, cpu) for cpu in held]
            # Counted in the mix's requests, each with its share of all the head does.
            total = sum(rates.values())
            out.append(_bound("head", "head node CPU", self.head_cores, parts, total))
        return [b for b in out if b.rate > 0]

    def overheads(
        self, config: Mapping[str, Any], gpus: float, gpus_per_node: int = 8
    ) -> Overheads:
        """The whole-cluster twin's path: the HTTP layer, each ingress deployment, the router."""
        lay = self.layout(config, gpus, gpus_per_node)
        stages = [
            PathStage(HTTP_NAME[self.mode], lay.nodes * self.http_threads, dict(self.ms["http"]))
        ]
        for name, replicas, kinds in _grouped(lay.ingress):
            ms = {k: self.ms["ingress"][k] for k in kinds}
            stages.append(PathStage(f"ingress {name}", replicas, ms))
        # The router shares its host's processes; the sim gives it a stage of the host's
        # size (its cost is small beside the ingress's: the gap is under its CPU-ms per auto).
        router = max(self.ms["router"]["generate"], 1e-3)
        replicas = lay.router[1] if lay.router else 1
        return Overheads(
            path=tuple(stages), router_rps=1000.0 / router, router_replicas=max(1, replicas)
        )


def _grouped(ingress: Mapping[str, tuple[str, int]]) -> list[tuple[str, int, list[str]]]:
    """(deployment, replicas, kinds) per ingress deployment: kinds sharing one share its cores."""
    out: dict[str, tuple[int, list[str]]] = {}
    for kind, (name, replicas) in ingress.items():
        out.setdefault(name, (replicas, []))[1].append(kind)
    return [(name, n, kinds) for name, (n, kinds) in out.items()]
