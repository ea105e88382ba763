"""The standard suite (``make bench``): carpool vs naive vs serve-batch vs the offline limit.

All systems run in one Serve instance, one after another, under the same load; the headline
figures are ratios measured in that one run. Steps and why:

1. warm-up: first requests load kernels and fill caches; they are not measured.
2. offline limit: the bare model on the same texts, best batch size (the ceiling).
3. saturation: closed loop at high concurrency; the capacity figure, and the search's guess.
4. SLO search: Poisson open loop; the highest rate whose p99 stays <= 500 ms (the key metric).
5. bursty: on/off arrivals at one common mean rate, to see how each system absorbs bursts.
6. trace: the Azure production trace, scaled, at one common rate.

Budget: about 10-13 minutes on 2 cores (``--quick`` for a 3-4 minute check).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.arrivals import ArrivalSpec
from benchmarks.deploy import (
    METRICS_INTERVAL_MS,
    SYSTEMS,
    Resources,
    ServeCluster,
    SystemSpec,
    carpool_embed_args,
    logical_cpus_needed,
)
from benchmarks.loadgen import LoadGenerator, SloGuard
from benchmarks.offline import measure_offline_limit, texts_of
from benchmarks.runner import Bench, RunRecord, System
from benchmarks.search import Probe, find_max_rate
from benchmarks.targets import make_target
from benchmarks.trace import (
    DEFAULT_TRACE,
    TRACE_ATTRIBUTION,
    TraceScaling,
    load_azure_trace,
    scale_trace,
    trace_workload,
)
from benchmarks.workloads import EmbedMix, embed_workload


class SuiteConfig(BaseModel):
    """Knobs of the standard suite; the defaults are the published configuration."""

    model_config = ConfigDict(extra="forbid")

    systems: list[str] = Field(default_factory=lambda: ["carpool", "naive", "serve-batch"])
    port: int = Field(default=8100, ge=1, le=65535)
    resources: Resources = Field(default_factory=Resources)
    carpool_batching: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of serve.yaml's embedder batching knobs."
    )
    variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Extra carpool deployments 'carpool-<name>' with these batching overrides, "
        "measured in the same run (for tuning).",
    )
    phases: list[Literal["saturation", "search", "bursty", "trace"]] = Field(
        default_factory=lambda: ["saturation", "search", "bursty", "trace"],
        description="Which measured phases to run (the offline limit always runs).",
    )
    seed: int = 0
    pool_requests: int = Field(default=4000, ge=10, description="Distinct requests generated.")
    mix: EmbedMix = Field(default_factory=EmbedMix)
    slo_ms: float = Field(default=500.0, gt=0)
    warmup_s: float = Field(default=4.0, ge=0)
    saturation_concurrency: int = Field(default=32, ge=1)
    saturation_s: float = Field(default=10.0, gt=0)
    probe_requests: int = Field(
        default=300, ge=20, description="Requests per search probe (p99 needs a few hundred)."
    )
    probe_min_s: float = Field(default=12.0, gt=0)
    probe_max_s: float = Field(default=25.0, gt=0)
    max_probes: int = Field(default=6, ge=2)
    offline_texts: int = Field(default=384, ge=16)
    model_seconds: float = Field(
        default=300.0, ge=0, description="Simulated seconds per modelled run (0: no model)."
    )
    offline_batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 16, 32, 64, 128])
    offline_arrival_batch_sizes: list[int] = Field(default_factory=lambda: [4, 32])
    bursty_load: float = Field(
        default=0.4,
        gt=0,
        description="Bursty mean rate as a share of the offline limit (requests/s equivalent).",
    )
    bursty_on_s: float = 2.0
    bursty_off_s: float = 2.0
    bursty_s: float = 20.0
    trace: str = DEFAULT_TRACE
    trace_load: float = Field(
        default=0.4, gt=0, description="Trace mean token rate as a share of the offline limit's."
    )
    trace_s: float = 30.0
    trace_start_s: float = 600.0
    trace_token_scale: float = 0.125
    client_timeout_s: float = 30.0
    connections: int = 256
    progress: bool = True

    @classmethod
    def quick(cls, **overrides: Any) -> SuiteConfig:
        """A 3-4 minute version for checking the harness, not for publishing."""
        values: dict[str, Any] = dict(
            saturation_s=5.0,
            probe_requests=120,
            probe_min_s=5.0,
            probe_max_s=8.0,
            max_probes=3,
            offline_texts=96,
            offline_batch_sizes=[1, 16, 64],
            offline_arrival_batch_sizes=[],
            model_seconds=60.0,
            bursty_s=8.0,
            trace_s=10.0,
            warmup_s=2.0,
        )
        values.update(overrides)
        return cls(**values)


def system_specs(config: SuiteConfig) -> list[SystemSpec]:
    specs = []
    for name in config.systems:
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r}; choose from {sorted(SYSTEMS)}")
        specs.append(SYSTEMS[name])
    base = SYSTEMS["carpool"]
    for variant in config.variants:
        specs.append(
            SystemSpec(
                f"carpool-{variant}",
                f"/embed-{variant}",
                "embed",
                f"carpool with batching overrides {config.variants[variant]}",
                base.build,
            )
        )
    return specs


def overrides_for(config: SuiteConfig) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        name: dict(config.carpool_batching) for name in config.systems if is_carpool(name)
    }
    for variant, knobs in config.variants.items():
        out[f"carpool-{variant}"] = {**config.carpool_batching, **knobs}
    return out


def is_carpool(name: str) -> bool:
    return name == "carpool" or name.startswith("carpool-")


async def _search(
    bench: Bench,
    system: System,
    config: SuiteConfig,
    workload: Any,
    guess: float,
    log: list[str],
    turn: asyncio.Lock,
) -> dict[str, Any]:
    runs: list[RunRecord] = []

    async def probe(rate: float) -> Probe:
        duration = min(max(config.probe_requests / rate, config.probe_min_s), config.probe_max_s)
        arrival = ArrivalSpec(kind="poisson", rate=rate, duration_s=duration, seed=config.seed)
        async with turn:  # one probe on the machine at a time; FIFO makes it round-robin
            run = await bench.run(
                system,
                workload,
                arrival,
                guard=SloGuard(config.slo_ms),
                label=f"{system.name} search {rate:.1f}/s",
                tags={"phase": "search", "rate": rate},
            )
        runs.append(run)
        passed = run.aborted is None and run.summary["slo_p99_ms"] <= config.slo_ms
        run.tags["passed"] = passed
        log.append(
            f"  {system.name} @ {rate:6.2f} req/s: p99 {run.summary['slo_p99_ms']:.0f} ms, "
            f"{run.summary['items_per_s']:.1f} items/s -> {'pass' if passed else 'FAIL'}"
            + (f" ({run.aborted})" if run.aborted else "")
        )
        print(log[-1], flush=True)
        return Probe(rate, passed, run)

    found = await find_max_rate(probe, guess, max_probes=config.max_probes)
    best: RunRecord | None = found.best.info if found.best else None
    return {
        "rate": found.rate,
        "lowest_failing_rate": found.lowest_failing_rate,
        "best": best.to_dict() if best else None,
        "probes": [r.to_dict() for r in runs],
    }


async def run_suite_async(config: SuiteConfig, cluster: ServeCluster, out: dict) -> None:
    specs = system_specs(config)
    overrides = overrides_for(config)
    log: list[str] = out.setdefault("log", [])
    workload = embed_workload(config.pool_requests, config.seed, config.mix)
    out["workload"] = {
        **workload.description,
        "name": workload.name,
        "pool_requests": len(workload.requests),
        "mean_texts_per_request": workload.mean_items(),
        "mean_tokens_per_request_est": workload.mean_tokens(),
    }
    out["systems"] = {
        s.name: {
            "prefix": s.prefix,
            "description": s.description,
            "args": carpool_embed_args(config.resources, overrides.get(s.name))
            if is_carpool(s.name)
            else {"resources": config.resources.model_dump(), **overrides.get(s.name, {})},
        }
        for s in specs
    }
    systems = [
        System(s.name, make_target(s.kind, s.name, s.prefix), app=f"bench-{s.name}") for s in specs
    ]

    async with LoadGenerator(
        cluster.base_url, config.connections, config.client_timeout_s, config.progress
    ) as gen:
        bench = Bench(
            gen,
            metrics_url=f"http://127.0.0.1:{cluster.metrics_port}/metrics",
            metrics_interval_s=METRICS_INTERVAL_MS / 1000,
        )
        for s in systems:
            await gen.wait_ready(s.target.ready_path)

        # 1. warm-up (not measured)
        for s in systems:
            await bench.run(
                s,
                workload,
                ArrivalSpec(kind="closed", concurrency=4, duration_s=config.warmup_s),
                label=f"{s.name} warm-up",
            )

        # 2. offline limit, same texts, same thread count, no serving
        started = time.monotonic()
        offline = await asyncio.to_thread(
            measure_offline_limit,
            texts_of(workload.requests, config.offline_texts),
            config.resources.model,
            config.resources.torch_threads,
            config.offline_batch_sizes,
            config.offline_arrival_batch_sizes,
            config.progress,
        )
        out["offline"] = offline.to_dict()
        best = offline.best
        log.append(
            f"offline limit: {best.items_per_s:.1f} items/s at batch {best.batch_size} "
            f"({time.monotonic() - started:.0f} s)"
        )
        print(log[-1], flush=True)
        limit_rps = best.items_per_s / workload.mean_items()

        # 2b. the same policies in a discrete-event model with the fitted cost (no noise)
        cm = offline.cost_model()
        if cm and config.model_seconds > 0:
            from benchmarks.simulate import CostModel, model_systems
            from carpool.config import CONCURRENT_BATCHES

            started = time.monotonic()
            batching = carpool_embed_args(config.resources, config.carpool_batching)["embedder"][
                "batching"
            ]
            out["model"] = {
                "cost_model": cm,
                "seconds": config.model_seconds,
                "concurrent_batches": CONCURRENT_BATCHES,
                "systems": await asyncio.to_thread(
                    model_systems,
                    workload.requests,
                    CostModel(cm["per_pass_ms"], cm["per_padded_token_ms"]),
                    batching,
                    CONCURRENT_BATCHES,
                    config.slo_ms,
                    max(1, round(cm["pass_overhead_tokens"])),
                    config.model_seconds,
                ),
            }
            log.append(f"model: {time.monotonic() - started:.0f} s")
            print(log[-1], flush=True)

        # 3. saturation (closed loop)
        out["saturation"] = {}
        for s in systems if "saturation" in config.phases else []:
            run = await bench.run(
                s,
                workload,
                ArrivalSpec(
                    kind="closed",
                    concurrency=config.saturation_concurrency,
                    duration_s=config.saturation_s,
                ),
                tags={"phase": "saturation"},
            )
            out["saturation"][s.name] = run.to_dict()
            log.append(
                f"saturation {s.name}: {run.summary['requests_per_s']:.2f} req/s, "
                f"{run.summary['items_per_s']:.1f} items/s, p99 {run.summary['latency_ms']['p99']:.0f} ms"
            )
            print(log[-1], flush=True)

        # 4. SLO search (Poisson). The systems' searches take turns probe by probe, so a burst
        # of load from elsewhere on the machine hits them alike instead of one system's search.
        out["search"] = {}
        turn = asyncio.Lock()

        async def search(s: System) -> None:
            sat = out["saturation"].get(s.name, {}).get("summary", {}).get("requests_per_s")
            # Open-loop capacity sits below closed-loop saturation; 0.7 of it is a fair start.
            guess = max(0.7 * sat if sat else 0.5 * limit_rps, 0.2)
            out["search"][s.name] = await _search(bench, s, config, workload, guess, log, turn)

        if "search" in config.phases:
            await asyncio.gather(*(search(s) for s in systems))
            out["search"] = {s.name: out["search"][s.name] for s in systems}  # stable order

        # 5. bursty at one common mean rate
        bursty_rate = config.bursty_load * limit_rps
        out["bursty"] = {"mean_rate": bursty_rate, "runs": {}}
        for s in systems if "bursty" in config.phases else []:
            run = await bench.run(
                s,
                workload,
                ArrivalSpec(
                    kind="bursty",
                    rate=bursty_rate,
                    duration_s=config.bursty_s,
                    burst_on_s=config.bursty_on_s,
                    burst_off_s=config.bursty_off_s,
                    seed=config.seed,
                ),
                guard=SloGuard(config.slo_ms, max_miss_share=1.0, overload_s=10.0),
                tags={"phase": "bursty"},
            )
            out["bursty"]["runs"][s.name] = run.to_dict()

        # 6. trace replay at one common rate
        if "trace" not in config.phases:
            return
        rows = load_azure_trace(config.trace)
        probe_scaling = TraceScaling(
            rate=1.0,
            duration_s=config.trace_s,
            start_s=config.trace_start_s,
            token_scale=config.trace_token_scale,
        )
        # Mean scaled tokens per request in the window decide the rate for the token budget.
        sample = scale_trace(rows, probe_scaling)
        mean_tokens = sum(min(t, 256) for t in sample.context_tokens) / len(sample.context_tokens)
        trace_rate = config.trace_load * best.tokens_per_s / mean_tokens
        scaled = scale_trace(rows, probe_scaling.model_copy(update={"rate": trace_rate}))
        trace_wl = trace_workload(scaled, "embed", config.seed)
        out["trace"] = {
            "path": config.trace,
            "scaling": scaled.describe(),
            "rate": trace_rate,
            "runs": {},
        }
        for s in systems:
            run = await bench.run(
                s,
                trace_wl,
                ArrivalSpec(kind="replay", duration_s=config.trace_s),
                guard=SloGuard(config.slo_ms, max_miss_share=1.0, overload_s=10.0),
                tags={"phase": "trace"},
            )
            out["trace"]["runs"][s.name] = run.to_dict()


def headline(out: dict[str, Any], slo_ms: float) -> dict[str, Any]:
    """The key metric per system and the ratios (each from this one run)."""
    rows: dict[str, Any] = {}
    for name, search in out.get("search", {}).items():
        best = search.get("best")
        rows[name] = {
            "max_rate_rps": search["rate"],
            "items_per_s": best["summary"]["items_per_s"] if best else 0.0,
            "tokens_per_s": best["summary"]["tokens_per_s"] if best else 0.0,
            "requests_per_s": best["summary"]["requests_per_s"] if best else 0.0,
        }
    offline = out.get("offline", {}).get("best")
    ratios: dict[str, float | None] = {}
    carpool = rows.get("carpool", {}).get("items_per_s")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    if carpool is not None:
        for other in ("naive", "serve-batch"):
            if other in rows:
                ratios[f"carpool / {other}"] = ratio(carpool, rows[other]["items_per_s"])
        if offline:
            ratios["carpool / offline limit"] = ratio(carpool, offline["items_per_s"])
    targets = {"carpool / naive": 3.0, "carpool / serve-batch": 1.5, "carpool / offline limit": 0.8}
    return {
        "slo_ms": slo_ms,
        "rows": rows,
        "offline_items_per_s": offline["items_per_s"] if offline else None,
        "offline_batch_size": offline["batch_size"] if offline else None,
        "ratios": ratios,
        "targets": targets,
        "met": {k: (v is not None and v >= targets[k]) for k, v in ratios.items() if k in targets},
    }


def run_suite(config: SuiteConfig, command: str, out: dict[str, Any] | None = None) -> dict:
    """Starts Ray + Serve, deploys every system, runs the suite, tears down.

    Results accumulate in ``out`` as the suite goes, so a caller keeps what was measured
    even if a later step fails.
    """
    from benchmarks.report import machine_info

    specs = system_specs(config)
    out = {} if out is None else out
    out.update(
        kind="suite",
        command=command,
        config=json.loads(config.model_dump_json()),
        attribution=TRACE_ATTRIBUTION,
    )
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
    out["headline"] = headline(out, config.slo_ms)
    return out
