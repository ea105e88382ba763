"""The standard suite (``make bench``): carpool vs naive vs serve-batch vs the offline limit.

All systems run in one Serve instance; only one is under load at a time. Every comparison
is *paired*: the systems take turns in rounds within one run (round 1: A, B, C; round 2:
B, C, A; ...), so a slow spell on the shared machine hits them alike, and every figure is
the median of the rounds with its spread (min-max). Ratios are taken round by round (A's
round r over B's round r) before the median. A measurement window holds at least
``window_requests`` requests or lasts ``window_s`` seconds, whichever comes first.

Phases and why:

1. warm-up (not measured) and the offline limit: the bare model on the same texts (the ceiling).
2. saturation: closed loop, 32 clients that honour Retry-After: each system's capacity.
3. idle: every distinct request of the probe pool alone (concurrency 1) on each system, the
   denominator of a request's *slowdown* (its latency under load over its own idle latency).
4. SLO: the highest Poisson rate whose p99 <= 500 ms, and the highest whose p99 slowdown <= 5
   (an SLO that means the same on a slower or faster machine). Each system's search starts at
   0.7 of its saturation rate and is searched once with short probes (locating only); the
   rates found are then confirmed in paired rounds of full windows, and those are reported.
5. goodput: carpool under clients that ignore Retry-After (closed loop 32 and 300) and Poisson
   at 3x and 10x its capacity: accepted items/s over capacity, the capacity measured again
   (closed loop 32, honouring Retry-After) at the start of each round, next to its windows. Client timeout 120 s, so a
   request that waits in a queue is not counted lost by the client.
6. light load: Poisson at 0.5 of naive's capacity, carpool vs naive, for /embed and /rank.
7. burst (64 requests at once) and bulk (2 clients, 16 texts of ~200 words each) on carpool's
   default knobs: refusals counted; the target is none.

Budget: about 40 minutes on 2 cores (``--quick``: a few-minute check of the harness).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from benchmarks.arrivals import poisson_arrivals
from benchmarks.deploy import (
    SYSTEMS,
    ServeCluster,
    SystemSpec,
    carpool_embed_args,
    carpool_rank_args,
    logical_cpus_needed,
)
from benchmarks.loadgen import Endpoint, LoadGenerator, LoadResult, SloGuard
from benchmarks.offline import measure_offline_limit, texts_of
from benchmarks.search import Probe, find_max_rate
from benchmarks.stats import percentile
from benchmarks.suite_config import SuiteConfig
from benchmarks.suite_figures import (
    headline,
    median_spread,
    round_orders,
    slowdowns,
    window_duration,
    window_summary,
)
from benchmarks.targets import make_target
from benchmarks.workloads import EmbedRequest, Request, embed_workload, synth_text

# --- the run --------------------------------------------------------------------------------


def system_specs(config: SuiteConfig) -> list[SystemSpec]:
    names = list(config.systems)
    if "light" in config.phases:
        names += [n for n in config.rank_systems if n not in names]
    specs = []
    for name in names:
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r}; choose from {sorted(SYSTEMS)}")
        specs.append(SYSTEMS[name])
    base = SYSTEMS["carpool"]
    for variant, knobs in config.variants.items():
        specs.append(
            SystemSpec(
                f"carpool-{variant}",
                f"/embed-{variant}",
                "embed",
                f"carpool with {knobs}",
                base.build,
            )
        )
    return specs


def overrides_for(config: SuiteConfig) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"carpool": dict(config.carpool_batching)}
    for variant, knobs in config.variants.items():
        out[f"carpool-{variant}"] = {**config.carpool_batching, **knobs}
    return out


class Suite:
    """One suite run: the load generator, the endpoints, and the results as they come."""

    def __init__(self, config: SuiteConfig, gen: LoadGenerator, out: dict[str, Any]) -> None:
        self.config, self.gen, self.out = config, gen, out
        self.pool = embed_workload(config.pool_requests, config.seed, config.mix).requests
        self.eps: dict[str, Endpoint] = {}
        self.idle_ms: dict[str, dict[int, float]] = {}
        self.rng = random.Random(config.seed)

    def log(self, line: str) -> None:
        self.out.setdefault("log", []).append(line)
        print(line, flush=True)

    @property
    def embed_systems(self) -> list[str]:
        return [n for n in self.eps if self.eps[n].target.kind == "embed"]

    async def quiesce(self, name: str, timeout_s: float = 60.0) -> None:
        await self.gen.quiesce(self.eps[name].target.stats_path, timeout_s)

    async def paired(
        self, names: Sequence[str], measure: Callable[[str, int], Awaitable[dict[str, Any]]]
    ) -> dict[str, list[dict[str, Any]]]:
        """Runs ``measure(system, round)`` for every system, interleaved in rounds."""
        out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for r, order in enumerate(round_orders(list(names), self.config.rounds)):
            for name in order:
                out[name].append(await measure(name, r))
                await self.quiesce(name)
        return out

    # --- windows --------------------------------------------------------------------------

    async def closed(
        self, name: str, clients: int, backoff_s: float, duration_s: float | None = None
    ) -> dict[str, Any]:
        c = self.config
        duration = duration_s if duration_s is not None else c.window_s
        result = await self.gen.run_closed(
            self.eps[name],
            None,
            clients,
            duration,
            label=f"{name} closed {clients}",
            refusal_backoff_s=backoff_s,
            max_requests=None if duration_s is not None else c.window_requests,
        )
        return window_summary(result.records)

    async def open(
        self, name: str, rate: float, duration_s: float, guard: SloGuard | None = None
    ) -> tuple[LoadResult, list[int]]:
        """Poisson at ``rate`` for ``duration_s`` over the pool; returns the pool key of each."""
        ep = self.eps[name]
        times = poisson_arrivals(rate, duration_s, random.Random(self.rng.random()))
        keys = [self.rng.randrange(len(ep.requests)) for _ in times]
        result = await self.gen.run_open(
            ep.target, [ep.requests[k] for k in keys], times, f"{name} {rate:.2f}/s", guard
        )
        return result, keys

    async def slo_window(self, name: str, rate: float, duration_s: float, guard: bool) -> dict:
        c = self.config
        result, keys = await self.open(
            name, rate, duration_s, SloGuard(c.slo_ms, overload_s=10.0) if guard else None
        )
        summary = window_summary(result.records)
        slow = slowdowns(result.records, keys, self.idle_ms.get(name, {}))
        summary.update(
            rate=rate,
            aborted=result.aborted,
            p99_slowdown=percentile(sorted(slow), 99) if slow else math.nan,
        )
        summary["passed_slo_ms"] = not result.aborted and summary["slo_p99_ms"] <= c.slo_ms
        summary["passed_slowdown"] = (
            not result.aborted and summary["p99_slowdown"] <= c.slo_slowdown
        )
        return summary

    # --- phases ---------------------------------------------------------------------------

    async def saturation(self) -> None:
        c = self.config
        res = await self.paired(self.embed_systems, lambda n, r: self.closed(n, c.concurrency, 0.5))
        self.out["saturation"] = {n: {"windows": w, **self._med(w)} for n, w in res.items()}
        for n, w in res.items():
            self.log(f"saturation {n}: {self._med(w)['items_per_s']['median']:.1f} items/s")

    def _med(self, windows: list[dict[str, Any]]) -> dict[str, Any]:
        keys = ("items_per_s", "requests_per_s", "p50_ms", "p99_ms", "refused", "lost")
        return {k: median_spread([w.get(k) for w in windows]) for k in keys}

    def capacity_rps(self, name: str) -> float | None:
        med = self.out.get("saturation", {}).get(name, {}).get("requests_per_s", {})
        return med.get("median")

    async def idle(self) -> None:
        """Each pool request alone on each system; chunks interleave the systems."""
        c, names = self.config, self.embed_systems
        lat: dict[str, dict[int, list[float]]] = {n: {} for n in names}
        chunk = 25
        for p in range(c.idle_passes):
            for r, start in enumerate(range(0, len(self.pool), chunk)):
                for name in round_orders(names, r + 1 + p)[-1]:
                    ep = self.eps[name]
                    for k in range(start, min(start + chunk, len(self.pool))):
                        body = ep.target.encode(ep.requests[k])
                        t0 = time.perf_counter()
                        rec = await self.gen.send(ep, ep.requests[k], body, k, 0.0, t0)
                        if rec.ok:
                            lat[name].setdefault(k, []).append(rec.latency * 1000)
        self.idle_ms = {n: {k: min(v) for k, v in lat[n].items()} for n in names}
        self.out["idle"] = {
            n: {
                "requests": len(v),
                "p50_ms": percentile(sorted(v.values()), 50),
                "max_ms": max(v.values(), default=math.nan),
            }
            for n, v in self.idle_ms.items()
        }
        self.log(
            "idle p50: "
            + ", ".join(f"{n} {v['p50_ms']:.0f} ms" for n, v in self.out["idle"].items())
        )

    async def search_rates(self, name: str) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The largest rate ``name`` holds for each criterion, from short probes; and the probes."""
        c = self.config
        cache: dict[float, dict[str, Any]] = {}
        probes: list[dict[str, Any]] = []

        async def probe_at(rate: float) -> dict:
            key = round(rate, 3)
            if key not in cache:
                d = min(c.search_requests / rate, c.search_max_s)
                cache[key] = await self.slo_window(name, rate, d, guard=True)
                probes.append(cache[key])
                await self.quiesce(name)
            return cache[key]

        found: dict[str, float] = {}
        guess = 0.7 * (self.capacity_rps(name) or 1.0)  # open loop saturates below closed loop
        for crit in ("slo_ms", "slowdown"):

            async def probe(rate: float, crit: str = crit) -> Probe:
                w = await probe_at(rate)
                return Probe(rate, bool(w[f"passed_{crit}"]), w)

            result = await find_max_rate(probe, guess, c.max_probes, growth=1.4, resolution=0.1)
            found[crit] = result.rate
            guess = result.rate or guess  # the second criterion starts at the first's answer
        self.log(f"slo search {name}: {found}")
        return found, probes

    async def slo(self) -> None:
        """Search once per system and criterion (short probes), then confirm paired; with
        ``slo_rate`` set, no search: every system's windows run at that one offered rate."""
        c = self.config
        found: dict[str, dict[str, float]] = {}
        for name in self.embed_systems:
            if c.slo_rate is None:
                found[name], probes = await self.search_rates(name)
            else:
                found[name], probes = {"slo_ms": c.slo_rate, "slowdown": c.slo_rate}, []
            self.out.setdefault("slo", {})[name] = {"found": found[name], "probes": probes}
        for crit in ("slo_ms", "slowdown"):

            async def confirm(name: str, r: int, crit: str = crit) -> dict[str, Any]:
                rate = found[name][crit]
                if rate <= 0:
                    return {"rate": 0.0, "items_per_s": 0.0, "passed_" + crit: False}
                d = window_duration(rate, c.window_requests, c.window_s)
                return await self.slo_window(name, rate, d, guard=False)

            same = crit == "slowdown" and all(
                abs(f["slowdown"] - f["slo_ms"]) <= 0.1 * max(f["slo_ms"], 1e-9)
                for f in found.values()
            )
            if same:  # both criteria found the same rates: the confirmed windows serve both
                res = {n: self.out["slo"][n]["slo_ms"]["windows"] for n in self.embed_systems}
            else:
                res = await self.paired(self.embed_systems, confirm)
            for name, windows in res.items():
                self.out["slo"][name][crit] = {
                    "rate": found[name][crit],
                    "windows": windows,
                    "passed_rounds": sum(1 for w in windows if w.get(f"passed_{crit}")),
                    **self._med(windows),
                }
                self.log(
                    f"slo {crit} {name} @ {found[name][crit]:.2f} req/s: "
                    f"{self._med(windows)['items_per_s']['median']:.1f} items/s"
                )

    async def goodput(self) -> None:
        c = self.config
        names = [n for n in c.goodput_systems if n in self.eps]
        names += [f"carpool-{v}" for v in c.variants if "carpool" in names]
        res: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
        for r in range(c.rounds):
            for name in round_orders(names, r + 1)[-1]:
                # The denominator is measured here, just before the overload windows it divides:
                # the saturation phase ran half an hour earlier, and this machine drifts more
                # than the effect under test between the two (full run 14:12: 10x read 0.80 of a
                # capacity taken at saturation, closed 32 read 0.92 of it, although closed 32
                # *is* capacity once Retry-After is honoured).
                w = await self.closed(name, c.concurrency, 0.5, c.goodput_closed_s)
                res[name].setdefault("capacity", []).append(w)
                await self.quiesce(name)
                cap = w["requests_per_s"] or self.capacity_rps(name) or 1.0
                for clients in c.goodput_clients:
                    w = await self.closed(name, clients, 0.0, c.goodput_closed_s)
                    res[name].setdefault(f"closed_{clients}", []).append(w)
                    await self.quiesce(name)
                for load in c.goodput_loads:
                    result, _ = await self.open(name, load * cap, c.goodput_open_s)
                    w = window_summary(result.records)
                    w["offered_load"] = load
                    res[name].setdefault(f"open_{load:g}x", []).append(w)
                    await self.quiesce(name)
        self.out["goodput"] = {
            n: {k: {"windows": w, **self._med(w)} for k, w in runs.items()}
            for n, runs in res.items()
        }
        for n, runs in res.items():
            for k, w in runs.items():
                m = self._med(w)
                self.log(
                    f"goodput {n} {k}: {m['items_per_s']['median']:.1f} items/s, "
                    f"refused {m['refused']['median']}, lost {m['lost']['median']}"
                )

    async def light(self) -> None:
        c = self.config
        pairs = [("carpool", "naive"), tuple(c.rank_systems)]
        self.out["light"] = {}
        for a, b in pairs:
            if a not in self.eps or b not in self.eps:
                continue
            cap = self.capacity_rps(b)
            if cap is None:  # rank: naive's capacity is not measured by the saturation phase
                w = await self.closed(b, 8, 0.5, min(c.window_s, 30.0))
                cap = w["requests_per_s"]
                self.out["light"][f"{b}_capacity"] = w
            rate = c.light_load * cap
            d = window_duration(rate, c.window_requests, c.window_s)

            async def measure(name: str, r: int, rate: float = rate, d: float = d) -> dict:
                result, _ = await self.open(name, rate, d)
                return {**window_summary(result.records), "rate": rate}

            res = await self.paired([a, b], measure)
            for n, windows in res.items():
                self.out["light"][n] = {"rate": rate, "windows": windows, **self._med(windows)}
            self.log(
                f"light {a} vs {b} @ {rate:.2f} req/s: p50 "
                f"{self._med(res[a])['p50_ms']['median']:.0f} vs "
                f"{self._med(res[b])['p50_ms']['median']:.0f} ms"
            )

    async def burst(self) -> None:
        """``burst_requests`` mixed requests all at once, once per round (carpool)."""
        c, ep = self.config, self.eps["carpool"]
        windows = []
        for r in range(c.rounds):
            requests = [
                ep.requests[(r * c.burst_requests + i) % len(ep.requests)]
                for i in range(c.burst_requests)
            ]
            result = await self.gen.run_open(ep.target, requests, [0.0] * len(requests), "burst")
            w = window_summary(result.records)
            w["texts"] = sum(q.items for q in requests)
            windows.append(w)
            await self.quiesce("carpool")
        self.out["burst"] = {"windows": windows, **self._med(windows)}
        self.log(f"burst: refused {[w['refused'] for w in windows]} of {c.burst_requests}")

    async def bulk(self) -> None:
        """Clients sending ``bulk_texts`` long texts per request, honouring Retry-After."""
        c, ep = self.config, self.eps["carpool"]
        rng = random.Random(c.seed)
        words = round(c.bulk_words / 1.3)  # synth_text counts tokens; ~1.3 tokens per word
        reqs: list[Request] = [
            EmbedRequest(
                tuple(synth_text(words, rng) for _ in range(c.bulk_texts)),
                c.bulk_texts * c.bulk_words,
            )
            for _ in range(8)
        ]
        bulk = Endpoint("carpool", ep.target, reqs)
        result = await self.gen.run_closed(bulk, None, c.bulk_clients, c.bulk_s, "bulk", 1.0)
        w = window_summary(result.records)
        self.out["bulk"] = {"windows": [w], **self._med([w])}
        await self.quiesce("carpool")
        self.log(f"bulk: {w['ok']} ok, refused {w['refused']}")


async def run_suite_async(config: SuiteConfig, cluster: ServeCluster, out: dict) -> None:
    specs = system_specs(config)
    overrides = overrides_for(config)
    async with LoadGenerator(
        cluster.base_url, config.connections, config.client_timeout_s, config.progress
    ) as gen:
        suite = Suite(config, gen, out)
        rank_pool = _rank_pool(config)
        for s in specs:
            target = make_target(s.kind, s.name, s.prefix)
            suite.eps[s.name] = Endpoint(
                s.name, target, rank_pool if s.kind == "rank" else suite.pool
            )
        out["workload"] = {
            "embed": {**config.mix.model_dump(), "pool_requests": len(suite.pool)},
            "mean_texts_per_request": sum(r.items for r in suite.pool) / len(suite.pool),
        }
        out["systems"] = {
            s.name: {
                "prefix": s.prefix,
                "description": s.description,
                "args": carpool_embed_args(config.resources, overrides.get(s.name))
                if s.name.startswith("carpool") and s.kind == "embed"
                else carpool_rank_args(config.resources)
                if s.kind == "rank"
                else {"resources": config.resources.model_dump()},
            }
            for s in specs
        }
        for ep in suite.eps.values():
            await gen.wait_ready(ep.target.ready_path)
        for name in suite.eps:  # warm-up: kernels, caches, the replicas' cost models
            await gen.run_closed(suite.eps[name], None, 4, config.warmup_s, f"{name} warm-up")
        started = time.monotonic()
        offline = await asyncio.to_thread(
            measure_offline_limit,
            texts_of(suite.pool, config.offline_texts),
            config.resources.model,
            config.resources.torch_threads,
            config.offline_batch_sizes,
            [],
            config.progress,
        )
        out["offline"] = offline.to_dict()
        suite.log(
            f"offline limit: {offline.best.items_per_s:.1f} items/s at batch "
            f"{offline.best.batch_size} ({time.monotonic() - started:.0f} s)"
        )
        if "model" in config.phases:
            await _model_phase(config, suite, offline)
        for phase in ("saturation", "slo", "goodput", "light", "burst", "bulk"):
            if phase in config.phases:
                t = time.monotonic()
                if phase == "slo":
                    await suite.idle()
                await getattr(suite, phase)()
                out.setdefault("phase_s", {})[phase] = round(time.monotonic() - t, 1)


def _rank_pool(config: SuiteConfig) -> list[Request]:
    from benchmarks.reliability.load import LIGHT_RANK
    from benchmarks.workloads import rank_workload

    return rank_workload(min(config.pool_requests, 100), config.seed, LIGHT_RANK).requests


async def _model_phase(config: SuiteConfig, suite: Suite, offline: Any) -> None:
    """The same policies in a discrete-event model with the fitted cost (no noise)."""
    from benchmarks.simulate import CostModel, model_systems
    from carpool.config import CONCURRENT_BATCHES

    cm = offline.cost_model()
    if not cm or config.model_seconds <= 0:
        return
    batching = carpool_embed_args(config.resources, config.carpool_batching)["embedder"]["batching"]
    suite.out["model"] = {
        "cost_model": cm,
        "seconds": config.model_seconds,
        "systems": await asyncio.to_thread(
            model_systems,
            suite.pool,
            CostModel(cm["per_pass_ms"], cm["per_padded_token_ms"]),
            batching,
            CONCURRENT_BATCHES,
            config.slo_ms,
            max(1, round(cm["pass_overhead_tokens"])),
            config.model_seconds,
        ),
    }


def run_suite(config: SuiteConfig, command: str, out: dict[str, Any] | None = None) -> dict:
    """Starts Ray + Serve, deploys every system, runs the suite, tears down.

    Results accumulate in ``out`` as the suite goes, so a caller keeps what was measured
    even if a later step fails.
    """
    from benchmarks.report import machine_info

    specs = system_specs(config)
    out = {} if out is None else out
    out.update(kind="suite", command=command, config=json.loads(config.model_dump_json()))
    started = time.time()
    out["started_at"] = started
    out["machine_before"] = machine_info()
    cluster = ServeCluster(config.port, logical_cpus_needed(specs, config.resources))
    try:
        cluster.start()
        t = time.monotonic()
        cluster.deploy(specs, config.resources, overrides_for(config))
        out.setdefault("log", []).append(
            f"deployed {len(specs)} apps in {time.monotonic() - t:.0f} s"
        )
        asyncio.run(run_suite_async(config, cluster, out))
    finally:
        cluster.shutdown()
        out["duration_s"] = time.time() - started
        out["machine_after"] = machine_info()
        out["headline"] = headline(out)
    return out
