"""How many torch threads a model pass runs on (the replica's ``thread_policy``).

A replica's ``num_cpus`` is what Ray reserves for it, so that every replica of a serve config
fits on its nodes. It is a floor, not what the node has free: on a 2-core machine serving
embeddings alone, an embedder sized to its 0.5 CPU computes on one core while the other idles
(the peer it is compared with, Infinity, computes on both). ``idle_cores`` lets each pass take
the cores that no other process of this container used over the previous pass (within its
CPU quota), and gives them back within one pass once another replica needs them. It sees only
its own cgroup: on a shared node, other tenants' load is theirs to bound, and a cluster config
keeps ``reserved`` (only the single-box ``serve.yaml`` turns ``idle_cores`` on).

Policies are plain objects (no torch, no Ray); the sampler is injected, so the arithmetic is
tested with made-up samples. ``size_torch_threads`` sizes torch's threads to the replica, and
``ThreadedForward`` (``threaded_forward``) applies a policy's count before each pass.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from carpool.config import ReplicaConfig

P = TypeVar("P")
R = TypeVar("R")

# A window shorter than this says little about other processes' load (a scheduler tick is
# 4 ms): the previous decision stands.
MIN_WINDOW_S = 0.05
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU counters at one instant."""

    at_s: float  # monotonic wall clock
    busy_s: float  # CPU-seconds this container (cgroup) used, all its processes
    own_s: float  # CPU-seconds this process used (all its threads)


class CpuSampler(Protocol):
    cores: int  # how many cores this process may run on

    def sample(self) -> CpuSample | None: ...  # None when the counters cannot be read


def _cgroup_paths(root: Path) -> dict[str, str]:
    """This process's cgroup path per controller ("" for the v2 unified hierarchy)."""
    paths: dict[str, str] = {}
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:  # not a hierarchy line: nothing to learn from it
            continue
        _, controllers, path = fields
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path.lstrip("/")
    return paths


def _v1_dir(root: Path, paths: dict[str, str], controller: str) -> Path | None:
    # v1 mounts a controller alone or co-mounted (cpu,cpuacct); the process's own cgroup
    # folder is where its quota and usage are, and a container sees its own as "/".
    for mount in (controller, "cpu,cpuacct", "cpuacct,cpu"):
        base = root / "sys/fs/cgroup" / mount
        if base.is_dir():
            own = base / paths.get(controller, "")
            return own if own.is_dir() else base
    return None


def _v2_dir(root: Path, paths: dict[str, str]) -> Path | None:
    base = root / "sys/fs/cgroup"
    if not (base / "cgroup.controllers").is_file():
        return None
    own = base / paths.get("", "")
    return own if own.is_dir() else base


def cgroup_quota_cores(root: Path = Path("/")) -> float | None:
    """This container's CPU quota in cores (cgroup v2 ``cpu.max`` or v1 CFS quota); None
    when it has none or it cannot be read."""
    paths = _cgroup_paths(root)
    try:
        v2 = _v2_dir(root, paths)
        if v2 is not None and (v2 / "cpu.max").is_file():
            quota, period = (v2 / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = _v1_dir(root, paths, "cpu")
        if v1 is not None:
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((v1 / "cpu.cfs_period_us").read_text())
            return None if quota_us < 0 else quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def usable_cores(root: Path = Path("/"), affinity: int | None = None) -> int:
    """Cores this process may run on: its CPU affinity (``affinity``: how many; default this
    process's), capped by its cgroup's CPU quota (v2 or v1), rounded down. A quota of 1.5
    cores on a 16-core node gives 1, not 2: two busy threads would spend 2 CPU-seconds a
    second against 1.5 allowed, so the kernel would stop the whole container (its other
    processes too) for a quarter of every CFS period, and a pass waits for its slowest
    thread; one thread is never throttled and leaves the half core to tokenizing and Ray."""
    if affinity is not None:
        cores = affinity
    else:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    quota = cgroup_quota_cores(root)
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


class CgroupSampler:
    """This container's own CPU use: its cgroup's usage counter (v2 ``cpu.stat``
    ``usage_usec``, v1 ``cpuacct.usage``), never the whole node's ``/proc/stat``, which in a
    container is every tenant's CPU. Where it cannot be read, ``sample`` returns None and the
    policy keeps the reserved threads.
    """

    def __init__(self, root: Path = Path("/"), cores: int | None = None) -> None:
        self.root = root
        paths = _cgroup_paths(root)
        self._v2 = _v2_dir(root, paths)
        self._v1 = _v1_dir(root, paths, "cpuacct")
        self.cores = cores if cores is not None else usable_cores(root)

    def usage_s(self) -> float | None:
        try:
            if self._v2 is not None and (self._v2 / "cpu.stat").is_file():
                for line in (self._v2 / "cpu.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "usage_usec":
                        return int(value) / 1e6
            if self._v1 is not None:
                return int((self._v1 / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            pass
        return None

    def sample(self) -> CpuSample | None:
        used = self.usage_s()
        if used is None:
            return None
        return CpuSample(time.monotonic(), used, time.process_time())


class ThreadPolicy(Protocol):
    def threads(self) -> int: ...  # threads for the pass about to start


class ReservedThreads:
    """A fixed count: ``torch_threads``, else ``ceil(num_cpus)``."""

    def __init__(self, threads: int) -> None:
        self.count = max(1, threads)

    def threads(self) -> int:
        return self.count


class IdleCoreThreads:
    """The reserved threads plus the cores nobody else kept busy since the last pass began.

    Others' load over the window is all the cores' busy time minus this process's own (its
    pass, tokenizing, Ray's threads), so a pass never counts itself as competition. The free
    cores are rounded to the nearest whole: a proxy at 0.3 core leaves room for a second
    thread, another replica's busy core does not.
    """

    def __init__(self, floor: int, ceiling: int, sampler: CpuSampler) -> None:
        self.floor = max(1, floor)
        self.ceiling = max(self.floor, min(ceiling, sampler.cores))
        self.sampler = sampler
        self._last: CpuSample | None = None
        self.current = self.floor
        self.others_cores = 0.0  # the last window's estimate, for describe() and tests

    def threads(self) -> int:
        now = self.sampler.sample()
        if now is None:
            self.current = self.floor
            return self.current
        last = self._last
        if last is None:
            self._last = now
            return self.current
        window = now.at_s - last.at_s
        if window < MIN_WINDOW_S:
            return self.current
        others = (now.busy_s - last.busy_s) - (now.own_s - last.own_s)
        self.others_cores = max(0.0, others / window)
        free = self.sampler.cores - self.others_cores
        self.current = min(self.ceiling, max(self.floor, math.floor(free + 0.5)))
        self._last = now
        return self.current


THREAD_POLICIES = ("reserved", "idle_cores")


def make_thread_policy(
    name: str, reserved: int, ceiling: int | None = None, sampler: CpuSampler | None = None
) -> ThreadPolicy:
    """The policy called ``name``; ``reserved`` threads are its floor."""
    if name == "reserved":
        return ReservedThreads(reserved)
    if name == "idle_cores":
        sampler = sampler or CgroupSampler()
        if sampler.sample() is None:
            logger.warning(
                "thread_policy idle_cores cannot read this container's CPU use (no cgroup v2 "
                "cpu.stat or v1 cpuacct.usage); running %d reserved threads instead",
                reserved,
            )
            return ReservedThreads(reserved)
        return IdleCoreThreads(reserved, ceiling or sampler.cores, sampler)
    raise ValueError(f"thread_policy {name!r} is not one of {list(THREAD_POLICIES)}")


def size_torch_threads(num_cpus: float | None, explicit: int | None = None) -> int:
    """Sets torch's intra-op threads to what the replica really has.

    Without this every replica starts one thread per machine core and replicas that share
    a node fight over cores (on 2 cores, 3 replicas x 2 threads thrash).
    """
    import torch

    if explicit is not None:
        threads = explicit
    elif num_cpus is not None and num_cpus > 0:
        threads = max(1, math.ceil(num_cpus))
    else:
        threads = max(1, os.cpu_count() or 1)
    threads = min(threads, os.cpu_count() or threads)
    torch.set_num_threads(threads)
    return threads


class ThreadedForward(Generic[P, R]):
    """A model's blocking ``forward`` that sets torch's threads from a policy before each pass.

    The count is set in the thread that runs the pass: OpenMP keeps the thread count per
    calling thread, and passes run in worker threads (``asyncio.to_thread``).
    """

    def __init__(self, forward: Callable[[list[P]], list[R]], policy: ThreadPolicy) -> None:
        import torch

        self._torch = torch  # looked up once, not on every pass
        self.forward = forward
        self.policy = policy
        self.last_threads: int | None = None

    def __call__(self, batch: list[P]) -> list[R]:
        threads = self.policy.threads()
        if self._torch.get_num_threads() != threads:
            self._torch.set_num_threads(threads)
        self.last_threads = threads
        return self.forward(batch)


def threaded_forward(
    forward: Callable[[list[P]], list[R]], replica: ReplicaConfig
) -> Callable[[list[P]], list[R]]:
    """Sizes torch's threads for ``replica`` and returns the forward its passes should call."""
    reserved = size_torch_threads(replica.num_cpus, replica.torch_threads)
    if replica.thread_policy == "reserved":
        return forward
    policy = make_thread_policy(replica.thread_policy, reserved, replica.max_torch_threads)
    return ThreadedForward(forward, policy)
