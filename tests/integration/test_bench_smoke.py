"""The benchmark harness measures a fake server whose behaviour is known exactly.

The fake answers the embeddings wire format after sleeping a fixed time, counts what it
served in ``/v1/stats`` like carpool's replicas, and misbehaves on request: ``reject`` gives
503, ``bad`` gives 400, ``slow`` sleeps past the client timeout. No Ray, no model; a few
seconds in all. Tolerances are wide on purpose: this checks the harness's arithmetic, not
the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.arrivals import ArrivalSpec
from benchmarks.loadgen import LoadGenerator, SloGuard
from benchmarks.runner import Bench, System
from benchmarks.targets import EmbeddingsTarget
from benchmarks.workloads import EmbedRequest, Workload

SLEEP_S = 0.05
TOKENS_PER_TEXT = 7


class _FakeState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sleep_s = SLEEP_S
        self.items = 0
        self.passes = 0
        self.hist: dict[str, int] = {}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real server behind a pooled client
    state: _FakeState

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/fake/v1/stats":
            s = self.state
            with s.lock:
                self._send(
                    200,
                    {
                        "forward_passes": s.passes,
                        "items": s.items,
                        "real_tokens": s.items * TOKENS_PER_TEXT,
                        "padded_tokens": s.items * TOKENS_PER_TEXT * 2,
                        "items_per_pass_histogram": dict(s.hist),
                    },
                )
        elif self.path == "/fake/v1/models":
            self._send(200, {"data": []})
        else:
            self._send(404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        texts = body["input"]
        if texts[0] == "reject":
            self._send(503, {"error": {"message": "overloaded"}})
            return
        if texts[0] == "bad":
            self._send(400, {"error": {"message": "bad input"}})
            return
        time.sleep(2.0 if texts[0] == "slow" else self.state.sleep_s)
        with self.state.lock:
            self.state.items += len(texts)
            self.state.passes += 1
            key = str(len(texts))
            self.state.hist[key] = self.state.hist.get(key, 0) + 1
        self._send(
            200,
            {
                "data": [{"index": i, "embedding": ""} for i in range(len(texts))],
                "usage": {"prompt_tokens": TOKENS_PER_TEXT * len(texts)},
            },
        )


@pytest.fixture
def fake() -> Iterator[tuple[str, _FakeState]]:
    state = _FakeState()
    handler = type("Handler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


def _workload(texts_per_request: list[int], first: list[str] | None = None) -> Workload:
    requests = []
    for i, n in enumerate(texts_per_request):
        head = first[i] if first else "hello"
        requests.append(EmbedRequest(tuple([head] + ["world"] * (n - 1)), 3 * n))
    return Workload("fake", requests)


def _system() -> System:
    return System("fake", EmbeddingsTarget("fake", "/fake"))


def test_open_loop_measures_known_latency_throughput_and_batches(
    fake: tuple[str, _FakeState],
) -> None:
    url, _ = fake
    sizes = [1, 2, 3, 4]
    workload = _workload(sizes)
    arrival = ArrivalSpec(kind="poisson", rate=40, duration_s=2.0, seed=3)
    planned = len(arrival.schedule())

    async def go():
        async with LoadGenerator(url, progress=False) as gen:
            return await Bench(gen).run(_system(), workload, arrival)

    run = asyncio.run(go())
    s = run.summary
    assert s["sent"] == s["ok"] == planned
    assert s["errors"] == s["rejected"] == s["timeouts"] == 0
    # Latency: never below the server's sleep, and not much above it on an idle fake.
    assert SLEEP_S * 1000 <= s["latency_ms"]["p50"] < SLEEP_S * 1000 + 150
    assert s["latency_ms"]["p50"] <= s["latency_ms"]["p90"] <= s["latency_ms"]["p99"]
    # Throughput: everything offered was served, over the arrival window plus one latency.
    assert 0.7 * s["offered_rps"] <= s["requests_per_s"] <= 1.1 * s["offered_rps"]
    sent_items = sum(workload.take(planned)[i].items for i in range(planned))
    assert s["items_per_s"] * s["span_s"] == pytest.approx(sent_items)
    assert s["tokens_per_s"] * s["span_s"] == pytest.approx(TOKENS_PER_TEXT * sent_items)
    # Replica stats are this run's deltas.
    assert run.replica["items"] == sent_items
    assert run.replica["forward_passes"] == planned
    assert run.replica["mean_items_per_pass"] == pytest.approx(sent_items / planned)
    assert run.replica["padding_waste_ratio"] == pytest.approx(0.5)
    assert sum(run.replica["items_per_pass_histogram"].values()) == planned


def test_closed_loop_throughput_is_concurrency_over_latency(fake: tuple[str, _FakeState]) -> None:
    url, _ = fake

    async def go():
        async with LoadGenerator(url, progress=False) as gen:
            return await Bench(gen).run(
                _system(), _workload([2]), ArrivalSpec(kind="closed", concurrency=4, duration_s=1.5)
            )

    s = asyncio.run(go()).summary
    ideal = 4 / SLEEP_S  # 80 requests/s
    # Only the physical bound: 4 clients each waiting SLEEP_S cannot beat it. A lower bound
    # would be a timing assert that a loaded CPU breaks (the test runs beside benchmarks).
    assert 0 < s["requests_per_s"] <= 1.05 * ideal
    assert s["latency_ms"]["p50"] >= SLEEP_S * 1000 * 0.95
    assert s["items_per_s"] == pytest.approx(2 * s["requests_per_s"])
    assert s["errors"] == 0


def test_rejections_errors_and_timeouts_are_counted_apart(fake: tuple[str, _FakeState]) -> None:
    url, _ = fake
    heads = ["ok", "reject", "bad", "slow", "ok", "reject"]
    workload = _workload([1] * len(heads), heads)

    async def go():
        async with LoadGenerator(url, timeout_s=0.5, progress=False) as gen:
            return await gen.run_open(
                _system().target, workload.requests, [0.02 * i for i in range(len(heads))]
            )

    result = asyncio.run(go())
    by_status = sorted(r.status for r in result.records)
    assert by_status == [-1, 200, 200, 400, 503, 503]
    from benchmarks.stats import summarize

    s = summarize(result.records)
    assert (s.ok, s.rejected, s.errors, s.timeouts) == (2, 2, 1, 1)
    assert s.slo_p99_ms == float("inf")  # failures count as infinitely slow for the SLO


def test_slo_guard_stops_a_hopeless_run_early(fake: tuple[str, _FakeState]) -> None:
    url, state = fake
    state.sleep_s = 0.3
    arrival = ArrivalSpec(kind="poisson", rate=30, duration_s=6.0, seed=1)

    async def go():
        async with LoadGenerator(url, progress=False) as gen:
            started = time.monotonic()
            run = await Bench(gen).run(_system(), _workload([1]), arrival, SloGuard(slo_ms=100))
            return run, time.monotonic() - started

    run, elapsed = asyncio.run(go())
    assert run.aborted is not None
    assert elapsed < 30.0  # not the 6 s schedule plus a backlog (loose: a busy CPU is slow)
    assert run.summary["sent"] < len(arrival.schedule())
