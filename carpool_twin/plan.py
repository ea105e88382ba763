"""The planner: replica counts and batching knobs for a traffic mix and an SLO, found with the twin.

For each request kind (``embed`` -> embedder, ``rank`` -> ranker, ``generate`` -> small and
large behind the router) the planner tries a small grid of knobs around the config's own
(``max_batch_tokens`` and ``pass_overhead_tokens`` for encoders, ``max_num_seqs`` and
``max_step_tokens`` for generators, the router's ``max_in_flight_per_replica``) and, for
each, adds replicas to the busiest model until the twin says the SLO holds at the offered
traffic; it keeps the cheapest (GPUs, then cores, then p99). Kinds use disjoint deployments,
so they are planned apart; what they share (the HTTP proxies, the router) is checked against
its documented ceiling afterwards (``bottlenecks``). ``--gpus N`` instead finds the largest
multiple of the traffic whose cheapest plan fits in N GPUs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carpool_twin.path import ServingPath
from carpool_twin.sim import Overheads, SimResult
from carpool_twin.topology import ENCODERS, TwinSpec, _load
from carpool_twin.traffic import Traffic

ROLES_OF = {"embed": ("embedder",), "rank": ("ranker",), "generate": ("small", "large")}
# Per model: the search stops there and reports the SLO missed. 256: a 64-GPU cluster fits
# 213 of serve-gpu.yaml's small replicas (0.3 GPU each); at 64 the search stopped at 26 GPUs.
MAX_REPLICAS = 256
# A trial at a larger multiple starts from this share of the last fitting plan's replicas
# scaled up linearly (batching makes throughput grow faster than replicas): _size grows from
# there and gives back what the SLO does not need.
START_SHARE = 0.5
# An SLO met in a short window by a queue that still grows is not met (``keeps_up``).
GROWTH = 1.5
SATURATED = 0.97


@dataclass
class Slo:
    """Per kind: the p99 latency bound (ms); for generation the TTFT p99 bound too."""

    p99_ms: dict[str, float] = field(default_factory=dict)
    ttft_p99_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``p99_ms=500`` (every kind; generation: its TTFT), or per kind:
        ``embed.p99_ms=300,generate.ttft_p99_ms=1000,generate.p99_ms=30000``."""
        slo = cls()
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"SLO {part!r}: write NAME=MS, e.g. p99_ms=500")
            kind, _, name = key.rpartition(".")
            if name == "p99_ms":
                for k in [kind] if kind else ["embed", "rank"]:
                    slo.p99_ms[k] = float(value)
                if not kind and slo.ttft_p99_ms is None:
                    slo.ttft_p99_ms = float(value)
            elif name == "ttft_p99_ms" and kind in ("", "generate"):
                slo.ttft_p99_ms = float(value)
            else:
                raise ValueError(f"SLO {key!r}: use p99_ms, KIND.p99_ms or generate.ttft_p99_ms")
        return slo

    def met(self, kind: str, r: SimResult) -> bool:
        if r.answered == 0 or r.refused > 0:
            return False
        if kind in self.p99_ms and not r.p99_ms <= self.p99_ms[kind]:
            return False
        return not (
            kind == "generate" and self.ttft_p99_ms and not r.ttft_p99_ms <= self.ttft_p99_ms
        )


@dataclass
class Choice:
    kind: str
    overlay: dict[str, Any]
    replicas: dict[str, int]
    gpus: float
    cpus: float
    result: SimResult
    met: bool
    role: str = ""  # whose knobs changed ("router" for the router's)
    knobs: dict[str, Any] = field(default_factory=dict)

    def row(self, price_gpu_h: float, price_cpu_h: float) -> dict[str, Any]:
        r = self.result
        per_s = r.tokens_per_s if self.kind == "generate" else r.items_per_s
        hourly = self.gpus * price_gpu_h + self.cpus * price_cpu_h
        return {
            "kind": self.kind,
            "replicas": self.replicas,
            "knobs": {
                k: v.get("user_config", {}) for k, v in self.overlay.items() if k != "router"
            },
            "throughput": round(per_s, 1),
            "unit": "tokens/s" if self.kind == "generate" else "items/s",
            "p50_ms": round(r.p50_ms, 1),
            "p99_ms": round(r.p99_ms, 1),
            "ttft_p99_ms": None if math.isnan(r.ttft_p99_ms) else round(r.ttft_p99_ms, 1),
            "gpus": round(self.gpus, 3),
            "cpus": round(self.cpus, 3),
            "usd_per_million": round(hourly / max(per_s * 3600, 1e-9) * 1e6, 4),
            "slo_met": self.met,
        }


def _resources(config: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """(num_gpus, num_cpus) per replica of each model role, from the config's args."""
    out: dict[str, tuple[float, float]] = {}
    for app in config.get("applications") or []:
        for role, body in (app.get("args") or {}).items():
            if isinstance(body, dict) and isinstance(body.get("replica"), dict):
                rep = body["replica"]
                out.setdefault(
                    role, (float(rep.get("num_gpus") or 0), float(rep.get("num_cpus") or 0))
                )
    return out


def knob_grid(role: str, knobs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The config's knobs and a few neighbours (halving and doubling the ones that matter)."""
    if role in ENCODERS:
        mbt = int(knobs.get("max_batch_tokens", 8192))
        over = int(knobs.get("pass_overhead_tokens", 128))
        grid = [{}]
        grid += [{"max_batch_tokens": v} for v in (mbt // 4, mbt // 2, mbt * 2) if v >= 512]
        grid += [{"pass_overhead_tokens": v} for v in (max(8, over // 4), over * 4)]
        return grid
    seqs = int(knobs.get("max_num_seqs", 64))
    step = int(knobs.get("max_step_tokens", 512))
    grid = [{}]
    grid += [{"max_num_seqs": v} for v in (seqs // 2, seqs * 2) if 1 <= v <= step and v <= 256]
    grid += [{"max_step_tokens": step * 4}]
    return grid


class Planner:
    def __init__(
        self,
        config: str | Path | Mapping[str, Any],
        profile: Mapping[str, Any],
        slo: Slo,
        dtype: str | None = None,
        threads: int | None = None,
        duration_s: float = 30.0,
        requests_per_run: int = 2500,
        overheads: Overheads | None = None,
    ) -> None:
        self.config = _load(config)
        self.profile = profile
        self.slo = slo
        self.dtype, self.threads = dtype, threads
        self.duration_s = duration_s
        self.requests_per_run = requests_per_run
        self.overheads = overheads or Overheads()
        self.resources = _resources(self.config)
        self.base = TwinSpec.from_serve_config(self.config, profile, dtype=dtype, threads=threads)
        # Kinds whose knobs are settled (fit_gpus searches replicas only, at every scale).
        self.fixed: dict[str, tuple[str, dict[str, Any]]] = {}
        # Where _size starts, per kind and role (fit_gpus: the last fitting plan's replicas
        # scaled to the trial's load), so a trial at 1000x the mix is not first simulated on
        # one replica drowning in 100k queued requests (the 16/64-GPU projections never ended).
        self.start: dict[str, dict[str, int]] = {}

    def _cost(self, replicas: Mapping[str, int]) -> tuple[float, float]:
        gpus = sum(n * self.resources.get(r, (0.0, 0.0))[0] for r, n in replicas.items())
        cpus = sum(n * self.resources.get(r, (0.0, 0.0))[1] for r, n in replicas.items())
        return gpus, cpus

    def evaluate(
        self, kind: str, overlay: dict[str, Any], traffic: Traffic, seed: int = 0
    ) -> SimResult:
        roles = ROLES_OF[kind]
        spec = TwinSpec.from_serve_config(
            self.config, self.profile, overlay, self.dtype, self.threads, roles=roles
        )
        spec.overheads = copy.deepcopy(self.overheads)
        rate = traffic.rates().get(kind, 0.0)
        # Enough requests for a p99 (a few thousand), at most duration_s of traffic.
        duration = max(2.0, min(self.duration_s, self.requests_per_run / max(rate, 1e-9)))
        arrivals = traffic.arrivals(duration, seed)[kind]
        warmup = min(2.0, duration / 5)
        twin = spec.build(seed)
        result = twin.run(arrivals=arrivals, warmup_s=warmup)
        done = sorted((r for r in twin.records if r.ended is not None), key=lambda r: r.sent)
        bound = max(self.slo.p99_ms.get(kind, 0.0), self.slo.ttft_p99_ms or 0.0, 100.0)
        # A generator's queue shows in the wait for a first token; an encoder's in latency.
        waits = [
            ((r.first_token if kind == "generate" and r.first_token else r.ended) - r.sent) * 1000
            for r in done
        ]  # type: ignore[operator]
        result.keeps_up = keeps_up(waits, bound)
        if kind != "generate":
            # A batching encoder busy nearly all the time is at capacity (a generator is busy
            # whenever one sequence runs, so its utilisation says nothing of the kind).
            busy = max(result.utilisation.values(), default=0.0)
            result.keeps_up = result.keeps_up and busy < SATURATED
        return result

    def plan_kind(
        self, kind: str, traffic: Traffic, max_gpus: float | None = None
    ) -> Choice | None:
        """The cheapest (knobs, replicas) meeting the SLO at this traffic, or the best miss."""
        roles = [r for r in ROLES_OF[kind] if r in self.base.pools]
        if not roles or traffic.rates().get(kind, 0) <= 0:
            return None
        grids = [(r, g) for r in roles for g in knob_grid(r, self.base.pools[r].knobs)]
        if kind == "generate" and self.base.router is not None:
            # The router's in-flight cap per replica: up to each model's max_num_seqs, so
            # requests wait in the engine (which batches them) rather than in the lanes.
            seqs = {r: int(self.base.pools[r].knobs.get("max_num_seqs", 16)) for r in roles}
            grids.append(("router", {"max_in_flight_per_replica": seqs}))
        if kind in self.fixed:
            grids = [self.fixed[kind]]
        best: Choice | None = None
        for role, knobs in grids:
            choice = self._size(kind, roles, role, knobs, traffic, max_gpus)
            if best is None or _better(choice, best):
                best = choice
        return best

    def _try(
        self, kind: str, replicas: dict[str, int], role: str, knobs: dict, traffic: Traffic
    ) -> Choice:
        overlay: dict[str, Any] = {r: {"num_replicas": n} for r, n in replicas.items()}
        if knobs and role == "router":
            overlay["router"] = dict(knobs)
        elif knobs:
            overlay[role]["user_config"] = dict(knobs)
        result = self.evaluate(kind, overlay, traffic)
        gpus, cpus = self._cost(replicas)
        met = self.slo.met(kind, result) and result.keeps_up
        return Choice(kind, overlay, dict(replicas), gpus, cpus, result, met, role, dict(knobs))

    def _size(
        self,
        kind: str,
        roles: list[str],
        role: str,
        knobs: dict[str, Any],
        traffic: Traffic,
        max_gpus: float | None,
    ) -> Choice:
        """Grow the busiest model (doubling while the queue outruns it) until the SLO holds,
        then give back replicas one model at a time while it still holds."""
        hint = self.start.get(kind, {})
        replicas = {r: max(1, min(MAX_REPLICAS, hint.get(r, 1))) for r in roles}
        choice = self._try(kind, replicas, role, knobs, traffic)
        while not choice.met:
            if max_gpus is not None and choice.gpus > max_gpus:
                return choice
            busiest = max(roles, key=lambda r: _utilisation(choice.result, r))
            if replicas[busiest] >= MAX_REPLICAS:
                return choice
            grow = replicas[busiest] if not choice.result.keeps_up else 1
            replicas[busiest] = min(MAX_REPLICAS, replicas[busiest] + grow)
            choice = self._try(kind, replicas, role, knobs, traffic)
        for r in roles:
            while replicas[r] > 1:
                fewer = {**replicas, r: replicas[r] - max(1, replicas[r] // 8)}
                smaller = self._try(kind, fewer, role, knobs, traffic)
                if not smaller.met:
                    break
                replicas, choice = fewer, smaller
        return choice

    def plan(self, traffic: Traffic, max_gpus: float | None = None) -> dict[str, Choice]:
        return {k: c for k in ROLES_OF if (c := self.plan_kind(k, traffic, max_gpus)) is not None}

    def fit_gpus(
        self, traffic: Traffic, gpus: float, steps: int = 7, cap: float | None = None
    ) -> tuple[float, dict[str, Choice]]:
        """The largest multiple of ``traffic`` whose plan meets the SLO within ``gpus``.

        Knobs are searched once, at the traffic as given; the scales then size replicas only.
        ``cap``: a multiple past which the answer does not matter (another bound binds there,
        e.g. the HTTP proxies); if the plan at ``cap`` fits, ``cap`` is returned.
        The multiple grows 4x a trial toward the cap, each trial sized from the last fitting
        plan: a first trial at the cap itself (thousands of times the mix at 64 GPUs) was a
        simulation of 100k+ requests on one replica, and the 16/64-GPU projections never ended.
        """
        base = self.plan(traffic)
        self.fixed = {k: (c.role, c.knobs) for k, c in base.items()}

        def trial(scale: float, fitted: dict[str, Choice], at: float) -> dict[str, Choice]:
            self.start = {
                k: {r: int(n * scale / at * START_SHARE) for r, n in c.replicas.items()}
                for k, c in fitted.items()
            }
            return self.plan(traffic.scaled(scale), gpus)

        try:
            lo, hi, found = 0.0, 1.0, base
            if not _fits(base, gpus):
                hi, found = 1.0, {}
            else:
                lo, hi = 1.0, 4.0
                if cap is not None and cap <= lo:
                    return lo, base
                while hi <= 1e6:  # grow until it no longer fits, then bisect (log)
                    last = cap is not None and hi >= cap
                    if last:
                        hi = cap  # type: ignore[assignment]
                    plan = trial(hi, found, lo)
                    if not _fits(plan, gpus):
                        break
                    lo, found = hi, plan
                    if last:
                        return lo, found
                    hi *= 4
            for _ in range(steps):
                mid = math.sqrt(max(lo, hi / 64) * hi)
                plan = trial(mid, found, lo)  # found empty: no hint, a plain plan
                if _fits(plan, gpus):
                    lo, found = mid, plan
                else:
                    hi = mid
            return lo, found
        finally:
            self.fixed, self.start = {}, {}


def keeps_up(latencies_ms: list[float], slo_ms: float) -> bool:
    """False when latency grows through the run (a queue that outruns its replicas): the
    last quarter of requests, by send time, waits far longer than the second quarter."""
    n = len(latencies_ms)
    if n < 20:
        return True
    second = sum(latencies_ms[n // 4 : n // 2]) / (n // 2 - n // 4)
    last = sum(latencies_ms[3 * n // 4 :]) / (n - 3 * n // 4)
    return not (last > GROWTH * second and last - second > 0.25 * slo_ms)


def _utilisation(result: SimResult, role: str) -> float:
    mine = [v for k, v in result.utilisation.items() if k.startswith(role + "-")]
    return sum(mine) / len(mine) if mine else 0.0


def _better(a: Choice, b: Choice) -> bool:
    if a.met != b.met:
        return a.met
    if not a.met:  # both miss: the one closer to its target
        return a.result.p99_ms < b.result.p99_ms
    return (a.gpus, a.cpus, a.result.p99_ms) < (b.gpus, b.cpus, b.result.p99_ms)


def _fits(plan: Mapping[str, Choice], gpus: float) -> bool:
    return all(c.met for c in plan.values()) and sum(c.gpus for c in plan.values()) <= gpus + 1e-9


def overlay_of(plan: Mapping[str, Choice]) -> dict[str, Any]:
    """The serve-config overlay: per deployment, num_replicas and the knobs that changed."""
    out: dict[str, Any] = {}
    for choice in plan.values():
        for role, body in choice.overlay.items():
            out[role] = copy.deepcopy(body)
    return out


def apply_overlay(config: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """The serve config with the overlay applied: fixed replica counts (autoscaling removed,
    the twin sized them) and merged ``user_config``."""
    doc = copy.deepcopy(dict(config))
    for app in doc.get("applications") or []:
        args = app.get("args") or {}
        if overlay.get("router") and isinstance(args.get("router"), dict):
            args["router"] = {**args["router"], **overlay["router"]}
        for dep in app.get("deployments") or []:
            body = overlay.get(dep.get("name"))
            if not body:
                continue
            if "num_replicas" in body:
                dep.pop("autoscaling_config", None)
                dep["num_replicas"] = body["num_replicas"]
            if body.get("user_config"):
                dep["user_config"] = {**(dep.get("user_config") or {}), **body["user_config"]}
    return doc


def bottlenecks(
    traffic: Traffic,
    gpus: float,
    config: Mapping[str, Any],
    path: ServingPath,
    gpus_per_node: int = 8,
) -> dict[str, Any]:
    """Load on what every request shares (1.0: fully busy), against ceilings from measured
    CPU per request (``ServingPath.bounds``): cores x 1000 / CPU-ms per request."""
    bounds = path.bounds(config, traffic, gpus, gpus_per_node)
    lay = path.layout(config, gpus, gpus_per_node)
    by = {b.component: b for b in bounds}
    return {
        "requests_per_s": round(sum(traffic.rates().values()), 1),
        "ingress_mode": path.mode,
        "path_profile": path.source,
        "proxies": lay.nodes,  # nodes with an HTTP process
        # carpool_ingress units the ingresses take (None: all on the head), and the
        # ingress_cpu nodes they need beyond the head's.
        "ingress_units": lay.units,
        "ingress_nodes": lay.ingress_nodes,
        "proxy_load": round(by["http"].load, 3) if "http" in by else 0.0,
        "ingress_load": {b.name: round(b.load, 3) for b in bounds if b.component == "ingress"},
        "router_load": round(by["router"].load, 3) if "router" in by else 0.0,
        "head_load": round(by["head"].load, 3) if "head" in by else None,
        "ceilings": {
            b.name: {
                "requests_per_s": round(b.ceiling_rps, 1),
                "cores": b.cores,
                "cpu_ms_per_request": round(b.ms_per_request, 4),
            }
            for b in bounds
        },
    }
