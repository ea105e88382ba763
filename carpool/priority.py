"""CPU priority of an ingress: its own process, and (opt-in only) Ray Serve's HTTP proxy;
and of a model replica (opt-in only): its niceness, scheduling class and cores.

An ingress parses, validates and refuses; under overload all of that is the excess, and on a
node where it shares cores with model replicas it competes with them for CPU. So it may run
its own process a few nice levels lower (``IngressConfig.cpu_niceness``): that process is
carpool's, it ends with the replica, and Linux shares a contended core by weight, so it
yields without starving.

Ray's proxy is another matter. It is Ray's process, shared by every Serve app on the node,
and it answers the health checks that decide whether Serve restarts things; a priority
lowered there cannot be raised again without CAP_SYS_NICE. Lowering it
(``IngressConfig.proxy_cpu_niceness``) is an explicit opt-in for a dedicated single-node box,
off by default and in every shipped config, and it says so loudly in the log.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Where this process started: every level is relative to it (Ray starts all its workers,
# the proxy and the models alike, at the same niceness, RAY_worker_niceness).
_base_niceness: int | None = None


def apply_ingress_priority(cpu_niceness: int, proxy_cpu_niceness: int) -> None:
    """Called once by an ingress when it starts (``carpool.http.apply_ingress_defaults``)."""
    global _proxy_levels
    if cpu_niceness:
        lower_cpu_priority(cpu_niceness)
    _proxy_levels = proxy_cpu_niceness
    if proxy_cpu_niceness:
        pids = lower_proxy_priority(proxy_cpu_niceness)
        _warn_proxy_renice(proxy_cpu_niceness, pids)


def apply_replica_priority(
    cpu_niceness: int, cpu_scheduling: str = "normal", cpu_cores: list[int] | None = None
) -> None:
    """Called first by a model deployment's Serve shell (``ReplicaConfig.cpu_niceness``,
    ``cpu_scheduling`` and ``cpu_cores``), so every thread it starts and any process it
    spawns (vLLM's engine core) inherit the level and the cores."""
    if cpu_cores:
        bind_cpu_cores(cpu_cores)
    if cpu_niceness:
        lower_cpu_priority(cpu_niceness)
    if cpu_scheduling == "idle":
        idle_cpu_scheduling()


def bind_cpu_cores(cores: list[int]) -> set[int]:
    """Runs every thread of this process on ``cores`` only (new threads and processes
    inherit a thread's affinity). Only narrows what this process may already use: a core
    outside it (another pod's, or one the machine does not have) is refused with a
    ValueError naming the field, as the replica would otherwise run somewhere it was not
    told to. Returns the cores set."""
    wanted = set(cores)
    allowed = os.sched_getaffinity(0)
    outside = sorted(wanted - allowed)
    if outside:
        raise ValueError(
            f"replica.cpu_cores names cores {outside} this replica may not run on; it may use "
            f"{sorted(allowed)}: pick from those, or remove cpu_cores to use them all"
        )
    _each_thread(lambda tid: os.sched_setaffinity(tid, wanted))
    return wanted


def idle_cpu_scheduling() -> bool:
    """Moves every thread of this process to SCHED_IDLE (new threads and processes inherit
    it). Lowering a scheduling class needs no privilege; returns False where the OS refused."""
    try:
        _each_thread(lambda tid: os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0)))
    except (OSError, AttributeError) as exc:
        logger.warning("could not move this process to SCHED_IDLE (%s); it runs as is", exc)
        return False
    return True


def _each_thread(apply: Callable[[int], object]) -> None:
    """Calls ``apply`` with every thread id of this process (0, this thread, without /proc):
    Linux keeps priority and scheduling class per thread."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc") else [0]
    for tid in tids:
        try:
            apply(tid)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def lower_cpu_priority(levels: int) -> int | None:
    """Runs every thread of this process ``levels`` nice levels below where it started.

    Linux keeps a niceness per thread and a new thread inherits its creator's, so each
    existing thread is set (Ray's and gRPC's too: all of an ingress's work is the excess an
    overload brings). Raising niceness needs no privilege. Idempotent: a second call sets
    the same level. Returns the niceness set, or None where the OS refused.
    """
    global _base_niceness
    try:
        if _base_niceness is None:
            _base_niceness = os.getpriority(os.PRIO_PROCESS, 0)
        target = min(19, _base_niceness + levels)
        _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, target))
    except OSError as exc:
        logger.warning("could not lower this process's CPU priority (%s); it runs as is", exc)
        return None
    return target


# Nice levels for Serve's HTTP proxy on this node (IngressConfig.proxy_cpu_niceness; 0: the
# proxy is left alone), and when they were last applied: a restarted proxy starts at Ray's
# level again.
_proxy_levels = 0
_proxy_checked_at = -math.inf
_proxy_warned = False
# Overload refusals re-check the proxy at most this often (a /proc scan costs ~1-5 ms).
PROXY_RECHECK_S = 10.0
PROXY_TITLE = b"ray::ProxyActor"


def _warn_proxy_renice(levels: int, pids: list[int]) -> None:
    """Once per process: this ingress reaches into a process carpool does not own."""
    global _proxy_warned
    if _proxy_warned:
        return
    _proxy_warned = True
    logger.warning(
        "ingress.proxy_cpu_niceness=%d: RENICING RAY SERVE'S HTTP PROXY on this node (pids %s), "
        "a process carpool does not own. It is shared by every Serve app on the node and "
        "answers Serve's health checks, and its priority cannot be raised again without "
        "CAP_SYS_NICE (only restarting the proxy undoes it). Meant for a dedicated single-node "
        "box: anywhere else set proxy_cpu_niceness: 0 (the default).",
        levels,
        ", ".join(map(str, pids)) or "none found yet; re-checked while refusing",
    )


def _parent_pid(proc: str, pid: str) -> int | None:
    with open(f"{proc}/{pid}/status") as f:
        for line in f:
            if line.startswith("PPid:"):
                return int(line.split()[1])
    return None


def serve_proxy_pids(proc: str = "/proc", parent: int | None = None) -> list[int]:
    """PIDs of Ray Serve HTTP proxies of this node's raylet (``parent``) run by this user.

    Ray's raylet starts every worker of its node, the proxy and this replica alike, so the
    proxy of this cluster is the one that shares this process's parent; another cluster on
    the same machine (a second ``serve run``, a benchmark) is left alone.
    """
    parent = os.getppid() if parent is None else parent
    pids = []
    uid = os.getuid()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"{proc}/{entry}").st_uid != uid:
                continue
            with open(f"{proc}/{entry}/cmdline", "rb") as f:
                title = f.read(64)
            if title.startswith(PROXY_TITLE) and _parent_pid(proc, entry) == parent:
                pids.append(int(entry))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return pids


def lower_proxy_priority(levels: int, parent: int | None = None) -> list[int]:
    """Runs Serve's HTTP proxy on this node ``levels`` nice levels below the model replicas.

    Only with ``IngressConfig.proxy_cpu_niceness`` set (see the module docstring for why it
    is opt-in). The proxy parses every request an overload brings and answers each refusal:
    measured at 10x capacity on 2 cores, ~6 ms of CPU per refused request, half a core at
    the same priority as the model replica computing beside it, which lost a quarter of its
    core. Lowered, it only takes CPU the models leave; with an idle core it changes nothing.
    The level is relative to where this process started. A thread is never raised: only its
    owner or a privileged user may do that. ``parent``: the raylet (default: this process's
    parent). Returns the PIDs changed.
    """
    global _proxy_checked_at
    _proxy_checked_at = time.monotonic()
    try:
        base = _base_niceness if _base_niceness is not None else os.getpriority(os.PRIO_PROCESS, 0)
        target = min(19, base + levels)
        changed = []
        for pid in serve_proxy_pids(parent=parent):
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    if os.getpriority(os.PRIO_PROCESS, int(tid)) < target:
                        os.setpriority(os.PRIO_PROCESS, int(tid), target)
                changed.append(pid)
            except (ProcessLookupError, FileNotFoundError):  # exited meanwhile
                continue
    except OSError as exc:
        logger.warning("could not lower the Serve proxy's CPU priority (%s); it runs as is", exc)
        return []
    return changed


def recheck_proxy_priority() -> None:
    """While refusing: re-applies an opted-in proxy niceness to a proxy restarted since."""
    if _proxy_levels and time.monotonic() - _proxy_checked_at >= PROXY_RECHECK_S:
        lower_proxy_priority(_proxy_levels)
