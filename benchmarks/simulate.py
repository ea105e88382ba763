"""A discrete-event model of the three batching policies, driven by the fitted cost model.

Measured numbers on a shared 2-core machine move with whatever else runs; this model does
not. It replays the same requests and Poisson arrivals through each policy with forward
passes costing ``per_pass + per_token * padded_tokens`` (fitted by ``offline``), using
carpool's real splitters, and finds the highest rate that keeps p99 within the SLO. The gap
between it and a measurement is what serving (HTTP, hops, tokenising, contention) costs;
comparing knob settings here isolates the batching policy itself. It is a model: the
@serve.batch collection is simplified to fixed windows and attention's quadratic term and
the GIL are ignored.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from benchmarks.arrivals import poisson_arrivals
from benchmarks.stats import percentile
from benchmarks.workloads import EmbedRequest, Request


@dataclass(frozen=True)
class CostModel:
    per_pass_ms: float
    per_token_ms: float
    overhead_ms: float = 0.0  # fixed serving latency added to every request (HTTP, hops)

    def pass_ms(self, lengths: Sequence[int]) -> float:
        return self.per_pass_ms + self.per_token_ms * len(lengths) * max(lengths)


@dataclass
class CarpoolKnobs:
    max_batch_size: int = 64
    max_batch_tokens: int = 8192
    batch_wait_timeout_s: float = 0.01
    split_policy: str = "optimal"
    pass_overhead_tokens: int = 64
    concurrent_batches: int = 4


Job = tuple[float, list[int]]  # (arrival s, token lengths)
Policy = Callable[[list[Job], CostModel], list[float]]  # -> completion time per job


def _jobs(requests: Sequence[Request], arrivals: Sequence[float], max_len: int) -> list[Job]:
    out = []
    for t, r in zip(arrivals, requests, strict=True):
        assert isinstance(r, EmbedRequest)
        # est_tokens is the sum; the generator's per-text lengths come back from word counts.
        out.append((t, [min(max_len, len(text.split()) + 2) for text in r.texts]))
    return out


def simulate_naive(jobs: list[Job], cost: CostModel) -> list[float]:
    """FIFO, one pass per request padded to its longest text."""
    free = 0.0
    done = []
    for t, lengths in jobs:
        start = max(free, t)
        free = start + cost.pass_ms(lengths) / 1000
        done.append(free)
    return done


def collect_windows(
    jobs: list[Job], wait_s: float, fits: Callable[[list[int], list[int]], bool]
) -> list[tuple[float, list[int]]]:
    """Batches as Ray 2.60's ``@serve.batch`` forms them: ``(ready time, job indices)``.

    Its loop takes the first queued request, waits ``wait_s`` for more (less if the batch
    fills), hands the batch over and starts the next one at once, whether or not the model
    is free: batches queue on the ``max_concurrent_batches`` semaphore, they do not grow.
    """
    out: list[tuple[float, list[int]]] = []
    i, n, free_at = 0, len(jobs), 0.0
    while i < n:
        start = max(free_at, jobs[i][0])
        batch, sizes = [i], list(jobs[i][1])
        i += 1
        close = start + wait_s
        while i < n and jobs[i][0] <= close and fits(sizes, jobs[i][1]):
            batch.append(i)
            sizes.extend(jobs[i][1])
            i += 1
        full = i < n and jobs[i][0] <= close  # stopped by the size cap, not the clock
        ready = max(start, jobs[i][0]) if full else close
        out.append((ready, batch))
        free_at = ready
    return out


def simulate_serve_batch(
    jobs: list[Job], cost: CostModel, max_texts: int = 32, wait_s: float = 0.01
) -> list[float]:
    """Plain ``@serve.batch``: one batch at a time, one pass padded to its longest text."""
    done = [0.0] * len(jobs)
    free = 0.0
    for ready, batch in collect_windows(
        jobs, wait_s, lambda have, new: len(have) + len(new) <= max_texts
    ):
        lengths = [x for k in batch for x in jobs[k][1]]
        free = max(free, ready) + cost.pass_ms(lengths) / 1000
        for k in batch:
            done[k] = free
    return done


def simulate_carpool(jobs: list[Job], cost: CostModel, knobs: CarpoolKnobs) -> list[float]:
    """carpool's executor: waiting jobs merge into steps, sorted and split into passes.

    At most ``concurrent_batches`` collected batches are inside the executor at once (the
    ``@serve.batch`` semaphore); a batch leaves when all its jobs are done.
    """
    from carpool.batching import make_splitter

    splitter = make_splitter(
        knobs.split_policy, knobs.max_batch_tokens, knobs.max_batch_size, knobs.pass_overhead_tokens
    )
    max_step = knobs.max_batch_size * knobs.concurrent_batches

    def fits(have: list[int], new: list[int]) -> bool:
        items, tokens = len(have) + len(new), sum(have) + sum(new)
        return items <= knobs.max_batch_size and tokens <= knobs.max_batch_tokens

    batches = deque(collect_windows(jobs, knobs.batch_wait_timeout_s, fits))
    batch_of = {k: b for b, (_, ks) in enumerate(batches) for k in ks}
    left_in_batch = {b: len(ks) for b, (_, ks) in enumerate(batches)}
    next_batch = 0
    active = 0
    done = [0.0] * len(jobs)
    waiting: deque[int] = deque()
    now = 0.0
    total = len(batches)
    while next_batch < total or waiting:
        while next_batch < total and active < knobs.concurrent_batches and batches[0][0] <= now:
            _, ks = batches.popleft()
            waiting.extend(ks)
            active += 1
            next_batch += 1
        if not waiting:
            now = max(now, batches[0][0])
            continue
        step, items = [], 0
        while waiting and (not step or items + len(jobs[waiting[0]][1]) <= max_step):
            k = waiting.popleft()
            step.append(k)
            items += len(jobs[k][1])
        refs = [(k, i) for k in step for i in range(len(jobs[k][1]))]
        lengths = [jobs[k][1][i] for k, i in refs]
        remaining = {k: len(jobs[k][1]) for k in step}
        for group in splitter.split(lengths):
            now += cost.pass_ms([lengths[g] for g in group]) / 1000
            for g in group:
                k = refs[g][0]
                remaining[k] -= 1
                if remaining[k] == 0:
                    done[k] = now
                    b = batch_of[k]
                    left_in_batch[b] -= 1
                    if left_in_batch[b] == 0:
                        active -= 1
    return done


@dataclass
class SimResult:
    rate: float
    p50_ms: float
    p99_ms: float
    items_per_s: float


def run_policy(
    policy: Policy,
    requests: Sequence[Request],
    rate: float,
    cost: CostModel,
    seconds: float,
    seed: int = 0,
    max_len: int = 256,
) -> SimResult:
    arrivals = poisson_arrivals(rate, seconds, random.Random(seed))
    reqs = [requests[i % len(requests)] for i in range(len(arrivals))]
    jobs = _jobs(reqs, arrivals, max_len)
    done = policy(jobs, cost)
    lat = [(d - t) * 1000 + cost.overhead_ms for d, (t, _) in zip(done, jobs, strict=True)]
    span = max(done) - arrivals[0] if done else 1.0
    items = sum(len(j[1]) for j in jobs)
    return SimResult(rate, percentile(lat, 50), percentile(lat, 99), items / span)


def max_rate(
    policy: Policy,
    requests: Sequence[Request],
    cost: CostModel,
    slo_ms: float,
    seconds: float = 600.0,
    lo: float = 0.2,
    hi: float = 100.0,
    steps: int = 14,
) -> SimResult | None:
    """Bisection on the rate (the model is deterministic for a seed, so no noise to fight)."""
    best = None
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        r = run_policy(policy, requests, mid, cost, seconds)
        if r.p99_ms <= slo_ms:
            best, lo = r, mid
        else:
            hi = mid
    return best


def model_systems(
    requests: Sequence[Request],
    cost: CostModel,
    carpool_batching: dict,
    concurrent_batches: int,
    slo_ms: float,
    fitted_overhead_tokens: int,
    seconds: float = 300.0,
    overload_rate: float = 60.0,
) -> dict[str, dict[str, float]]:
    """Highest rate within the SLO (and overloaded throughput) for each policy, modelled.

    Besides the three systems as deployed, carpool is modelled with single knob changes
    (and all of them together) so a report can say which ones matter.
    """
    deployed = CarpoolKnobs(
        max_batch_size=int(carpool_batching.get("max_batch_size", 64)),
        max_batch_tokens=int(carpool_batching.get("max_batch_tokens", 8192)),
        batch_wait_timeout_s=float(carpool_batching.get("batch_wait_timeout_s", 0.01)),
        split_policy=str(carpool_batching.get("split_policy", "optimal")),
        pass_overhead_tokens=int(carpool_batching.get("pass_overhead_tokens", 64)),
        concurrent_batches=concurrent_batches,
    )
    what_if = {
        "carpool": deployed,
        "carpool, batch_wait_timeout_s=0": replace(deployed, batch_wait_timeout_s=0.0),
        f"carpool, pass_overhead_tokens={fitted_overhead_tokens}": replace(
            deployed, pass_overhead_tokens=fitted_overhead_tokens
        ),
        "carpool, 64 concurrent batches": replace(deployed, concurrent_batches=64),
        "carpool, all three": replace(
            deployed,
            batch_wait_timeout_s=0.0,
            pass_overhead_tokens=fitted_overhead_tokens,
            concurrent_batches=64,
        ),
    }
    policies: dict[str, Policy] = {"naive": simulate_naive, "serve-batch": simulate_serve_batch}
    for name, knobs in what_if.items():
        policies[name] = lambda jobs, c, k=knobs: simulate_carpool(jobs, c, k)
    out: dict[str, dict[str, float]] = {}
    for name, policy in policies.items():
        best = max_rate(policy, requests, cost, slo_ms, seconds=seconds)
        over = run_policy(policy, requests, overload_rate, cost, 60.0)
        out[name] = {
            "max_rate_rps": best.rate if best else 0.0,
            "items_per_s": best.items_per_s if best else 0.0,
            "p50_ms": best.p50_ms if best else float("nan"),
            "p99_ms": best.p99_ms if best else float("nan"),
            "overload_items_per_s": over.items_per_s,
        }
    return out
