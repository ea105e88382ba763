"""``python -m benchmarks path``: what the serving path costs per request (issue 42, item 1).

Tiny requests (one short text, three documents, one token) at saturation make the model's
share small, so what is left is the path: proxy, ingress, router, Ray. For each system and
request kind a closed loop (``--clients``, default 32) runs for ``--duration`` seconds after a
short warm-up; every process of the system is read from ``/proc/<pid>/stat`` before and after
the window (``benchmarks.proc_cpu``), so the report gives requests/s (answered with the
expected status), latency, and server CPU-ms per answered request split by role.

Systems: ``carpool`` (serve.yaml behind Ray's HAProxy direct ingress, as shipped),
``carpool-python-proxy`` (the same behind Serve's Python proxy), ``serve-noop`` and
``serve-noop-python-proxy`` (Serve's floor in carpool's shape: ``benchmarks.path_noop``),
``infinity`` (embed, rerank) and ``vllm`` (vLLM's OpenAI server; completion). Each system
runs only its rows; carpool starts only the apps a probe needs (the ``openai`` app fronting
them at ``/v1``). Systems are interleaved in rounds, the order rotated each round, and the
ratios are taken within a round. The load generator is the harness's own (``LoadGenerator``,
aiohttp, on the same 2 cores as every system); its CPU per request is reported beside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import path_report, peers, proc_cpu
from benchmarks.loadgen import Endpoint, LoadGenerator
from benchmarks.path_systems import (
    KINDS,
    READY_PATH,
    SYSTEM_NAMES,
    Deployed,
    PathSystem,
    make_systems,
)
from benchmarks.stats import RequestRecord, percentile
from benchmarks.targets import Answer, Target
from benchmarks.workloads import EmbedRequest, Request
from carpool import local_ray

RESULTS_JSON = peers.REPO_ROOT / "benchmarks" / "results" / "path.json"
# A client's wait for one answer: past it the request counts as lost. Long, because a closed
# loop of 32 on a model-bound row (rerank, auto) waits 32 answers' worth of compute.
REQUEST_TIMEOUT_S = 120.0
# The longest warm-up: a row still without an answer per client by then is measured anyway.
WARMUP_MAX_S = 120.0
# A window waits for --min-answers up to this many times --duration.
MAX_WINDOWS = 3
DEADLINE_HEADER = "x-carpool-deadline-ms"
DOCUMENTS = [
    "Berlin is the capital of Germany.",
    "Paris is the capital and largest city of France.",
    "Bananas are rich in potassium.",
]


@dataclass(frozen=True)
class Probe:
    """One request kind on the wire: sent unchanged by every client, all window long."""

    kind: str
    path: str
    body: dict[str, Any]
    expected: int = 200
    headers: dict[str, str] = field(default_factory=dict)


def make_probe(kind: str, model: str | None) -> Probe:
    """The request for ``kind``; ``model`` None leaves ``model`` out (Infinity's default)."""
    named = {} if model is None else {"model": model}
    if kind == "embed":
        return Probe(kind, "/v1/embeddings", {"input": "hello world", **named})
    if kind == "embed-prefix":  # the embed app's own URL (direct_ingress serves it)
        return Probe(kind, "/embed/v1/embeddings", {"input": "hello world", **named})
    if kind == "rerank":
        body = {"query": "What is the capital of France?", "documents": DOCUMENTS, **named}
        return Probe(kind, "/v1/rerank", body)
    if kind == "completion":
        return Probe(kind, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, **named})
    if kind == "chat":  # the auto row's request with model small: auto - chat = the router
        messages = [{"role": "user", "content": "What is 2+2? Reply with the digit only."}]
        return Probe(kind, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **named})
    if kind == "auto":
        # A question whose one-token answer the small model is sure of, so the router keeps it
        # on small (for "Hello" its cascade escalated 264 of 268 to large, and the row
        # measured the large model): the row then prices the router's hop, not a model.
        messages = [{"role": "user", "content": "What is 2+2? Reply with the digit only."}]
        return Probe(kind, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **named})
    if kind in ("count", "count-auto"):
        # A 1-token completion naming small, then auto. Meant to price the router at
        # completion rates, but serve.yaml's learned cascade sends this prompt to large up
        # front (every answer, 2026-11-29): count-auto - count is then what an auto request
        # routed to large costs on the path (a Ray hop from small's replica) over the same
        # request on small, at large's rate. The router's own price is auto - chat.
        return Probe(kind, "/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": 1, **named})
    if kind == "refused":
        # The cheapest honest refusal: a deadline already spent. carpool's ingress answers 504
        # before it reads the body (carpool.http.RequestControlsMiddleware), no model work.
        return Probe(
            kind,
            "/v1/embeddings",
            {"input": "hello world", **named},
            expected=504,
            headers={DEADLINE_HEADER: "0"},
        )
    raise ValueError(f"request kind {kind!r}: use one of {', '.join(KINDS)}")


class ProbeTarget(Target):
    """A ``Target`` that sends one fixed body (``LoadGenerator`` drives targets)."""

    kind = "embed"

    def __init__(self, name: str, probe: Probe) -> None:
        super().__init__(name, "")
        self.probe = probe
        self._bytes = json.dumps(probe.body, separators=(",", ":")).encode()
        self.answered_by: dict[str, int] = {}

    @property
    def path(self) -> str:
        return self.probe.path

    def encode(self, request: Request) -> bytes:
        return self._bytes

    def decode(self, request: Request, content: bytes) -> Answer:
        if self.probe.body.get("model") == "auto":  # which tier answered: the router's choice
            try:
                model = str(json.loads(content).get("model"))
            except (ValueError, AttributeError):
                model = "?"
            self.answered_by[model] = self.answered_by.get(model, 0) + 1
        return Answer(1, 0)  # otherwise only the status counts here


# Targets encode a Request; the body here is fixed, so one placeholder stands for all.
PLACEHOLDER: list[Request] = [EmbedRequest(("hello world",), 2)]


# --- per-request math --------------------------------------------------------------------


def per_request(cpu_ms: dict[str, float], answered: int) -> dict[str, float]:
    """CPU-ms per answered request for each role; NaN when nothing was answered."""
    return {k: (v / answered if answered else math.nan) for k, v in cpu_ms.items()}


def path_cpu(per_class: dict[str, float], one_process: bool) -> float:
    """The serving path's CPU per request: the total less the model's own compute. A
    one-process peer (Infinity) cannot be split: its whole process counts (an upper bound)."""
    total = sum(per_class.values())
    if one_process:
        return total
    return total - sum(v for k, v in per_class.items() if k in proc_cpu.MODEL_CLASSES)


def window_result(
    records: list[RequestRecord],
    expected: int,
    delta: proc_cpu.CpuDelta,
    elapsed_s: float,
    client_cpu_s: tuple[float, float],
    one_process: bool,
) -> dict[str, Any]:
    """One probe's figures from its records and the CPU read around it."""
    answered = [r for r in records if r.status == expected]
    n = len(answered)
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    latencies = [r.latency * 1000 for r in answered]
    per_class = per_request(delta.by_class, n)
    total = sum(per_class.values()) if n else math.nan
    return {
        "finished": len(records),  # answers of any status inside the window
        "answered": n,
        "statuses": statuses,
        "errors_sample": [r.error for r in records if r.status != expected and r.error][:3],
        "window_s": elapsed_s,
        "req_per_s": n / elapsed_s if elapsed_s > 0 else math.nan,
        "latency_ms": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)},
        "cpu_ms": delta.by_class,
        "cpu_ms_per_req": per_class,
        "total_cpu_ms_per_req": total,
        "path_cpu_ms_per_req": path_cpu(per_class, one_process) if n else math.nan,
        "one_process": one_process,
        "client_cpu_ms_per_req": {
            "process": client_cpu_s[0] * 1000 / n if n else math.nan,
            "loop_thread": client_cpu_s[1] * 1000 / n if n else math.nan,
        },
        # Share of one core the clients' event loop used: near 1 the client, not the
        # server, would set the rate.
        "client_loop_core_share": client_cpu_s[1] / elapsed_s if elapsed_s > 0 else math.nan,
        "processes": delta.by_process[:25],
        "vanished_processes": delta.vanished,
    }


# --- measuring ---------------------------------------------------------------------------


async def check(gen: LoadGenerator, probe: Probe) -> tuple[int, str]:
    """One request before any load: its status and the start of its body."""
    headers = {"content-type": "application/json", **probe.headers}
    async with gen.http.post(gen.url(probe.path), json=probe.body, headers=headers) as resp:
        return resp.status, (await resp.read())[:300].decode(errors="replace")


def snapshot(deployed: Deployed) -> proc_cpu.Snapshot:
    table = proc_cpu.process_table()
    return proc_cpu.take_snapshot(deployed.pids(table), deployed.classify, table)


async def edge(
    deployed: Deployed,
) -> tuple[float, proc_cpu.Snapshot, tuple[float, float, int]]:
    """One edge of the window: the time, the system's processes, the client's CPU (process,
    event loop thread) and the machine's busy ticks. The loop thread's time is read here, on
    that thread; the scan of /proc runs in a worker thread so the clients keep sending."""
    at, cpu = time.perf_counter(), proc_cpu.self_cpu_s()
    busy = proc_cpu.machine_busy_ticks()
    return at, await asyncio.to_thread(snapshot, deployed), (*cpu, busy)


def in_window(records: list[RequestRecord], t0: float, w0: float, w1: float) -> list[RequestRecord]:
    """Requests that finished between ``w0`` and ``w1`` (``perf_counter`` times; a record's
    times are seconds from ``t0``, its run's start): what the window's CPU paid for, in a
    steady state where as much work is in flight at its end as at its start."""
    return [r for r in records if w0 <= t0 + r.finished <= w1]


class ClosedLoop:
    """``clients`` clients, each sending the probe again as soon as its answer arrives, until
    ``stop`` is set. Requests go through ``LoadGenerator.send`` (the suite's one request path);
    this only owns the loop, so the window is set by the clock and by answers, not by a count
    fixed in advance."""

    def __init__(self, gen: LoadGenerator, endpoint: Endpoint, clients: int) -> None:
        self.gen, self.endpoint, self.clients = gen, endpoint, clients
        self.records: list[RequestRecord] = []  # in the order answers arrived
        self.stop = asyncio.Event()
        self.arrived = asyncio.Event()  # set at every answer
        self.t0 = time.perf_counter()

    async def run(self) -> None:
        request = self.endpoint.requests[0]
        body = self.endpoint.target.encode(request)
        sent = 0
        self.t0 = t0 = time.perf_counter()

        async def client() -> None:
            nonlocal sent
            while not self.stop.is_set():
                index, sent = sent, sent + 1
                now = time.perf_counter() - t0
                record = await self.gen.send(self.endpoint, request, body, index, now, t0)
                self.records.append(record)
                self.arrived.set()

        await asyncio.gather(*(client() for _ in range(self.clients)))

    async def next_answer(self) -> None:
        """Returns once the next answer has arrived (TimeoutError if none comes)."""
        self.arrived.clear()
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            await self.arrived.wait()


async def measure(
    deployed: Deployed, probe: Probe, name: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Check, warm up, then a window with CPU read at both edges.

    The warm-up lasts ``args.warmup`` s and until every client has had an answer (a
    model-bound row at 32 clients takes longer than a few seconds to reach its steady
    state), at most ``WARMUP_MAX_S``. The window runs ``args.duration`` s, longer (up to
    ``MAX_WINDOWS`` times) until ``args.min_answers`` answers came, and both its edges fall
    just after an answer: a row whose answers come in bursts (a batch of 32 reranks) then
    counts whole bursts over the time they took, not a burst more or less. After the window
    the clients stop and the loop drains outside it."""
    target = ProbeTarget(name, probe)
    endpoint = Endpoint(name, target, PLACEHOLDER, dict(probe.headers))
    async with LoadGenerator(deployed.base_url, 256, REQUEST_TIMEOUT_S, progress=False) as gen:
        await gen.wait_ready(READY_PATH, timeout_s=300)
        status, sample = await check(gen, probe)
        if status != probe.expected:
            return {"error": f"check: HTTP {status}, expected {probe.expected}: {sample}"}
        loop = ClosedLoop(gen, endpoint, args.clients)
        task = asyncio.create_task(loop.run())
        try:
            give_up = time.perf_counter() + WARMUP_MAX_S
            await asyncio.sleep(args.warmup)
            while len(loop.records) < args.clients and time.perf_counter() < give_up:
                await asyncio.sleep(0.2)
            await loop.next_answer()
            load_before = os.getloadavg()
            w0, before, cpu0 = await edge(deployed)
            first = len(loop.records)
            await asyncio.sleep(max(0.0, w0 + args.duration - time.perf_counter()))
            longest = w0 + MAX_WINDOWS * args.duration
            while len(loop.records) - first < args.min_answers and time.perf_counter() < longest:
                await loop.next_answer()
            await loop.next_answer()
            w1, after, cpu1 = await edge(deployed)
            load_after = os.getloadavg()
        finally:
            loop.stop.set()
            await task
    delta = proc_cpu.cpu_delta(before, after, proc_cpu.clock_ticks())
    client = (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])
    records = in_window(loop.records, loop.t0, w0, w1)
    out = window_result(records, probe.expected, delta, w1 - w0, client, deployed.one_process)
    # Busy CPU of the machine that is neither the system nor the harness: other work running
    # at the same time (it competes for the same 2 cores), or the kernel's own.
    busy_ms = (cpu1[2] - cpu0[2]) * 1000 / proc_cpu.clock_ticks()
    other_ms = busy_ms - sum(delta.by_class.values()) - client[0] * 1000
    out["outside_cpu_cores"] = other_ms / 1000 / (w1 - w0)
    out["machine_busy_cores"] = busy_ms / 1000 / (w1 - w0)
    out["warmup_s"] = w0 - loop.t0
    out["loadavg"] = {"before": list(load_before), "after": list(load_after)}
    out["check_answer"] = sample
    if target.answered_by:  # warm-up and drain included
        out["answered_by"] = dict(target.answered_by)
    return out


# Another Ray on the machine (a test suite) may hold the dashboard port that `ray start`
# wants without retrying; it is usually gone within seconds.
START_RETRIES, START_RETRY_WAIT_S = 2, 20.0


def start_with_retry(system: PathSystem, kinds: tuple[str, ...]) -> Deployed:
    for attempt in range(START_RETRIES + 1):
        try:
            return system.start(kinds)
        except RuntimeError as exc:
            if "already occupied" not in str(exc) or attempt == START_RETRIES:
                raise
            print(f"  {system.name}: a port is taken by another process; retrying", flush=True)
            time.sleep(START_RETRY_WAIT_S)
    raise AssertionError("unreachable")


def visit(
    system: PathSystem, kinds: list[str], args: argparse.Namespace, round_: int
) -> dict[str, Any]:
    """Every row of ``system`` in ``kinds``: one start per group of rows, then stop."""
    out: dict[str, Any] = {}
    groups: dict[str, list[str]] = {}
    for kind in kinds:
        if kind in system.kinds:
            groups.setdefault(system.group(kind), []).append(kind)
    for group, members in groups.items():
        try:
            deployed = start_with_retry(system, tuple(members))
        except Exception as exc:  # a system that cannot start is a finding, not a crash
            for kind in members:
                out[kind] = {"error": f"start: {type(exc).__name__}: {exc}"[:1500]}
            print(f"  {system.name} r{round_} {group}: {out[members[0]]['error']}", flush=True)
            continue
        try:
            out.setdefault("_facts", {})[group] = deployed.facts
            for kind in members:
                probe = make_probe(kind, system.model(kind))
                try:
                    out[kind] = asyncio.run(measure(deployed, probe, system.name, args))
                except Exception as exc:
                    out[kind] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
                print(
                    f"  {system.name} r{round_} {path_report.one_line(kind, out[kind])}", flush=True
                )
        finally:
            deployed.stop()
            time.sleep(peers.SETTLE_S)
    return out


def rounds_order(systems: list[PathSystem], round_: int) -> list[PathSystem]:
    k = round_ % len(systems) if systems else 0
    return systems[k:] + systems[:k]


# --- CLI ---------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def git_state() -> dict[str, Any]:
    """The commit measured, and which tracked files differed from it (serve.yaml and the
    product change under other engineers' hands; a figure belongs to the code it ran)."""
    import subprocess

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=peers.REPO_ROOT)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "modified": git("diff", "--name-only").split()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--systems", type=_names, default=list(SYSTEM_NAMES), help=", ".join(SYSTEM_NAMES)
    )
    p.add_argument("--requests", type=_names, default=list(KINDS), help=", ".join(KINDS))
    p.add_argument("--clients", type=int, default=32, help="closed-loop clients")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per measured window")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before a window")
    p.add_argument(
        "--min-answers",
        type=int,
        default=100,
        help=f"a window runs on (up to {MAX_WINDOWS}x --duration) until this many answers",
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds, order rotated each round")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 4 s windows, 1 s warm-up, PATH.md untouched",
    )
    p.add_argument("--out", type=Path, default=RESULTS_JSON)
    p.add_argument("--no-report", action="store_true", help="do not rewrite benchmarks/PATH.md")


def run(args: argparse.Namespace) -> int:
    os.environ.update(local_ray.ray_environment())
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.quick:
        args.duration, args.warmup = min(args.duration, 4.0), min(args.warmup, 1.0)
        args.min_answers = min(args.min_answers, 10)
    unknown = [k for k in args.requests if k not in KINDS]
    if unknown:
        raise SystemExit(f"unknown request kind(s) {unknown}: use {', '.join(KINDS)}")
    log_dir = peers.REPO_ROOT / "benchmarks" / "results" / "path"
    state_dir = Path(tempfile.mkdtemp(prefix="carpool-path-"))
    systems = make_systems(args.systems, state_dir, log_dir)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks", *sys.argv[1:]])
    t0 = time.monotonic()
    results: dict[str, Any] = {
        "command": command,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k != "handler"
        },
        "machine": {
            "nproc": len(os.sched_getaffinity(0)),
            "cpu": cpu_model(),
            "loadavg_before": list(os.getloadavg()),
            "clk_tck": proc_cpu.clock_ticks(),
        },
        "git": git_state(),
        "rounds": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        per_system: dict[str, Any] = {}
        results["rounds"].append(per_system)
        for system in rounds_order(systems, r):
            per_system[system.name] = visit(system, args.requests, args, r)
            results["machine"]["loadavg_after"] = list(os.getloadavg())
            results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
            results["wall_s"] = time.monotonic() - t0
            path_report.finish(results)
            args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if not (args.no_report or args.quick):  # a smoke run's figures are not the report's
        path_report.write_markdown(results)
    print(path_report.render_table(results))
    print(f"results: {args.out}; took {results['wall_s']:.0f} s")
    return 0
