"""Which replica a request reaches, in the placement twin: carpool's router and two others.

- ``carpool``: carpool's own router, ``router.placement.PlacementPolicy``, called as
  ``router.replica_router`` calls it: each replica's latest report (polled every
  ``stats_period_s``, as Serve's ``request_routing_stats_period_s`` does) into ``sync``, then
  ``choose(prompt, candidates, max_tokens)``. The twin keeps no copy of its rule.
- ``leastconn``: HAProxy's fewest open connections (the requests in each replica), round
  robin among equals: the default before placement existed, blind to prompts.
- ``pow2``: Serve's power of two choices: two replicas at random, the one with fewer
  requests.
- ``affinity``: prefix affinity alone, Ray Serve LLM's ``PrefixCacheAffinityRouter`` with its
  defaults (``match_rate_threshold`` 0.1, ``imbalanced_threshold`` infinite, no eviction).
  Its rule, from Ray's source: match the prompt, character by character, against every
  prompt sent to each replica; if the longest match covers at least 10% of the prompt, the
  replicas holding that longest match are the candidates, else the replicas to which the
  fewest characters were sent; of the candidates, the one with the fewest requests. Ray is not
  imported (its router needs a cluster and a tree actor); the rule is small and stated here.
- ``affinity-pick-only``: the same router as carpool's HAProxy path asks it, through
  ``DeploymentHandle.choose_replica(_reserve=False)`` (``pipelines.placement``): Serve then
  takes the first replica of the router's first candidate list, without comparing request
  counts, and never calls the router's ``on_request_routed``, which is where Ray inserts a
  prompt into its tree. The tree stays empty, every prompt matches nothing, every replica is
  a smallest tenant, and the first of them takes every request: what the on-box
  ``ray-prefix`` runs measured (one replica served all prompt tokens).

A policy sees the replicas' engines (``carpool_twin.prefix_engine.Engine``) only through
their request counts and reports, as the real routers see the replicas.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, Protocol

from carpool_twin.prefix_engine import Engine
from router.placement import PlacementPolicy, PlacementSettings

POLICIES = ("carpool", "leastconn", "pow2", "affinity", "affinity-pick-only")
# Ray's PrefixCacheAffinityRouter default: below this share of the prompt matched, place by
# the smallest tenant instead.
RAY_MATCH_RATE_THRESHOLD = 0.1


class Placement(Protocol):
    """A request router: picks one of ``replicas`` for a prompt."""

    name: str
    # How often replicas report to it (seconds); None: it reads nothing but request counts.
    period_s: float | None

    def poll(self, replica: str, report: dict[str, Any]) -> None:
        """A replica's report arrives (only for policies with a ``period_s``)."""
        ...

    def choose(self, text: str, max_tokens: int, replicas: Sequence[Engine]) -> Engine: ...


class LeastConn:
    """HAProxy ``balance leastconn``: fewest requests, round robin among equals."""

    name = "leastconn"
    period_s = None

    def __init__(self) -> None:
        self._next = 0

    def poll(self, replica: str, report: dict[str, Any]) -> None:
        pass

    def choose(self, text: str, max_tokens: int, replicas: Sequence[Engine]) -> Engine:
        n = len(replicas)
        order = [replicas[(self._next + i) % n] for i in range(n)]
        best = min(order, key=lambda r: r.ongoing)
        self._next = (replicas.index(best) + 1) % n
        return best


class PowerOfTwo:
    """Serve's default request router: the less loaded of two random replicas."""

    name = "pow2"
    period_s = None

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def poll(self, replica: str, report: dict[str, Any]) -> None:
        pass

    def choose(self, text: str, max_tokens: int, replicas: Sequence[Engine]) -> Engine:
        pick = self.rng.sample(list(replicas), min(2, len(replicas)))
        return min(pick, key=lambda r: r.ongoing)


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Tenant:
    """The prompts one replica was sent: sorted, so a prompt's longest match with any of them
    is with a neighbour in that order; and the characters of the tree they make (Ray's
    ``tenant_to_char_count``: each prompt adds what no earlier one shared)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.chars = 0

    def _neighbours(self, text: str) -> tuple[int, int]:
        i = bisect.bisect_left(self.texts, text)
        before = _common(text, self.texts[i - 1]) if i > 0 else 0
        after = _common(text, self.texts[i]) if i < len(self.texts) else 0
        return i, max(before, after)

    def match(self, text: str) -> int:
        return self._neighbours(text)[1]

    def insert(self, text: str) -> None:
        i, shared = self._neighbours(text)
        if i < len(self.texts) and self.texts[i] == text:
            return
        self.texts.insert(i, text)
        self.chars += len(text) - shared


class PrefixAffinity:
    """Ray's ``PrefixCacheAffinityRouter`` rule with its defaults (module docstring).

    ``pick_only``: as a caller that takes the first candidate and reports no routing."""

    period_s = None

    def __init__(
        self, match_rate_threshold: float = RAY_MATCH_RATE_THRESHOLD, pick_only: bool = False
    ) -> None:
        self.threshold = match_rate_threshold
        self.pick_only = pick_only
        self.name = "affinity-pick-only" if pick_only else "affinity"
        self.tenants: dict[str, _Tenant] = {}

    def poll(self, replica: str, report: dict[str, Any]) -> None:
        pass

    def choose(self, text: str, max_tokens: int, replicas: Sequence[Engine]) -> Engine:
        tenants = [self.tenants.setdefault(r.name, _Tenant()) for r in replicas]
        matched = [t.match(text) for t in tenants]
        longest = max(matched)
        if text and longest / len(text) >= self.threshold:
            candidates = [r for r, m in zip(replicas, matched, strict=True) if m == longest]
        else:
            fewest = min(t.chars for t in tenants)
            candidates = [r for r, t in zip(replicas, tenants, strict=True) if t.chars == fewest]
        if self.pick_only:
            return candidates[0]
        best = min(candidates, key=lambda r: r.ongoing)
        self.tenants[best.name].insert(text)  # Ray inserts the prompt once it is routed
        return best


class CarpoolPlacement:
    """carpool's router (``router.placement.PlacementPolicy``) on the twin's clock."""

    name = "carpool"

    def __init__(
        self,
        settings: PlacementSettings,
        clock: Callable[[], float],
        period_s: float = 0.5,
    ) -> None:
        self.policy = PlacementPolicy(settings, clock=clock)
        self.period_s: float | None = period_s
        self.reports: dict[str, dict[str, Any]] = {}

    def poll(self, replica: str, report: dict[str, Any]) -> None:
        self.reports[replica] = report

    def choose(self, text: str, max_tokens: int, replicas: Sequence[Engine]) -> Engine:
        by_name = {r.name: r for r in replicas}
        # As router.replica_router: every live replica's latest report (an empty dict until
        # its first), then the choice among the candidates.
        self.policy.sync({name: dict(self.reports.get(name, {})) for name in by_name})
        placement = self.policy.choose(text, list(by_name), float(max_tokens))
        return by_name[placement.replica]


def placement_settings(args: dict[str, Any] | None) -> tuple[PlacementSettings, float]:
    """``PlacementSettings`` and the report period from a serve config's ``placement`` args
    (``pipelines.placement.PlacementArgs``' fields; the twin does not import pipelines/)."""
    args = dict(args or {})
    period = float(args.pop("stats_period_s", 0.5))
    known = {f.name for f in fields(PlacementSettings)}
    return PlacementSettings(**{k: v for k, v in args.items() if k in known}), period


def make_policy(
    name: str,
    clock: Callable[[], float],
    settings: PlacementSettings | None = None,
    period_s: float = 0.5,
    seed: int = 0,
) -> Placement:
    """A policy by name (``POLICIES``)."""
    if name == "carpool":
        return CarpoolPlacement(settings or PlacementSettings(), clock, period_s)
    if name == "leastconn":
        return LeastConn()
    if name == "pow2":
        return PowerOfTwo(seed)
    if name in ("affinity", "affinity-pick-only"):
        return PrefixAffinity(pick_only=name == "affinity-pick-only")
    raise ValueError(f"unknown placement policy {name!r}; use one of {list(POLICIES)}")
