"""A serve config, read as the twin's cluster: which pools, how many replicas, which knobs.

``TwinSpec.from_serve_config`` reads a serve config (``serve.yaml``, ``serve-gpu.yaml``) the
way ``python -m carpool_twin profile`` does (models by role under each application's
``args``, knobs from each deployment's ``user_config``), takes every model's cost from a
profile entry, and applies an overlay: the same shape the planner writes, e.g.
``{"embedder": {"num_replicas": 2, "user_config": {"max_batch_tokens": 2048}},
"router": {"max_in_flight_per_replica": {"small": 32}}}``. ``TwinSpec.build`` makes a fresh
``Twin`` (a twin is single-use: one load per instance).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carpool.config import BatchingConfig, batched_max_ongoing
from carpool_twin.profile import ProfileError, find_entry
from carpool_twin.replicas import EncoderReplica, GeneratorReplica
from carpool_twin.sim import Overheads, Pool, Twin

ROLES = ("embedder", "ranker", "small", "large")
ENCODERS = ("embedder", "ranker")
# Serve's own default when a generator deployment sets none: the generator's slots plus its
# waiting line is what carpool's configs give it (serve.yaml: 64 + 256).
GENERATOR_MAX_ONGOING = 320


@dataclass
class PoolSpec:
    role: str
    replicas: int
    knobs: dict[str, Any]
    entry: dict[str, Any]
    max_ongoing_requests: int
    max_queued_requests: int
    mode: str = "encoder"
    max_kv_tokens: int | None = None
    request_ms: float = 0.0  # replica-side serving work per request (tokenizing, answering)
    # The pool's passes under serving cost this many times the profile's bare pass (the
    # replica's own pass timings in a calibration run: ``carpool_twin.calibrate``).
    pass_scale: float = 1.0
    step_ms: float = 0.0  # a generator's engine work per step outside its forward passes
    seq_ms: float = 0.0  # and per sequence in a step (sampling, text, its stream's event)


@dataclass
class TwinSpec:
    """Everything a twin needs; ``build()`` gives a fresh, unrun ``Twin``."""

    pools: dict[str, PoolSpec]
    router: dict[str, Any] | None = None
    overheads: Overheads = field(default_factory=Overheads)
    scale: float = 1.0  # every pass's profile cost times this (contention, another device)
    profile_name: str = ""
    # How generator decode steps are priced: "points" (the profile's measured points,
    # ``carpool_twin.replicas.DecodeCurve``) or "fit" (the section's fitted plane).
    decode_curve: str = "points"

    def build(self, seed: int = 0) -> Twin:
        pools: dict[str, Pool] = {}
        for role, p in self.pools.items():
            replicas: list[EncoderReplica | GeneratorReplica] = []
            for i in range(p.replicas):
                name = f"{role}-{i}"
                if role in ENCODERS:
                    replicas.append(
                        EncoderReplica(
                            name,
                            BatchingConfig.model_validate(p.knobs),
                            p.entry,
                            self.scale * p.pass_scale,
                            p.request_ms,
                        )
                    )
                else:
                    replicas.append(
                        GeneratorReplica(
                            name,
                            p.knobs,
                            p.entry,
                            self.scale * p.pass_scale,
                            p.max_kv_tokens,
                            p.step_ms,
                            curve=self.decode_curve,
                            seq_overhead_ms=p.seq_ms,
                        )
                    )
            pools[role] = Pool(role, replicas, p.max_ongoing_requests, p.max_queued_requests)
        return Twin(pools, copy.deepcopy(self.overheads), copy.deepcopy(self.router), seed)

    def replicas(self) -> dict[str, int]:
        return {role: p.replicas for role, p in self.pools.items()}

    @classmethod
    def from_serve_config(
        cls,
        config: str | Path | Mapping[str, Any],
        profile: Mapping[str, Any],
        overlay: Mapping[str, Any] | None = None,
        dtype: str | None = None,
        threads: int | None = None,
        roles: tuple[str, ...] = ROLES,
    ) -> TwinSpec:
        doc = _load(config)
        overlay = dict(overlay or {})
        pools: dict[str, PoolSpec] = {}
        router: dict[str, Any] | None = None
        for app in doc.get("applications") or []:
            deployments = {d.get("name"): d for d in app.get("deployments") or []}
            args = app.get("args") or {}
            for role, body in args.items():
                if role not in roles or role in pools or not isinstance(body, dict):
                    continue
                if not isinstance(body.get("source"), dict):
                    continue
                deployment = _merge(deployments.get(role) or {}, overlay.get(role) or {})
                pools[role] = _pool(role, body, deployment, profile, dtype, threads)
            if isinstance(args.get("router"), dict) and router is None:
                router = {
                    k: v
                    for k, v in _merge(args["router"], overlay.get("router") or {}).items()
                    if k not in ("num_replicas", "resources", "predictor_sync_s")
                }
        unknown = set(overlay) - set(pools) - {"router"}
        if unknown:
            raise ValueError(
                f"the overlay names {sorted(unknown)}, which this config does not serve; "
                f"use one of {sorted(pools)} or router"
            )
        if not pools:
            raise ValueError("the config serves no model the twin knows (embedder, ranker, ...)")
        return cls(pools, router, profile_name=str(profile.get("name", "")))


def _load(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    import yaml

    return yaml.safe_load(Path(config).read_text())


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def replica_count(deployment: Mapping[str, Any]) -> int:
    """Fixed ``num_replicas``, else autoscaling's ``min_replicas`` (the twin does not scale)."""
    n = deployment.get("num_replicas")
    if isinstance(n, int):
        return n
    auto = deployment.get("autoscaling_config") or {}
    return int(auto.get("initial_replicas") or auto.get("min_replicas") or 1)


def _entry(
    profile: Mapping[str, Any], role: str, dtype: str | None, threads: int | None
) -> dict[str, Any]:
    try:
        return find_entry(profile, role, dtype=dtype, threads=threads)
    except ProfileError:
        if dtype is None and threads is None:
            raise
        return find_entry(profile, role)  # the profile has one variant only: use it


def _pool(
    role: str,
    body: Mapping[str, Any],
    deployment: Mapping[str, Any],
    profile: Mapping[str, Any],
    dtype: str | None,
    threads: int | None,
) -> PoolSpec:
    entry = _entry(profile, role, dtype, threads)
    knobs = dict(deployment.get("user_config") or {})
    replicas = replica_count(deployment)
    if role in ENCODERS:
        batching = BatchingConfig.model_validate(knobs)
        ongoing = int(deployment.get("max_ongoing_requests") or batched_max_ongoing(batching))
        return PoolSpec(
            role,
            replicas,
            batching.model_dump(),
            entry,
            ongoing,
            int(deployment.get("max_queued_requests") or ongoing),
        )
    mode = str(body.get("mode", "continuous"))
    if mode == "static":
        raise ValueError(f"{role}: mode static has no step model in the twin; use continuous")
    limits = body.get("limits") or {}
    max_kv = None
    if mode == "continuous" and limits.get("max_kv_cache_mb"):
        max_kv = int(limits["max_kv_cache_mb"]) * 2**20 // int(entry["kv_bytes_per_token"])
    vllm = body.get("vllm") or {}
    knobs.setdefault("max_num_seqs", vllm.get("max_num_seqs", 64))
    knobs.setdefault("max_step_tokens", vllm.get("max_num_batched_tokens", 512))
    ongoing = int(deployment.get("max_ongoing_requests") or GENERATOR_MAX_ONGOING)
    return PoolSpec(
        role,
        replicas,
        knobs,
        entry,
        ongoing,
        int(deployment.get("max_queued_requests") or ongoing),
        mode=mode,
        max_kv_tokens=max_kv,
    )
