"""The discrete-event twin of a carpool cluster: ingress, router and model replicas.

A request goes through the serving path's CPU stages (``Overheads.path``, from
``carpool_twin.path``: the node's HTTP process, its pipeline's ingress replicas), a fixed
serving latency (hops, serialisation), the router when it asks for ``model: auto`` (the
router's own flow, ``router.core.RouterServer``'s ``plan`` / ``after_answer`` / ``finish`` and
its ``router.gate`` admission, driven by events), then a deployment's replicas, picked the way
Serve's router does (the less loaded of two, within ``max_ongoing_requests``; beyond that
requests queue in the handle up to ``max_queued_requests``). Replicas are ``carpool_twin.replicas``:
carpool's admission, executor planning and step scheduler, with profile-priced passes.

Load is open (a list of ``(arrival_s, SimRequest)``, e.g. Poisson or a trace) or closed
(``clients`` each sending the next request when the last is answered, honouring Retry-After
or not). ``Twin.run`` returns a ``SimResult``: goodput, p50/p99 latency, TTFT and TPOT for
generation, refusals. Deterministic for given inputs; no Ray, no threads, no sleeping.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.errors import RequestError
from carpool.generation.schemas import GenerationCall
from carpool_twin.replicas import EncoderReplica, GeneratorReplica, SimRequest, Work
from router.choice import LARGE, SMALL, SmallOutcome
from router.core import RouterServer, share_of_cap

Replica = EncoderReplica | GeneratorReplica


@dataclass
class Pool:
    """One deployment: its replicas and Serve's per-replica bounds."""

    name: str
    replicas: list[Replica]
    max_ongoing_requests: int = 512
    max_queued_requests: int = -1  # -1: unbounded, Serve's default
    waiting: deque[_Ticket] = field(default_factory=deque)


@dataclass(frozen=True)
class PathStage:
    """A serving-path component: ``servers`` cores, each busy ``ms[kind]`` per request."""

    name: str
    servers: int
    ms: dict[str, float]  # CPU-ms per request by kind; kinds not named skip the stage


@dataclass
class Overheads:
    """What serving costs outside the models, as figures measured or documented elsewhere."""

    fixed_ms: float = 0.0  # latency every request adds (proxy, ingress, hops), not compute
    path: tuple[PathStage, ...] = ()  # crossed in order, each a FIFO of its servers
    router_rps: float | None = None  # one router replica's decisions per second
    router_replicas: int = 1
    # One host whose cores the model passes share with the serving path (a single machine:
    # proxy, ingress, load generator and the replica's own request handling). None: the
    # passes own their device (a GPU cluster, where the serving path runs on other cores).
    host_cores: float | None = None
    cpu_ms_per_request: float = 0.0  # host CPU each request costs outside the model's passes
    cpu_window_s: float = 1.0  # the serving path's CPU demand is its rate over this window
    background_cores: float = 0.0  # host CPU busy with no request at all (Ray's own daemons)


def host_slowdown(cores: float, serving_cores: float, pass_cores: float = 1.0) -> float:
    """How much longer a pass takes when the serving path wants ``serving_cores`` of a host
    with ``cores``: none while both fit; past that the kernel shares the cores fairly, so
    every runnable thread (the pass's included) runs at cores / demand (processor sharing)."""
    demand = pass_cores + max(0.0, serving_cores)
    return max(1.0, demand / cores)


@dataclass
class Record:
    """One request's fate."""

    req: SimRequest
    sent: float
    model: str = ""
    ended: float | None = None
    status: int = 0
    first_token: float | None = None
    escalated: bool = False


@dataclass(eq=False)
class _Ticket:
    """One submission of a request to a pool: who to answer, and its record."""

    req: SimRequest
    reply: Callable[[int], None]
    rec: Record
    pool: Pool


class _Stage:
    """``servers`` FIFO servers: a path component's cores, or the router's rate bound."""

    def __init__(self, rate: float | None, servers: int) -> None:
        self.service_s = 0.0 if not rate else 1.0 / rate
        self.free_at = [0.0] * max(1, servers)

    def through(self, now: float, service_s: float | None = None) -> float:
        """When a request arriving ``now`` leaves (``service_s``: its own, else the stage's)."""
        service = self.service_s if service_s is None else service_s
        if service == 0:
            return now
        i = min(range(len(self.free_at)), key=self.free_at.__getitem__)
        start = max(now, self.free_at[i])
        self.free_at[i] = start + service
        return self.free_at[i]


@dataclass
class SimResult:
    """Figures over the measured window (after ``warmup_s``)."""

    window_s: float
    answered: int
    refused: int
    items_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    tpot_ms: float = math.nan
    by_model: dict[str, int] = field(default_factory=dict)
    escalated: int = 0
    utilisation: dict[str, float] = field(default_factory=dict)
    keeps_up: bool = True  # set by callers that compare the answered rate with the offered

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in vars(self).items()}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0-100); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Twin:
    """A cluster's pools, overheads and router; ``run`` simulates one load."""

    def __init__(
        self,
        pools: dict[str, Pool],
        overheads: Overheads | None = None,
        router: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        self.pools = pools
        self.overheads = overheads or Overheads()
        self.rng = random.Random(seed)
        self.router: RouterServer | None = None
        if router is not None and SMALL in pools:
            clients = {m: None for m in (SMALL, LARGE) if m in pools}
            config = {**router, "predictor_snapshot": None}
            per_replica = config.get("max_in_flight_per_replica") or {}

            def cap(model: str) -> int:
                # Not listed: the deployment's own max_ongoing_requests, as the router does.
                per = per_replica.get(model) or pools[model].max_ongoing_requests
                return share_of_cap(per, len(pools[model].replicas), None)

            self.router = RouterServer(config, clients, caps=cap)  # type: ignore[arg-type]
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.records: list[Record] = []
        self._busy_s: dict[str, float] = {}
        self._path = [(stage, _Stage(None, stage.servers)) for stage in self.overheads.path]
        self._sent_recently: deque[float] = deque()  # send times within cpu_window_s
        self._router_stage = _Stage(self.overheads.router_rps, self.overheads.router_replicas)

    @property
    def busy_s(self) -> dict[str, float]:
        """Seconds each replica spent in passes (or engine steps) so far."""
        return dict(self._busy_s)

    # --- the event loop --------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def _loop(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()

    # --- a request's path ------------------------------------------------------------

    def send(self, req: SimRequest, done: Callable[[Record], None] | None = None) -> None:
        """A request arrives now; ``done`` is called with its record when it is answered."""
        rec = Record(req, self.now)
        self.records.append(rec)
        if self.overheads.host_cores:
            self._sent_recently.append(self.now)
        self._cross_path(rec, 0, done)

    def _cross_path(self, rec: Record, index: int, done: Callable[[Record], None] | None) -> None:
        """Stage ``index`` on, each as its own event: a queue in the order requests reach it."""
        for i in range(index, len(self._path)):
            stage, queue = self._path[i]
            ms = stage.ms.get(rec.req.kind)
            if ms:
                leaves = queue.through(self.now, ms / 1000)
                self.at(leaves, lambda i=i: self._cross_path(rec, i + 1, done))
                return
        self.at(self.now + self.overheads.fixed_ms / 1000, lambda: self._dispatch(rec, done))

    def _answer(self, rec: Record, status: int, done: Callable[[Record], None] | None) -> None:
        rec.ended, rec.status = self.now, status
        if done is not None:
            done(rec)

    def _dispatch(self, rec: Record, done: Callable[[Record], None] | None) -> None:
        req = rec.req
        if req.kind == "generate" and req.model == "auto":
            if self.router is None:
                raise ValueError("a request asks for model 'auto' but the twin has no router")
            at = self._router_stage.through(self.now)
            self.at(at, lambda: self._route(rec, done))
            return
        pool = {"embed": "embedder", "rank": "ranker"}.get(req.kind, req.model)
        if pool not in self.pools:
            raise ValueError(f"no {pool!r} deployment in the twin for a {req.kind} request")
        rec.model = pool
        self._submit(self.pools[pool], req, lambda status: self._answer(rec, status, done), rec)

    def _route(self, rec: Record, done: Callable[[Record], None] | None) -> None:
        """``model: auto``: the router's own flow (``RouterServer.plan``, its gates,
        ``after_answer``, ``finish``), driven by events instead of coroutines."""
        assert self.router is not None
        router, req = self.router, rec.req
        call = GenerationCall(
            prompts=[req.text or "x" * (4 * req.prompt_tokens)], max_tokens=req.max_tokens
        )
        route = router.plan(call, tier="batch" if req.priority == "batch" else "interactive")

        def outcome() -> SmallOutcome:
            cut = req.produced >= req.max_tokens
            return SmallOutcome(
                [], [req.small_mean_logprob] * req.produced, "length" if cut else "stop"
            )

        def call_model() -> None:
            gate = router.gate(route)
            waited = self.now

            def submit() -> None:
                started = self.now

                def left(status: int) -> None:
                    tokens = req.produced if status == 200 else 0
                    gate.leave(route.predicted, tokens, self.now - started)
                    answered(status, (started - waited) * 1000)

                self._submit(self.pools[route.model], req, left, rec)

            def granted() -> bool:
                self.at(self.now, submit)  # an event: a refusal must not recurse down the line
                return True

            try:
                admitted = gate.take(
                    route.predicted, route.tier, route.lane.name, self.now, granted
                )
            except RequestError as refused:  # the lane is full
                answered(refused.status_code, 0.0)
                return
            if admitted is None:
                submit()

        def answered(status: int, queue_ms: float) -> None:
            if status == 200 and router.after_answer(route, outcome):
                rec.escalated = True
                call_model()
                return
            if status == 200:
                router.finish(route, req.produced, queue_ms)
            rec.model = route.model
            self._answer(rec, status, done)

        call_model()

    def _submit(
        self, pool: Pool, req: SimRequest, reply: Callable[[int], None], rec: Record
    ) -> None:
        self._place(_Ticket(req, reply, rec, pool))

    def _place(self, ticket: _Ticket) -> None:
        """Serve's replica choice: the less loaded of two with room, else the handle queue."""
        pool = ticket.pool
        open_ = [r for r in pool.replicas if r.ongoing < pool.max_ongoing_requests]
        if not open_:
            if 0 <= pool.max_queued_requests <= len(pool.waiting):
                ticket.reply(503)
                return
            pool.waiting.append(ticket)
            return
        pick = self.rng.sample(open_, min(2, len(open_)))
        replica = min(pick, key=lambda r: r.ongoing)
        refusal = replica.offer(self.now, ticket.req, ticket)
        if refusal is not None:
            ticket.reply(refusal.status_code)
            return
        if isinstance(replica, GeneratorReplica) and replica.collect_s > 0:
            # @serve.batch: the first arrival opens a window; its arrivals reach the engine
            # together when it closes, whether or not a step is running.
            if not replica.collecting:
                replica.collecting = True
                self.at(self.now + replica.collect_s, lambda: self._collected(replica))
            return
        self._kick(replica)

    def _collected(self, replica: GeneratorReplica) -> None:
        replica.collect()
        self._kick(replica)

    def _kick(self, replica: Replica, collected: bool = False) -> None:
        if isinstance(replica, EncoderReplica) and replica.collect_s > 0 and not replica.busy:
            if replica.collecting and not collected:
                return  # a collection window is open: this arrival joins it
            if not collected:
                replica.collecting = True
                self.at(self.now + replica.collect_s, lambda: self._kick(replica, True))
                return
            replica.collecting = False
        work = replica.start(self.now, self._slowdown())
        if work is None:
            return
        self._busy_s[replica.name] = self._busy_s.get(replica.name, 0.0) + work.ends - self.now
        self.at(work.ends, lambda: self._finish(replica, work))

    def _slowdown(self) -> float:
        """A pass's slowdown on a shared host: the serving path's CPU demand is the rate of
        requests sent in the last ``cpu_window_s`` times what each costs."""
        o = self.overheads
        if not o.host_cores or (o.cpu_ms_per_request <= 0 and o.background_cores <= 0):
            return 1.0
        recent = self._sent_recently
        while recent and recent[0] < self.now - o.cpu_window_s:
            recent.popleft()
        serving = o.background_cores + len(recent) / o.cpu_window_s * o.cpu_ms_per_request / 1000
        # Every replica mid-pass holds a core too (one torch thread each, as validated here).
        passes = 1 + sum(r.busy for pool in self.pools.values() for r in pool.replicas)
        return host_slowdown(o.host_cores, serving, passes)

    def _finish(self, replica: Replica, work: Work) -> None:
        if isinstance(replica, EncoderReplica):
            done, first = replica.finish(self.now, work), []
        else:
            events = replica.finish(self.now, work)
            done, first = events.done, events.first
        for ticket in first:
            if ticket.rec.first_token is None:
                ticket.rec.first_token = self.now
        for ticket in done:
            ticket.reply(200)
            if ticket.pool.waiting:
                self._place(ticket.pool.waiting.popleft())
        self._kick(replica)

    # --- loads -----------------------------------------------------------------------

    def run(
        self,
        arrivals: Sequence[tuple[float, SimRequest]] | None = None,
        clients: int = 0,
        requests: Sequence[SimRequest] = (),
        duration_s: float = 60.0,
        warmup_s: float = 5.0,
        honour_retry_after: bool = True,
        retry_after_s: float = 1.0,
        drain: bool = True,
        max_requests: int | None = None,
    ) -> SimResult:
        """Open loop (``arrivals``) or ``clients`` closed-loop clients cycling ``requests``.

        Closed loop: clients stop sending at ``duration_s`` (or after ``max_requests``
        sends). With ``drain`` (the benchmark harness's way) requests in flight then finish
        and count, over the span from the first send to the last answer; without it the
        figures are what completed in [warmup_s, duration_s].
        """
        if (arrivals is None) == (clients <= 0):
            raise ValueError("give either arrivals (open loop) or clients > 0 (closed loop)")
        if arrivals is not None:
            for t, req in arrivals:
                self.at(t, lambda r=req: self.send(r))
            self._loop(math.inf if drain else max((t for t, _ in arrivals), default=0.0))
            return self._result(warmup_s, None)
        if not requests:
            raise ValueError("closed-loop clients need requests to send")
        order = itertools.count()
        limit = math.inf if max_requests is None else max_requests

        def client(req: SimRequest | None = None) -> None:
            if self.now >= duration_s:
                return
            if req is None:
                index = next(order)
                if index >= limit:
                    return
                req = requests[index % len(requests)]

            def answered(rec: Record) -> None:
                if rec.status == 503 and honour_retry_after:
                    self.at(self.now + retry_after_s, lambda: client(rec.req))
                else:
                    client()

            self.send(req, answered)

        for i in range(clients):
            # Clients start a few microseconds apart, as a load generator's tasks do.
            self.at(i * 1e-5, client)
        if drain:
            self._loop(math.inf)
            return self._result(warmup_s, None)
        self._loop(duration_s)
        return self._result(warmup_s, duration_s)

    def summary(self, kind: str, lo: float = 0.0) -> SimResult:
        """One request kind's figures after a mixed open-loop run (its own span)."""
        return self._result(lo, None, kind)

    def _result(self, lo: float, hi: float | None, kind: str | None = None) -> SimResult:
        """Closed loop (``hi`` given): what completed in [lo, hi], over hi - lo. Open loop:
        every request sent from ``lo`` on, over the span from the first of them to the last
        completion, as the benchmark harness summarises a run (benchmarks/stats.py)."""
        records = [r for r in self.records if kind is None or r.req.kind == kind]
        ok = [r for r in records if r.status == 200 and r.ended is not None]
        if hi is not None:
            inside = [r for r in ok if lo <= r.ended <= hi]  # type: ignore[operator]
            sent = [r for r in records if lo <= r.sent <= hi]
            span = hi - lo
        else:
            inside = [r for r in ok if r.sent >= lo]
            sent = [r for r in records if r.sent >= lo]
            first = min((r.sent for r in sent), default=lo)
            last = max((r.ended or r.sent for r in sent), default=lo)
            span = max(last - first, 1e-9)
        refused = sum(1 for r in sent if r.status in (503, 504))
        lat = [(r.ended - r.sent) * 1000 for r in inside]  # type: ignore[operator]
        gen = [r for r in inside if r.req.kind == "generate"]
        ttft = [(r.first_token - r.sent) * 1000 for r in gen if r.first_token is not None]
        tpot = [
            (r.ended - r.first_token) * 1000 / (r.req.produced - 1)  # type: ignore[operator]
            for r in gen
            if r.first_token is not None and r.req.produced > 1
        ]
        by_model: dict[str, int] = {}
        for r in inside:
            by_model[r.model] = by_model.get(r.model, 0) + 1
        return SimResult(
            window_s=span,
            answered=len(inside),
            refused=refused,
            items_per_s=sum(r.req.items for r in inside) / span,
            tokens_per_s=sum(r.req.produced for r in gen) / span,
            p50_ms=percentile(lat, 50),
            p99_ms=percentile(lat, 99),
            ttft_p50_ms=percentile(ttft, 50),
            ttft_p99_ms=percentile(ttft, 99),
            tpot_ms=percentile(tpot, 50),
            by_model=by_model,
            escalated=sum(1 for r in inside if r.escalated),
            utilisation={k: round(v / max(self.now, 1e-9), 3) for k, v in self._busy_s.items()},
        )


def poisson(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second over ``duration_s``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)
