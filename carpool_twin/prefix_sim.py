"""The placement twin: a replay through a router onto replicas that cache prefixes.

Each replica is a ``carpool_twin.prefix_engine.Engine`` (vLLM's prefix cache and step
scheduler); a policy (``carpool_twin.prefix_policies``: carpool's own router among them)
places each request as it arrives; a step costs what a cost profile says for its tokens
(``profile_step_cost``), times ``scale``. Replicas that share a host's cores (this box: 2
cores for 2 or 4 engines) run as processor sharing: while ``n`` engines are mid-step each
computes at ``min(1, host_cores / n)`` of its speed, so a replica that works alone works
faster than four that work at once. On GPUs (``host_cores`` None) each engine has its own
device.

Figures are the benchmark's (``benchmarks.prefix_replay.summarize``): TTFT from the send to
the first token, TPOT over the rest, each replica's prompt tokens found cached over its
prompt tokens. Deterministic for given inputs; no threads, no sleeping, no Ray.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from carpool_twin.mooncake import TraceRequest
from carpool_twin.prefix_engine import Engine, EngineSpec, Step, StepCost
from carpool_twin.prefix_policies import Placement, make_policy, placement_settings
from carpool_twin.profile import predict_ms
from carpool_twin.replicas import decode_cost
from carpool_twin.sim import percentile
from router.placement import PlacementSettings


def profile_step_cost(
    entry: Mapping[str, Any],
    scale: float = 1.0,
    noise: float = 0.0,
    seed: int = 0,
    prefill_ratio: float = 1.0,
) -> StepCost:
    """A vLLM step's milliseconds from a profile's generator entry, times ``scale``.

    The profile timed carpool's engine, which runs a step as two passes: a decode pass over
    the decoding sequences (by batch and KV tokens read, through the measured points) and a
    prefill pass over the prompt chunks (by tokens, rows and attention: each chunk's tokens
    times the context it attends to), each with a fixed cost of its own. vLLM runs one pass
    over all of a step's tokens, so a step that carries both pays the fixed cost once: the
    decode pass, plus the prefill pass less its fit's constant. (Priced as two passes, a
    step that carries a prompt would cost a whole prefill pass more, 36 ms on the H200
    profile against a 23 ms decode step, and the twin would reward routers that bunch
    prompts into fewer steps, which vLLM does not.) ``prefill_ratio`` scales the prefill
    part: another engine's prefill may be cheaper against its decode than the profiled one's.

    ``noise``: each step costs a log-normal factor of this spread more or less (``seed``
    draws them), as repeated passes do: near saturation a queue's figures depend on such
    small differences, so a figure is read over several seeds."""
    decode = decode_cost(entry["decode"], "points")
    prefill = entry["prefill"]
    fixed = float(prefill["fits"][prefill["use"]]["coef"].get("const", 0.0))
    rng = random.Random(seed)

    def cost(step: Step) -> float:
        ms = 0.0
        if step.decode_batch:
            ms += decode({"batch": step.decode_batch, "kv_tokens": step.decode_kv_tokens})
        if step.prefill_rows:
            features = {
                "tokens": step.prefill_tokens,
                "rows": step.prefill_rows,
                "attention": step.prefill_attention,
            }
            own = predict_ms(prefill, features) - (fixed if step.decode_batch else 0.0)
            ms += prefill_ratio * max(0.0, own)
        return scale * ms * (rng.lognormvariate(0.0, noise) if noise else 1.0)

    return cost


@dataclass
class _Request:
    req: TraceRequest
    replica: str = ""
    first: float | None = None
    done: float | None = None


class _Host:
    """Processor sharing over ``cores`` (None: every engine has its own device)."""

    def __init__(self, cores: float | None, at: Callable[[float, Callable[[], None]], None]):
        self.cores = cores
        self.at = at
        self.left_ms: dict[str, float] = {}  # engine -> work left in its step (full speed)
        self.ends: dict[str, Callable[[], None]] = {}
        self.last = 0.0
        self.version = 0

    def _rate(self) -> float:
        n = len(self.left_ms)
        return 1.0 if self.cores is None or n == 0 else min(1.0, self.cores / n)

    def _advance(self, now: float) -> None:
        done = (now - self.last) * 1000 * self._rate()
        for name in self.left_ms:
            self.left_ms[name] -= done
        self.last = now

    def _plan(self, now: float) -> None:
        self.version += 1
        version, rate = self.version, self._rate()
        for name, left in self.left_ms.items():
            ends = now + max(0.0, left) / 1000 / rate
            self.at(ends, lambda n=name, v=version, t=ends: self._end(n, v, t))

    def _end(self, name: str, version: int, now: float) -> None:
        if version != self.version or name not in self.left_ms:
            return  # another engine started or ended since: this end was re-planned
        self._advance(now)
        del self.left_ms[name]
        self._plan(now)
        self.ends.pop(name)()

    def run(self, now: float, name: str, ms: float, end: Callable[[], None]) -> None:
        """Engine ``name`` starts a step of ``ms`` (at full speed); ``end`` when it is done."""
        if self.cores is None:
            self.at(now + ms / 1000, end)
            return
        self._advance(now)
        self.left_ms[name] = ms
        self.ends[name] = end
        self._plan(now)


@dataclass
class ReplayResult:
    """One replay's figures, named as the benchmark's JSON names them."""

    requests: int
    answered: int
    ttft_ms: dict[str, float]
    tpot_ms_mean: float
    e2e_s_mean: float
    tokens_per_s: float
    wall_s: float
    replica_prefix_hit_rate: dict[str, float]
    prefix_hit_rate: float  # over every replica's prompt tokens
    placed: dict[str, int]
    preempted: int
    busy: dict[str, float] = field(default_factory=dict)  # share of the replay in steps

    @property
    def hit_rate_mean(self) -> float:
        rates = list(self.replica_prefix_hit_rate.values())
        return statistics.fmean(rates) if rates else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items()}
        out["replica_prefix_hit_rate_mean"] = self.hit_rate_mean
        return _rounded(out)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


class SimClock:
    """The twin's time, for policies that read a clock (carpool's router dates its bookings)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PrefixCluster:
    """Replicas behind one placement policy; ``run`` replays requests through them.

    ``clock``: the one the policy was built with, so that it reads the twin's time."""

    def __init__(
        self,
        engines: Sequence[Engine],
        policy: Placement,
        host_cores: float | None = None,
        path_ms: float = 0.0,
        clock: SimClock | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a cluster needs at least one replica")
        self.engines = list(engines)
        self.policy = policy
        self.path_ms = path_ms  # the hops before a replica (HTTP, the router's call)
        self.clock = clock or SimClock()
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.host = _Host(host_cores, self.at)
        self._left = 0
        self._busy: dict[str, float] = {e.name: 0.0 for e in self.engines}
        self._started: dict[str, float] = {}

    @property
    def now(self) -> float:
        return self.clock.now

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def _poll(self, engine: Engine) -> None:
        """A replica's report reaches the policy; the next one a period later."""
        self.policy.poll(engine.name, engine.report(self.now))
        if self._left and self.policy.period_s:
            self.at(self.now + self.policy.period_s, lambda: self._poll(engine))

    def _arrive(self, rec: _Request) -> None:
        engine = self.policy.choose(rec.req.prompt, rec.req.max_tokens, self.engines)
        rec.replica = engine.name
        engine.add(rec, rec.req.prompt, rec.req.max_tokens, self.now)
        self._kick(engine)

    def _kick(self, engine: Engine) -> None:
        if engine.busy:
            return
        step = engine.plan()
        if step is None:
            return
        self._started[engine.name] = self.now
        self.host.run(self.now, engine.name, engine.cost(step), lambda: self._end(engine, step))

    def _end(self, engine: Engine, step: Step) -> None:
        self._busy[engine.name] += self.now - self._started.pop(engine.name)
        events = engine.finish(step)
        for rec in events.first:
            rec.first = self.now
        for rec in events.done:
            rec.done = self.now
            self._left -= 1
        self._kick(engine)

    def run(self, requests: Sequence[TraceRequest]) -> ReplayResult:
        records = [_Request(r) for r in requests]
        self._left = len(records)
        for rec in records:
            self.at(rec.req.at + self.path_ms / 1000, lambda rec=rec: self._arrive(rec))
        if self.policy.period_s:
            # Serve polls each replica on its own timer: spread over one period.
            n = len(self.engines)
            for i, engine in enumerate(self.engines):
                phase = self.policy.period_s * i / n
                self.at(phase, lambda engine=engine: self._poll(engine))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            self.clock.now = t
            fn()
        return self._result(records)

    def _result(self, records: list[_Request]) -> ReplayResult:
        ok = [r for r in records if r.first is not None and r.done is not None]
        sent = [r.req.at for r in records]
        ttft = [(r.first - r.req.at) * 1000 for r in ok]  # type: ignore[operator]
        tpot = [
            (r.done - r.first) * 1000 / (r.req.max_tokens - 1)  # type: ignore[operator]
            for r in ok
            if r.req.max_tokens > 1
        ]
        start = min(sent, default=0.0)
        end = max((r.done for r in ok), default=start)  # type: ignore[type-var]
        span = max(1e-9, end - start)  # type: ignore[operator]
        prompt = sum(e.prompt_tokens for e in self.engines)
        cached = sum(e.cached_tokens for e in self.engines)
        placed: dict[str, int] = {e.name: 0 for e in self.engines}
        for r in records:
            placed[r.replica] = placed.get(r.replica, 0) + 1
        return ReplayResult(
            requests=len(records),
            answered=len(ok),
            ttft_ms={
                "mean": statistics.fmean(ttft) if ttft else math.nan,
                "p50": percentile(ttft, 50),
                "p90": percentile(ttft, 90),
                "p99": percentile(ttft, 99),
            },
            tpot_ms_mean=statistics.fmean(tpot) if tpot else math.nan,
            e2e_s_mean=statistics.fmean(r.done - r.req.at for r in ok) if ok else math.nan,  # type: ignore[operator]
            tokens_per_s=sum(r.req.max_tokens for r in ok) / span,
            wall_s=span,
            replica_prefix_hit_rate={e.name: e.hit_rate for e in self.engines},
            prefix_hit_rate=cached / prompt if prompt else 0.0,
            placed=placed,
            preempted=sum(e.preempted for e in self.engines),
            busy={name: t / span for name, t in self._busy.items()},
        )


def replay(
    requests: Sequence[TraceRequest],
    policy: str,
    replicas: int,
    spec: EngineSpec,
    cost: StepCost,
    host_cores: float | None = None,
    settings: PlacementSettings | None = None,
    period_s: float = 0.5,
    seed: int = 0,
    path_ms: float = 0.0,
) -> ReplayResult:
    """``requests`` through the policy named ``policy`` onto ``replicas`` fresh engines."""
    clock = SimClock()
    engines = [Engine(f"r{i}", spec, cost) for i in range(replicas)]
    placement = make_policy(policy, clock, settings, period_s, seed)
    return PrefixCluster(engines, placement, host_cores, path_ms, clock).run(requests)


# --- engines from a serve config, and replays priced from a profile --------------------------

GIB = 1 << 30
# vLLM's KV block when the config names none: its CPU backend's default, and CUDA's.
BLOCK_TOKENS = {"cpu": 128, "cuda": 16}
# vLLM's step budget when the config names none: carpool builds AsyncLLM in its engine
# context, for which vLLM's platform defaults do not apply (SchedulerConfig's 2048).
DEFAULT_BATCHED_TOKENS = 2048
# The Mooncake replay's text in SmolLM2's tokenizer: 286 prompts of the 2% replay, 1,109.5
# characters and 495.0 tokens each on average (the packaged model's tokenizer.json,
# 2026-11-30). The words are made-up syllables, so a token is shorter than English's 4.
REPLAY_CHARS_PER_TOKEN = 2.241
# Each step's cost varies by this log-normal spread: the profile's repeats of one pass shape
# spread 2-5% (its ``samples_ms``), more on a loaded box.
STEP_NOISE = 0.05


def _generate_args(config: Mapping[str, Any]) -> dict[str, Any]:
    for app in config.get("applications") or []:
        if "small" in (app.get("args") or {}):
            return app["args"]
    raise ValueError("the serve config has no application whose args configure 'small'")


def engine_spec(
    config: Mapping[str, Any], entry: Mapping[str, Any], device: str, chars_per_token: float
) -> EngineSpec:
    """The small generator's engine as the config sets it (vLLM's defaults where it does not)."""
    vllm = _generate_args(config)["small"].get("vllm") or {}
    gib = vllm.get("kv_cache_memory_gib") or vllm.get("cpu_kvcache_space_gib") or 4
    block = int(vllm.get("block_size") or BLOCK_TOKENS[device])
    return EngineSpec(
        block_tokens=block,
        num_blocks=int(gib * GIB // (block * int(entry["kv_bytes_per_token"]))),
        max_num_seqs=int(vllm.get("max_num_seqs") or 256),
        max_batched_tokens=int(vllm.get("max_num_batched_tokens") or DEFAULT_BATCHED_TOKENS),
        chars_per_token=chars_per_token,
    )


def config_placement(config: Mapping[str, Any]) -> tuple[PlacementSettings, float]:
    return placement_settings(_generate_args(config).get("placement"))


@dataclass(frozen=True)
class Pricing:
    """How the twin prices steps: a profile entry, a factor, noise and the seeds read."""

    entry: Mapping[str, Any]
    scale: float = 1.0
    noise: float = STEP_NOISE
    seeds: int = 5
    prefill_ratio: float = 1.0  # the prefill pass's factor against the decode pass's

    def at(self, scale: float) -> Pricing:
        return replace(self, scale=scale)


def replays(
    requests: Sequence[TraceRequest],
    policy: str,
    replicas: int,
    spec: EngineSpec,
    pricing: Pricing,
    host_cores: float | None,
    settings: PlacementSettings | None = None,
    period: float = 0.5,
) -> list[ReplayResult]:
    """One replay per seed (step noise and any random choice of the policy)."""
    return [
        replay(
            requests,
            policy,
            replicas,
            spec,
            profile_step_cost(
                pricing.entry, pricing.scale, pricing.noise, seed, pricing.prefill_ratio
            ),
            host_cores,
            settings,
            period,
            seed,
        )
        for seed in range(pricing.seeds)
    ]


def median(results: Sequence[ReplayResult], figure: Callable[[ReplayResult], float]) -> float:
    return statistics.median(figure(r) for r in results)
