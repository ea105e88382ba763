"""How many torch threads a model pass runs on (the replica's ``thread_policy``).

A replica's ``num_cpus`` is what Ray reserves for it, so that every replica of a serve config
fits on its nodes. It is a floor, not what the node has free: on a 2-core machine serving
embeddings alone, an embedder sized to its 0.5 CPU computes on one core while the other idles
(the peer it is compared with, Infinity, computes on both). ``idle_cores`` lets each pass take
the cores that no other process used over the previous pass, and gives them back within one
pass once another replica needs them.

Policies are plain objects (no torch, no Ray); the sampler is injected, so the arithmetic is
tested with made-up samples. ``carpool.models.ThreadedForward`` applies the count.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# A window shorter than this says little about other processes' load (a scheduler tick is
# 4 ms): the previous decision stands.
MIN_WINDOW_S = 0.05
# Clock ticks per second of /proc/stat (USER_HZ; 100 on every Linux build that matters).
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU counters at one instant."""

    at_s: float  # monotonic wall clock
    busy_s: float  # CPU-seconds the cores this process may use were busy, by anyone
    own_s: float  # CPU-seconds this process used (all its threads)


class CpuSampler(Protocol):
    cores: int  # how many cores this process may run on

    def sample(self) -> CpuSample | None: ...  # None when the counters cannot be read


def usable_cores(root: Path = Path("/")) -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = (root / "sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


class ProcStatSampler:
    """Linux counters: ``/proc/stat`` for the cores in this process's affinity, and the
    process's own CPU time. Where they cannot be read, ``sample`` returns None and the policy
    keeps the reserved threads.
    """

    def __init__(self, proc: Path = Path("/proc"), cores: int | None = None) -> None:
        self.proc = proc
        try:
            self._cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self._cpus = None  # every cpuN line
        self.cores = cores if cores is not None else usable_cores()

    def sample(self) -> CpuSample | None:
        try:
            lines = (self.proc / "stat").read_text().splitlines()
        except OSError:
            return None
        busy_ticks = 0
        seen = False
        for line in lines:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or name == "cpu":
                continue
            if self._cpus is not None and name not in self._cpus:
                continue
            fields = [int(v) for v in rest.split()]
            # user nice system idle iowait irq softirq steal (guest time is inside user):
            # idle and iowait are free; steal is time the host did not give us, so busy.
            busy_ticks += sum(fields[:3]) + sum(fields[5:8])
            seen = True
        if not seen:
            return None
        return CpuSample(time.monotonic(), busy_ticks / CLOCK_TICKS, time.process_time())


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
        sampler = sampler or ProcStatSampler()
        return IdleCoreThreads(reserved, ceiling or sampler.cores, sampler)
    raise ValueError(f"thread_policy {name!r} is not one of {list(THREAD_POLICIES)}")
