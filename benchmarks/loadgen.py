"""The one load generator: asyncio + aiohttp, open loop (a schedule) or closed loop (clients).

The suite, ``benchmarks run``, ``benchmarks.reliability`` and the peers all drive load
through it. It shares the machine with the servers, so it does as little as possible while
measuring: bodies are serialised before the clock starts, responses are parsed only for their
usage counts (and, for refusals, Retry-After and the error code), and the progress bar redraws
at most twice a second. Each record keeps the client's own send lag so a report can show the
client kept up, and the name of the endpoint it went to, so one run can drive several.

The client is aiohttp, not httpx: on these 2 cores httpx spent 3-20 ms of CPU per request
(its pool grows costly with hundreds of connections in flight), aiohttp under 1 ms. At 10x
overload the client alone took most of a core from the server it measured.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.arrivals import poisson_arrivals
from benchmarks.stats import REJECTION_STATUSES, RequestRecord
from benchmarks.targets import Target
from benchmarks.workloads import Request

JSON_HEADERS = {"content-type": "application/json"}

# Statuses for requests that got no HTTP answer (see RequestRecord.status).
TRANSPORT_ERROR, TIMED_OUT, CANCELLED = 0, -1, -2


@dataclass
class SloGuard:
    """Stops an open-loop run early once it clearly cannot meet a latency SLO.

    A rate search probes rates above capacity on purpose; letting those run to the end only
    builds a backlog that takes as long again to drain. Requests still in flight past the
    SLO already count as misses, so overload is seen while it builds.
    """

    slo_ms: float
    # Abort once more than this share of the planned requests missed the SLO. Well above 1%
    # so the probe still yields a meaningful (failing) p99 for the latency curve.
    max_miss_share: float = 0.1
    # Abort once any request has waited this long: the server is far past saturation.
    overload_s: float = 5.0


@dataclass
class Endpoint:
    """One app under load: a name (kept on every record), its target, requests (cycled)."""

    name: str
    target: Target
    requests: list[Request]
    headers: dict[str, str] = field(default_factory=dict)  # e.g. priority, deadline


@dataclass
class LoadResult:
    """Records of a run; filled while it goes, so a soak can report windows as it runs."""

    records: list[RequestRecord] = field(default_factory=list)
    planned: int = 0
    aborted: str | None = None  # why the run stopped early, if it did
    started_at: float = 0.0  # wall clock (time.time()) at the start, for the report
    t0: float = 0.0  # perf_counter at the start; 0 until the run starts
    in_flight: int = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0


def retry_after_s(value: str | None, fallback: float) -> float:
    """Seconds a Retry-After header asks for (delta-seconds form), else ``fallback``."""
    try:
        return max(0.0, float(value)) if value is not None else fallback
    except ValueError:  # the HTTP-date form: no server here sends it
        return fallback


class LoadGenerator:
    """One pooled HTTP client against one server (all endpoints share it)."""

    def __init__(
        self,
        base_url: str,
        max_connections: int = 256,
        timeout_s: float = 30.0,
        progress: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.progress = progress
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        """The pooled session (made on first use: aiohttp wants a running event loop)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10.0),
                trust_env=False,  # never route 127.0.0.1 through an environment proxy
            )
        return self._session

    def url(self, path: str) -> str:
        return self.base_url + path

    async def __aenter__(self) -> LoadGenerator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_json(self, path: str, timeout_s: float = 10.0) -> Any | None:
        """GET a JSON document; None if it is not there (404) or not JSON."""
        try:
            async with self.http.get(
                self.url(path), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    return None
                content = await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            return None
        try:
            return json.loads(content)
        except ValueError:
            return None

    async def quiesce(self, stats_path: str | None, timeout_s: float = 30.0) -> None:
        """Waits until a replica's pass count stops moving, so a queue left by the last run
        drains before the next one starts (1 s when the server has no stats)."""
        if not stats_path:
            await asyncio.sleep(1.0)
            return
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            stats = await self.get_json(stats_path) or {}
            now = (stats.get("items"), stats.get("forward_passes"))
            if now == last:
                return
            last = now
            await asyncio.sleep(0.5)

    async def wait_ready(self, path: str, timeout_s: float = 300.0) -> None:
        """Polls ``path`` until it answers 200 (the app is deployed and routed)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                async with self.http.get(
                    self.url(path), timeout=aiohttp.ClientTimeout(total=5.0)
                ) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.base_url}{path} not ready after {timeout_s:g} s ({last})")

    # --- one request ------------------------------------------------------------------

    async def send(
        self, ep: Endpoint, request: Request, body: bytes, index: int, scheduled: float, t0: float
    ) -> RequestRecord:
        started = time.perf_counter() - t0
        status, items, tokens, error = TRANSPORT_ERROR, 0, 0, None
        retry_after = code = None
        headers = {**JSON_HEADERS, **ep.headers} if ep.headers else JSON_HEADERS
        try:
            async with self.http.post(self.url(ep.target.path), data=body, headers=headers) as resp:
                status = resp.status
                content = await resp.read()
                retry_after = resp.headers.get("retry-after")
            if 200 <= status < 300:
                answer = ep.target.decode(request, content)
                items, tokens = answer.items, answer.tokens
                retry_after = None
            else:
                error = content[:300].decode(errors="replace")
                code = _error_code(content)
        except TimeoutError:  # aiohttp's timeouts are TimeoutError (3.11+: asyncio's too)
            status, error = TIMED_OUT, f"no answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            status, error = TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}"[:300]
        return RequestRecord(
            index=index,
            scheduled=scheduled,
            started=started,
            finished=time.perf_counter() - t0,
            status=status,
            items=items,
            tokens=tokens,
            error=error,
            target=ep.name,
            retry_after=retry_after,
            code=code,
        )

    @staticmethod
    def _encode_all(target: Target, requests: Sequence[Request]) -> list[bytes]:
        cache: dict[int, bytes] = {}  # workloads cycle: encode each distinct request once
        return [cache.setdefault(id(r), target.encode(r)) for r in requests]

    def _bar(self, total: int | None, label: str) -> tqdm:
        return tqdm(
            total=total,
            desc=label or "run",
            unit="req",
            mininterval=0.5,
            dynamic_ncols=True,
            disable=not self.progress,
            leave=False,
        )

    # --- open loop --------------------------------------------------------------------

    async def run_open(
        self,
        target: Target,
        requests: Sequence[Request],
        arrivals: Sequence[float],
        label: str = "",
        guard: SloGuard | None = None,
        headers: dict[str, str] | None = None,
    ) -> LoadResult:
        """Sends ``requests[i]`` at ``arrivals[i]`` seconds, whatever the answers do."""
        if len(requests) != len(arrivals):
            raise ValueError(f"{len(requests)} requests for {len(arrivals)} arrival times")
        ep = Endpoint(target.name, target, list(requests), dict(headers or {}))
        timeline = [(at, 0, i) for i, at in enumerate(arrivals)]
        return await self._open([ep], timeline, label=label, guard=guard)

    async def run_open_mixed(
        self,
        plan: Sequence[tuple[Endpoint, float]],
        duration_s: float,
        seed: int = 0,
        run: LoadResult | None = None,
        drain_s: float | None = None,
        label: str = "",
    ) -> LoadResult:
        """Poisson arrivals at ``rate`` per endpoint for ``duration_s``, merged in one timeline.

        ``run`` is filled as answers arrive (a caller may watch it). Waits up to ``drain_s``
        (default: the client timeout) for the last answers; anything still unanswered then
        is recorded as CANCELLED (lost).
        """
        rng = random.Random(seed)
        timeline: list[tuple[float, int, int]] = []  # (at, endpoint index, request index)
        for e, (ep, rate) in enumerate(plan):
            if rate > 0:
                times = poisson_arrivals(rate, duration_s, rng)
                timeline.extend((t, e, i % len(ep.requests)) for i, t in enumerate(times))
        timeline.sort()
        return await self._open([ep for ep, _ in plan], timeline, label, None, run, drain_s)

    async def _open(
        self,
        eps: Sequence[Endpoint],
        timeline: Sequence[tuple[float, int, int]],
        label: str = "",
        guard: SloGuard | None = None,
        run: LoadResult | None = None,
        drain_s: float | None = None,
    ) -> LoadResult:
        bodies = [self._encode_all(ep.target, ep.requests) for ep in eps]
        result = run if run is not None else LoadResult()
        result.planned = len(timeline)
        in_flight: dict[int, tuple[str, float, float]] = {}  # index -> (name, scheduled, sent)
        tasks: dict[int, asyncio.Task[RequestRecord]] = {}
        misses = 0
        bar = self._bar(result.planned, label)
        result.started_at = time.time()
        t0 = result.t0 = time.perf_counter()

        def done(task: asyncio.Task[RequestRecord]) -> None:
            nonlocal misses
            if task.cancelled():
                return
            record = task.result()
            in_flight.pop(record.index, None)
            tasks.pop(record.index, None)
            result.in_flight -= 1
            result.records.append(record)
            if guard and (not record.ok or record.latency * 1000 > guard.slo_ms):
                misses += 1
            bar.update()

        async def watchdog() -> None:
            assert guard is not None
            budget = guard.max_miss_share * result.planned
            while True:
                await asyncio.sleep(0.1)
                now = time.perf_counter() - t0
                late = [s for _, s, _ in in_flight.values() if (now - s) * 1000 > guard.slo_ms]
                if misses + len(late) > budget:
                    result.aborted = (
                        f"more than {guard.max_miss_share:.0%} of requests missed "
                        f"the {guard.slo_ms:g} ms SLO"
                    )
                    return
                if late and now - min(late) > guard.overload_s:
                    result.aborted = f"a request waited over {guard.overload_s:g} s (overload)"
                    return

        watch = asyncio.create_task(watchdog()) if guard else None
        try:
            for index, (at, e, k) in enumerate(timeline):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if result.aborted:
                    break
                ep = eps[e]
                in_flight[index] = (ep.name, at, time.perf_counter() - t0)
                task = asyncio.create_task(
                    self.send(ep, ep.requests[k], bodies[e][k], index, at, t0)
                )
                tasks[index] = task
                result.in_flight += 1
                task.add_done_callback(done)
            # The client timeout ends every request, so by default this waits for all.
            deadline = time.perf_counter() + (
                drain_s if drain_s is not None else self.timeout_s + 5
            )
            while tasks and not result.aborted and time.perf_counter() < deadline:
                await asyncio.wait(list(tasks.values()), timeout=0.2)
        finally:
            if watch is not None:
                watch.cancel()
            now = time.perf_counter() - t0
            reason = "run aborted" if result.aborted else "no answer by the end"
            for index, task in list(tasks.items()):
                task.cancel()
                name, scheduled, started = in_flight.get(index, ("", now, now))
                result.records.append(
                    RequestRecord(
                        index, scheduled, started, now, CANCELLED, error=reason, target=name
                    )
                )
            if tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)
            bar.close()
        result.records = merge_records(result.records)
        return result

    # --- closed loop ------------------------------------------------------------------

    async def run_closed(
        self,
        target: Target | Endpoint,
        requests: Sequence[Request] | None,
        concurrency: int,
        duration_s: float,
        label: str = "",
        refusal_backoff_s: float = 0.0,
        max_requests: int | None = None,
    ) -> LoadResult:
        """``concurrency`` clients, each sending its next request when the last returns.

        Measures capacity at a fixed number of requests in flight. Clients stop starting new
        requests after ``duration_s`` or once ``max_requests`` were started; those in flight
        finish and count. After a refusal (429/503) a client waits the Retry-After the server
        sent (``refusal_backoff_s`` when it sent none); ``refusal_backoff_s=0`` means clients
        ignore Retry-After and resend at once, the worst case for goodput.
        """
        ep = target if isinstance(target, Endpoint) else Endpoint(target.name, target, [])
        reqs = list(requests) if requests is not None else ep.requests
        ep = Endpoint(ep.name, ep.target, reqs, ep.headers)
        bodies = self._encode_all(ep.target, reqs)
        result = LoadResult(started_at=time.time())
        bar = self._bar(max_requests, label)
        t0 = result.t0 = time.perf_counter()
        next_index = 0
        limit = max_requests if max_requests is not None else float("inf")

        async def client() -> None:
            nonlocal next_index
            while time.perf_counter() - t0 < duration_s and next_index < limit:
                index = next_index
                next_index += 1
                k = index % len(reqs)
                now = time.perf_counter() - t0
                result.in_flight += 1
                record = await self.send(ep, reqs[k], bodies[k], index, now, t0)
                result.in_flight -= 1
                result.records.append(record)
                bar.update()
                if refusal_backoff_s > 0 and record.status in REJECTION_STATUSES:
                    # A refused client that resent at once would turn saturation into a
                    # refusal storm that burns the CPU it is measuring.
                    await asyncio.sleep(retry_after_s(record.retry_after, refusal_backoff_s))

        try:
            await asyncio.gather(*(client() for _ in range(concurrency)))
        finally:
            bar.close()
        result.planned = len(result.records)
        result.records.sort(key=lambda r: r.index)
        return result


def merge_records(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """One record per index, in index order; a real answer beats a CANCELLED placeholder.

    A task can finish in the instant it is cancelled; then both records exist.
    """
    by_index: dict[int, RequestRecord] = {}
    for record in records:
        if record.status != CANCELLED or record.index not in by_index:
            by_index[record.index] = record
    return [by_index[i] for i in sorted(by_index)]


def _error_code(content: bytes) -> str | None:
    try:
        err = json.loads(content).get("error") or {}
        return str(err.get("code")) if err.get("code") else None
    except (ValueError, AttributeError):
        return None
