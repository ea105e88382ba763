"""Thread policies: the idle-core arithmetic on made-up counters, the Linux sampler on made-up
/proc and cgroup files, and the wrapper that applies a count in the thread running the pass."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from carpool.threads import (
    CgroupSampler,
    CpuSample,
    IdleCoreThreads,
    ReservedThreads,
    cgroup_quota_cores,
    make_thread_policy,
    usable_cores,
)


class ScriptedCounters:
    """A sampler whose counters advance as a test says: wall seconds, others' and own CPU."""

    def __init__(self, cores: int = 2) -> None:
        self.cores = cores
        self.now = CpuSample(100.0, 1000.0, 10.0)
        self.readable = True

    def advance(self, wall_s: float, others_cores: float, own_cores: float) -> None:
        own = own_cores * wall_s
        busy = (others_cores + own_cores) * wall_s
        n = self.now
        self.now = CpuSample(n.at_s + wall_s, n.busy_s + busy, n.own_s + own)

    def sample(self) -> CpuSample | None:
        return self.now if self.readable else None


def test_idle_cores_takes_the_cores_no_one_else_uses() -> None:
    counters = ScriptedCounters(cores=2)
    policy = IdleCoreThreads(floor=1, ceiling=2, sampler=counters)
    assert policy.threads() == 1  # nothing measured yet: the reservation
    # A pass of our own on one core while the rest of the node idles: take both.
    counters.advance(0.5, others_cores=0.0, own_cores=1.0)
    assert policy.threads() == 2
    # Our own two-thread pass keeps both cores busy; that is not competition.
    counters.advance(0.5, others_cores=0.0, own_cores=2.0)
    assert policy.threads() == 2
    # Ray's proxy at 0.3 core leaves room for the second thread.
    counters.advance(0.5, others_cores=0.3, own_cores=1.7)
    assert policy.threads() == 2
    # Another replica starts computing on a whole core: give it back on the next pass.
    counters.advance(0.5, others_cores=1.0, own_cores=1.0)
    assert policy.threads() == 1
    assert policy.others_cores == pytest.approx(1.0)
    # It stops: the core comes back.
    counters.advance(0.5, others_cores=0.0, own_cores=1.0)
    assert policy.threads() == 2


def test_idle_cores_never_goes_below_the_reservation_or_above_the_ceiling() -> None:
    counters = ScriptedCounters(cores=8)
    policy = IdleCoreThreads(floor=2, ceiling=4, sampler=counters)
    policy.threads()
    counters.advance(1.0, others_cores=8.0, own_cores=0.0)  # a saturated node
    assert policy.threads() == 2
    counters.advance(1.0, others_cores=0.0, own_cores=2.0)  # an idle one
    assert policy.threads() == 4
    # The ceiling is also capped by the cores the process may run on.
    assert IdleCoreThreads(floor=1, ceiling=16, sampler=ScriptedCounters(cores=2)).ceiling == 2


def _on_idle_pair() -> tuple[ScriptedCounters, IdleCoreThreads]:
    """A 2-core node whose policy has already seen one idle window (two threads)."""
    counters = ScriptedCounters(cores=2)
    policy = IdleCoreThreads(floor=1, ceiling=2, sampler=counters)
    policy.threads()
    counters.advance(1.0, others_cores=0.0, own_cores=1.0)
    assert policy.threads() == 2
    return counters, policy


def test_idle_cores_keeps_its_count_over_a_window_too_short_to_judge() -> None:
    counters, policy = _on_idle_pair()
    counters.advance(0.01, others_cores=2.0, own_cores=0.0)  # 10 ms: noise
    assert policy.threads() == 2
    # The short window is not lost: it counts in the next long enough one.
    counters.advance(0.09, others_cores=2.0, own_cores=0.0)
    assert policy.threads() == 1


def test_unreadable_counters_fall_back_to_the_reservation() -> None:
    counters, policy = _on_idle_pair()
    counters.readable = False
    assert policy.threads() == 1


def test_policies_are_picked_by_name() -> None:
    assert isinstance(make_thread_policy("reserved", 3), ReservedThreads)
    assert make_thread_policy("reserved", 3).threads() == 3
    idle = make_thread_policy("idle_cores", 1, 2, sampler=ScriptedCounters(cores=4))
    assert isinstance(idle, IdleCoreThreads) and idle.ceiling == 2
    with pytest.raises(ValueError, match="not one of"):
        make_thread_policy("all_of_them", 1)


def _cgroup_v2(root: Path, cpu_max: str, usage_usec: int, own: str = "pod/replica") -> Path:
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text(f"0::/{own}\n")
    base = root / "sys/fs/cgroup"
    base.mkdir(parents=True, exist_ok=True)
    (base / "cgroup.controllers").write_text("cpu memory\n")
    # The node's root counters: every tenant's CPU, which the sampler must not read.
    (base / "cpu.stat").write_text("usage_usec 999999999999\n")
    mine = base / own
    mine.mkdir(parents=True, exist_ok=True)
    (mine / "cpu.max").write_text(cpu_max + "\n")
    (mine / "cpu.stat").write_text(f"usage_usec {usage_usec}\nuser_usec 1\n")
    return root


def _cgroup_v1(root: Path, quota_us: int, usage_ns: int, own: str = "docker/abc") -> Path:
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text(f"12:memory:/{own}\n4:cpu,cpuacct:/{own}\n0::/\n")
    base = root / "sys/fs/cgroup/cpu,cpuacct"
    (base / own).mkdir(parents=True)
    (base / "cpuacct.usage").write_text("999999999999999\n")  # the node's, not ours
    (base / own / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (base / own / "cpu.cfs_period_us").write_text("100000\n")
    (base / own / "cpuacct.usage").write_text(f"{usage_ns}\n")
    return root


def test_usable_cores_honours_a_cgroup_v2_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    root = _cgroup_v2(tmp_path, "max 100000", 0)
    assert usable_cores(root) == affinity
    _cgroup_v2(tmp_path, "150000 100000", 0)  # 1.5 CPUs: one whole thread
    assert usable_cores(root) == 1
    assert cgroup_quota_cores(root) == pytest.approx(1.5)


def test_usable_cores_honours_a_cgroup_v1_quota(tmp_path: Path) -> None:
    root = _cgroup_v1(tmp_path / "a", quota_us=150_000, usage_ns=0)
    assert usable_cores(root) == 1 and cgroup_quota_cores(root) == pytest.approx(1.5)
    unlimited = _cgroup_v1(tmp_path / "b", quota_us=-1, usage_ns=0)
    assert cgroup_quota_cores(unlimited) is None
    assert usable_cores(unlimited) == len(os.sched_getaffinity(0))


def test_the_sampler_reads_this_containers_usage_not_the_nodes(tmp_path: Path) -> None:
    v2 = CgroupSampler(_cgroup_v2(tmp_path / "v2", "200000 100000", usage_usec=2_500_000))
    sample = v2.sample()
    assert sample is not None and sample.busy_s == pytest.approx(2.5)
    assert v2.cores == min(2, len(os.sched_getaffinity(0)))
    v1 = CgroupSampler(_cgroup_v1(tmp_path / "v1", quota_us=300_000, usage_ns=4_000_000_000))
    sample = v1.sample()
    assert sample is not None and sample.busy_s == pytest.approx(4.0)


def test_a_quota_of_one_and_a_half_cores_on_a_16_core_node_gives_one_thread(
    tmp_path: Path,
) -> None:
    """Rounded down (usable_cores says why): 2 threads would be throttled a quarter of the time."""
    v2 = _cgroup_v2(tmp_path / "v2", "150000 100000", 0)
    v1 = _cgroup_v1(tmp_path / "v1", quota_us=150_000, usage_ns=0)
    assert usable_cores(v2, affinity=16) == usable_cores(v1, affinity=16) == 1
    assert usable_cores(_cgroup_v2(tmp_path / "w", "350000 100000", 0), affinity=16) == 3
    assert usable_cores(_cgroup_v2(tmp_path / "x", "50000 100000", 0), affinity=16) == 1
    assert usable_cores(_cgroup_v2(tmp_path / "y", "max 100000", 0), affinity=16) == 16
    assert usable_cores(_cgroup_v1(tmp_path / "z", quota_us=-1, usage_ns=0), affinity=16) == 16
    # The affinity caps a loose quota.
    assert usable_cores(_cgroup_v2(tmp_path / "q", "800000 100000", 0), affinity=4) == 4


def test_v1_with_cpu_and_cpuacct_mounted_apart_reads_both(tmp_path: Path) -> None:
    """As on hosts that mount each v1 controller alone (/sys/fs/cgroup/cpu, .../cpuacct)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("3:cpuacct:/job\n2:cpu:/job\n1:name=systemd:/\n")
    for controller in ("cpu", "cpuacct"):
        (tmp_path / "sys/fs/cgroup" / controller / "job").mkdir(parents=True)
    cpu = tmp_path / "sys/fs/cgroup/cpu/job"
    (cpu / "cpu.cfs_quota_us").write_text("250000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "sys/fs/cgroup/cpuacct/job/cpuacct.usage").write_text("7000000000\n")
    assert cgroup_quota_cores(tmp_path) == pytest.approx(2.5)
    sampler = CgroupSampler(tmp_path)
    sample = sampler.sample()
    assert sample is not None and sample.busy_s == pytest.approx(7.0)
    assert sampler.cores == min(2, len(os.sched_getaffinity(0)))


def test_a_garbled_cgroup_file_is_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("garbage\n\n")
    assert cgroup_quota_cores(tmp_path) is None
    assert CgroupSampler(tmp_path, cores=2).sample() is None


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_this_cgroups_usage_drives_idleness_not_the_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """The node is saturated by other tenants (its /proc/stat and root cgroup say so); this
    container's own counter decides: idle, it takes its quota; busy, it steps back."""
    import types

    from carpool import threads

    if version == "v2":
        root = _cgroup_v2(tmp_path, "400000 100000", 0)
        counter = root / "sys/fs/cgroup/pod/replica/cpu.stat"

        def write(used_s: float) -> None:
            counter.write_text(f"usage_usec {round(used_s * 1e6)}\n")

    else:
        root = _cgroup_v1(tmp_path, quota_us=400_000, usage_ns=0)
        counter = root / "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpuacct.usage"

        def write(used_s: float) -> None:
            counter.write_text(f"{round(used_s * 1e9)}\n")

    (root / "proc/stat").write_text("cpu0 99999 0 99999 0 0 0 0 0 0 0\n")  # every core busy
    clock = {"wall": 100.0, "own": 10.0, "cgroup": 50.0}
    monkeypatch.setattr(
        threads,
        "time",
        types.SimpleNamespace(monotonic=lambda: clock["wall"], process_time=lambda: clock["own"]),
    )

    def advance(others_cores: float, own_cores: float) -> None:
        clock["wall"] += 1.0
        clock["own"] += own_cores
        clock["cgroup"] += own_cores + others_cores
        write(clock["cgroup"])

    write(clock["cgroup"])
    sampler = CgroupSampler(root, cores=usable_cores(root, affinity=16))
    assert sampler.cores == 4  # the quota, not the node's 16
    policy = make_thread_policy("idle_cores", 1, sampler=sampler)
    assert isinstance(policy, IdleCoreThreads)
    assert policy.threads() == 1  # nothing measured yet
    advance(others_cores=0.0, own_cores=1.0)  # alone in the container
    assert policy.threads() == 4
    advance(others_cores=2.0, own_cores=2.0)  # another replica of the container computes
    assert policy.threads() == 2 and policy.others_cores == pytest.approx(2.0)
    advance(others_cores=0.2, own_cores=2.0)  # Ray's own bits: still room
    assert policy.threads() == 4


def test_idle_cores_without_cgroup_counters_runs_the_reservation(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    sampler = CgroupSampler(tmp_path, cores=4)
    assert sampler.sample() is None
    policy = make_thread_policy("idle_cores", 2, 4, sampler=sampler)
    assert isinstance(policy, ReservedThreads) and policy.threads() == 2


def test_the_live_sampler_sees_this_process_compute() -> None:
    sampler = CgroupSampler()
    before = sampler.sample()
    assert before is not None  # these tests run on Linux with cgroup v1 or v2 counters
    x = 0
    for i in range(3_000_000):
        x += i * i
    after = sampler.sample()
    assert after is not None
    assert after.own_s > before.own_s
    assert after.busy_s >= before.busy_s + 0.5 * (after.own_s - before.own_s)


def test_threaded_forward_sets_the_count_in_the_thread_that_runs_the_pass() -> None:
    import torch

    from carpool.threads import ThreadedForward

    class Alternating:
        def __init__(self) -> None:
            self.counts = [2, 1, 2]

        def threads(self) -> int:
            return self.counts.pop(0)

    seen: list[tuple[int, int]] = []

    def forward(batch: list[int]) -> list[int]:
        seen.append((threading.get_ident(), torch.get_num_threads()))
        return batch

    wrapped = ThreadedForward(forward, Alternating())
    main_threads = torch.get_num_threads()

    async def passes() -> None:
        for _ in range(3):
            assert await asyncio.to_thread(wrapped, [1, 2]) == [1, 2]

    asyncio.run(passes())
    assert [n for _, n in seen] == [2, 1, 2]
    assert wrapped.last_threads == 2
    assert torch.get_num_threads() == main_threads  # the event loop's thread is left alone


def test_thread_policy_config_refuses_what_it_would_ignore() -> None:
    from carpool.config import ReplicaConfig
    from deployments.generator import GeneratorConfig

    with pytest.raises(ValueError, match="max_torch_threads"):
        ReplicaConfig(max_torch_threads=2)
    with pytest.raises(ValueError, match="below torch_threads"):
        ReplicaConfig(thread_policy="idle_cores", torch_threads=4, max_torch_threads=2)
    assert ReplicaConfig(num_cpus=0.5).reserved_threads == 1
    assert ReplicaConfig(num_cpus=1.5, thread_policy="idle_cores").reserved_threads == 2
    with pytest.raises(ValueError, match="thread_policy"):
        GeneratorConfig.model_validate({"replica": {"thread_policy": "idle_cores"}})


def test_an_embedder_on_idle_cores_returns_the_vectors_of_a_fixed_one(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The thread count may change from pass to pass; an item's vector must not."""
    import numpy as np

    from carpool.threads import ThreadedForward
    from deployments.embedder import EmbedderConfig, EmbeddingServer
    from tests.factories import build_tiny_models

    path = build_tiny_models(tmp_path_factory.mktemp("tiny-threads"))["encoder"]
    texts = [f"text number {i} " + "word " * (i * 7 % 40) for i in range(12)]

    def server(**replica: object) -> EmbeddingServer:
        config = {"source": {"model": path}, "replica": {"num_cpus": 0.5, **replica}}
        return EmbeddingServer(EmbedderConfig.model_validate(config))

    fixed = server()
    assert not isinstance(fixed.executor._forward, ThreadedForward)
    reference = asyncio.run(fixed.embed(texts)).vectors
    elastic = server(thread_policy="idle_cores", max_torch_threads=2)
    wrapped = elastic.executor._forward
    assert isinstance(wrapped, ThreadedForward)
    for counts in ([1], [2], [2, 1, 2, 1]):
        wrapped.policy = ReservedCycle(counts)
        got = asyncio.run(elastic.embed(texts)).vectors
        np.testing.assert_allclose(np.stack(got), np.stack(reference), atol=1e-5)
        assert wrapped.last_threads in counts


class ReservedCycle:
    """A policy that cycles through given counts (drives the wrapper, not under test)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts, self.i = counts, 0

    def threads(self) -> int:
        n = self.counts[self.i % len(self.counts)]
        self.i += 1
        return n
