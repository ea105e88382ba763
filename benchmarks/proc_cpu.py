"""CPU time of a system under test, per process and per role, from ``/proc/<pid>/stat``.

``python -m benchmarks path`` reads every process of the system before and after a measured
window; the difference in ``utime + stime`` (clock ticks) is what each process spent serving
the window's requests, background work included. Processes are grouped into roles
(``classify``) so a report can say where a request's CPU goes: Serve's proxy, HAProxy, the
ingress replicas, the router, the models, vLLM's engine, Ray's own daemons, or a peer server.

Parsing, classification and the arithmetic are pure (tests feed them hand-made ``/proc``
text); only ``read_stat``, ``read_argv`` and ``process_table`` touch the file system.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
# Roles, in the order reports list them.
CLASSES: tuple[str, ...] = (
    "ray_proxy",
    "haproxy",
    "ingress",
    "router",
    "model",
    "engine",
    "ray_system",
    "peer",
)
# Roles whose CPU is the model's own compute: a request's "path" cost is the rest.
MODEL_CLASSES = frozenset({"model", "engine"})
# carpool's model deployments (embedder, ranker, the two generators) and serve-noop's
# stand-in for a model (benchmarks.path_noop).
MODEL_DEPLOYMENTS = frozenset({"embedder", "ranker", "small", "large", "noop_model"})
ROUTER_DEPLOYMENTS = frozenset({"router"})


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` this module uses (times in clock ticks)."""

    pid: int
    comm: str
    ppid: int
    session: int
    utime: int
    stime: int
    starttime: int  # ticks after boot: tells a process from a later one with the same pid

    @property
    def ticks(self) -> int:
        return self.utime + self.stime


def parse_stat(text: str) -> ProcStat:
    """One ``/proc/<pid>/stat`` line. ``comm`` may hold spaces and ')' (a thread can name
    itself anything), so the fields are split after the *last* ')'."""
    head, sep, rest = text.rpartition(")")
    if not sep:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    pid_text, _, comm = head.partition(" (")
    f = rest.split()
    # f[0] is field 3 (state): field n of proc(5) is f[n - 3].
    return ProcStat(
        pid=int(pid_text),
        comm=comm,
        ppid=int(f[1]),
        session=int(f[3]),
        utime=int(f[11]),
        stime=int(f[12]),
        starttime=int(f[19]),
    )


def read_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    """The process's stat, or None once it is gone."""
    try:
        return parse_stat((proc / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def read_argv(pid: int, proc: Path = PROC) -> list[str]:
    """The process's command line as its argv (a process title set by setproctitle is one
    element, possibly with spaces); [] for a kernel thread or a process that is gone."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def process_table(proc: Path = PROC) -> dict[int, ProcStat]:
    """Every process now: ``{pid: ProcStat}``."""
    table: dict[int, ProcStat] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name), proc)
            if stat is not None:
                table[stat.pid] = stat
    return table


def descendants(table: Mapping[int, ProcStat], roots: Iterable[int]) -> set[int]:
    """``roots`` (those alive) and every process below them."""
    children: dict[int, list[int]] = {}
    for stat in table.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found: set[int] = set()
    todo = [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def ray_session_pids(
    table: Mapping[int, ProcStat], argvs: Mapping[int, list[str]], marker: str, exclude: int
) -> set[int]:
    """A private Ray's processes: those whose command line names ``marker`` (its session
    folder: raylet, gcs_server, the dashboard agent, the log monitor) and everything below
    them (workers, replicas, HAProxy, vLLM's engine). ``exclude``: the harness itself, which
    is connected to that Ray as a driver and is measured as the client."""
    roots = [pid for pid, argv in argvs.items() if any(marker in a for a in argv)]
    return descendants(table, roots) - {exclude}


def serve_deployment(title: str) -> str | None:
    """``ray::ServeReplica:<app>:<deployment>[.method]`` -> the deployment; else None."""
    if not title.startswith("ray::ServeReplica:"):
        return None
    rest = title.removeprefix("ray::ServeReplica:").split()[0]
    _, _, deployment = rest.partition(":")
    # While a replica runs a method Ray appends it: ``...:embedder.handle_request``.
    return deployment.split(".", 1)[0] or None


def is_haproxy(argv: list[str], comm: str) -> bool:
    """HAProxy itself: ``<path>/haproxy -db -f <config>`` (Ray's HAProxyManager starts it so,
    possibly through a wrapper script that execs the real binary: then the binary's own
    command line is what /proc shows)."""
    if comm == "haproxy":
        return True
    return bool(argv) and "haproxy" in os.path.basename(argv[0]) and "-f" in argv


def classify_ray(
    argv: list[str],
    comm: str,
    model_deployments: Collection[str] = MODEL_DEPLOYMENTS,
    router_deployments: Collection[str] = ROUTER_DEPLOYMENTS,
) -> str:
    """The role of one process of a Ray Serve system (carpool, serve-noop).

    Titles are checked before the binary: a Ray worker's title replaces its command line,
    and ``ray::HAProxyManager`` (Ray's actor that manages HAProxy) is Ray's, not HAProxy.
    """
    title = " ".join(argv)
    if title.startswith("ray::"):
        if title.startswith("ray::ProxyActor"):
            return "ray_proxy"
        deployment = serve_deployment(title)
        if deployment is None:
            return "ray_system"  # ServeController, HAProxyManager, idle workers
        if deployment in model_deployments:
            return "model"
        if deployment in router_deployments:
            return "router"
        if deployment.lower().endswith("ingress"):
            return "ingress"
        return "ray_system"
    if title.startswith("VLLM::") or comm.startswith("VLLM::"):
        return "engine"
    if is_haproxy(argv, comm):
        return "haproxy"
    return "ray_system"  # gcs_server, raylet, dashboard agent, log monitor, ...


def classify_peer(argv: list[str], comm: str) -> str:
    """The role of one process of a peer server: vLLM's engine processes (titled
    ``VLLM::EngineCore``, ``VLLM::Worker...``) compute the model; the rest is the server."""
    if " ".join(argv).startswith("VLLM::") or comm.startswith("VLLM::"):
        return "engine"
    return "peer"


Classifier = Callable[[list[str], str], str]


@dataclass
class ProcInfo:
    """One process of the system at a snapshot."""

    stat: ProcStat
    role: str
    title: str


@dataclass
class Snapshot:
    """Every process of a system at one instant, each with its role."""

    procs: dict[int, ProcInfo] = field(default_factory=dict)


def take_snapshot(
    pids: Iterable[int],
    classify: Classifier,
    table: Mapping[int, ProcStat] | None = None,
    argv_of: Callable[[int], list[str]] = read_argv,
) -> Snapshot:
    table = process_table() if table is None else table
    snap = Snapshot()
    for pid in pids:
        stat = table.get(pid)
        if stat is None:
            continue
        argv = argv_of(pid)
        snap.procs[pid] = ProcInfo(stat, classify(argv, stat.comm), " ".join(argv)[:160])
    return snap


@dataclass
class CpuDelta:
    """CPU each role spent between two snapshots, in ms, and the processes behind it."""

    by_class: dict[str, float]
    by_process: list[dict[str, object]]
    vanished: int  # processes seen before and gone after: their last CPU is not counted


def cpu_delta(before: Snapshot, after: Snapshot, clk_tck: int) -> CpuDelta:
    """What each process spent between ``before`` and ``after``, summed by role.

    A process that started during the window counts whole (all its CPU is the window's); one
    whose pid now names another process (different start time) counts as new. A process
    that exited during the window is counted as vanished: its CPU since ``before`` went to
    its parent's ``cutime`` (not read here, so a long-lived child's earlier CPU is never
    counted twice). The role is the one seen first (a replica's title changes with the
    method it runs).
    """
    ms_per_tick = 1000.0 / clk_tck
    by_class = {c: 0.0 for c in CLASSES}
    rows: list[dict[str, object]] = []
    for pid, now in after.procs.items():
        was = before.procs.get(pid)
        same = was is not None and was.stat.starttime == now.stat.starttime
        ticks = now.stat.ticks - (was.stat.ticks if same and was is not None else 0)
        role = was.role if same and was is not None else now.role
        ms = max(ticks, 0) * ms_per_tick
        by_class[role] = by_class.get(role, 0.0) + ms
        rows.append({"pid": pid, "role": role, "title": now.title, "cpu_ms": ms, "new": not same})
    vanished = sum(
        1
        for pid, was in before.procs.items()
        if pid not in after.procs or after.procs[pid].stat.starttime != was.stat.starttime
    )
    rows.sort(key=lambda r: -float(r["cpu_ms"]))  # type: ignore[arg-type]
    return CpuDelta(by_class, rows, vanished)


def parse_busy_ticks(proc_stat: str) -> int:
    """Busy ticks of the whole machine from ``/proc/stat``'s first ``cpu`` line: every field
    but idle and iowait (guest time is already inside user). What a window's processes do
    not account for is other work on the machine, or the kernel's for nobody in particular."""
    fields = proc_stat.splitlines()[0].split()
    if fields[0] != "cpu":
        raise ValueError(f"not /proc/stat: {proc_stat[:40]!r}")
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(values) - values[3] - values[4]


def machine_busy_ticks(proc: Path = PROC) -> int:
    return parse_busy_ticks((proc / "stat").read_text())


def self_cpu_s() -> tuple[float, float]:
    """(this process's CPU seconds, this thread's): the harness is the client; its event
    loop runs on the main thread, Ray's driver threads (when connected) on others."""
    import time

    return time.process_time(), time.thread_time()


def clock_ticks() -> int:
    return int(os.sysconf("SC_CLK_TCK"))
