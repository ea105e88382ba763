"""The load generator: asyncio + httpx, open loop (a schedule) or closed loop (concurrency).

It shares the machine with the servers, so it does as little as possible while measuring:
bodies are serialised before the clock starts, responses are parsed only for their usage
counts, and the progress bar redraws at most twice a second. Each record keeps the client's
own send lag so a report can show the client kept up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.stats import RequestRecord
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
class LoadResult:
    records: list[RequestRecord]
    planned: int
    aborted: str | None = None  # why the run stopped early, if it did
    started_at: float = field(default_factory=time.time)  # wall clock, for the report


class LoadGenerator:
    """One pooled HTTP client against one server (all targets share it)."""

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
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            trust_env=False,  # never route 127.0.0.1 through an environment proxy
        )

    async def __aenter__(self) -> LoadGenerator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get_json(self, path: str, timeout_s: float = 10.0) -> Any | None:
        """GET a JSON document; None if it is not there (404) or not JSON."""
        try:
            resp = await self._client.get(path, timeout=timeout_s)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            return resp.json()
        except ValueError:
            return None

    async def wait_ready(self, path: str, timeout_s: float = 300.0) -> None:
        """Polls ``path`` until it answers 200 (the app is deployed and routed)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                resp = await self._client.get(path, timeout=5.0)
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.base_url}{path} not ready after {timeout_s:g} s ({last})")

    # --- one request ------------------------------------------------------------------

    async def _send(
        self, target: Target, request: Request, body: bytes, index: int, scheduled: float, t0: float
    ) -> RequestRecord:
        started = time.perf_counter() - t0
        status, items, tokens, error = TRANSPORT_ERROR, 0, 0, None
        try:
            resp = await self._client.post(target.path, content=body, headers=JSON_HEADERS)
            status = resp.status_code
            if 200 <= status < 300:
                answer = target.decode(request, resp.content)
                items, tokens = answer.items, answer.tokens
            else:
                error = resp.text[:300]
        except httpx.TimeoutException:
            status, error = TIMED_OUT, f"no answer within {self.timeout_s:g} s"
        except httpx.HTTPError as exc:
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
    ) -> LoadResult:
        """Sends ``requests[i]`` at ``arrivals[i]`` seconds, whatever the answers do."""
        if len(requests) != len(arrivals):
            raise ValueError(f"{len(requests)} requests for {len(arrivals)} arrival times")
        bodies = self._encode_all(target, requests)
        planned = len(arrivals)
        result = LoadResult(records=[], planned=planned)
        in_flight: dict[int, tuple[float, float]] = {}  # index -> (scheduled, started)
        tasks: dict[int, asyncio.Task[RequestRecord]] = {}
        misses = 0
        bar = self._bar(planned, label)
        t0 = time.perf_counter()

        def done(task: asyncio.Task[RequestRecord]) -> None:
            nonlocal misses
            if task.cancelled():
                return
            record = task.result()
            in_flight.pop(record.index, None)
            tasks.pop(record.index, None)
            result.records.append(record)
            if guard and (not record.ok or record.latency * 1000 > guard.slo_ms):
                misses += 1
            bar.update()

        async def watchdog() -> None:
            assert guard is not None
            budget = guard.max_miss_share * planned
            while True:
                await asyncio.sleep(0.1)
                now = time.perf_counter() - t0
                late = [s for s, _ in in_flight.values() if (now - s) * 1000 > guard.slo_ms]
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
            for index, (at, request, body) in enumerate(
                zip(arrivals, requests, bodies, strict=True)
            ):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if result.aborted:
                    break
                in_flight[index] = (at, time.perf_counter() - t0)
                task = asyncio.create_task(self._send(target, request, body, index, at, t0))
                tasks[index] = task
                task.add_done_callback(done)
            while tasks and not result.aborted:
                await asyncio.wait(list(tasks.values()), timeout=0.2)
        finally:
            if watch is not None:
                watch.cancel()
            now = time.perf_counter() - t0
            for index, task in list(tasks.items()):
                task.cancel()
                scheduled, started = in_flight.get(index, (now, now))
                result.records.append(
                    RequestRecord(index, scheduled, started, now, CANCELLED, error="run aborted")
                )
            if tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)
            bar.close()
        # A task can finish in the instant it is cancelled; then its real record wins.
        by_index: dict[int, RequestRecord] = {}
        for record in result.records:
            if record.status != CANCELLED or record.index not in by_index:
                by_index[record.index] = record
        result.records = [by_index[i] for i in sorted(by_index)]
        return result

    # --- closed loop ------------------------------------------------------------------

    async def run_closed(
        self,
        target: Target,
        requests: Sequence[Request],
        concurrency: int,
        duration_s: float,
        label: str = "",
    ) -> LoadResult:
        """``concurrency`` clients, each sending its next request when the last returns.

        Measures capacity at a fixed number of requests in flight. Clients stop starting new
        requests after ``duration_s``; those in flight finish and count.
        """
        bodies = self._encode_all(target, requests)
        result = LoadResult(records=[], planned=0)
        bar = self._bar(None, label)
        t0 = time.perf_counter()
        next_index = 0

        async def client() -> None:
            nonlocal next_index
            while time.perf_counter() - t0 < duration_s:
                index = next_index
                next_index += 1
                k = index % len(requests)
                now = time.perf_counter() - t0
                record = await self._send(target, requests[k], bodies[k], index, now, t0)
                result.records.append(record)
                bar.update()

        try:
            await asyncio.gather(*(client() for _ in range(concurrency)))
        finally:
            bar.close()
        result.planned = len(result.records)
        result.records.sort(key=lambda r: r.index)
        return result
