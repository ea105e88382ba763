"""A benchmark's private Ray head leaves nothing that changes what the README's commands do
(issue 52, point 2): ``ray start --head`` writes its address to Ray's ``ray_current_cluster``,
where a later ``serve run``, ``serve status`` or ``ray status`` without an address would look,
and join the benchmark's head, or retry it for minutes once it is stopped."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from benchmarks.deploy import session_pids, start_head_in_own_session, stop_session


@pytest.mark.parametrize("found", [None, "127.0.0.1:6379"])
def test_a_benchmark_head_leaves_ray_current_cluster_as_it_found_it(
    found: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Short: Ray's unix sockets live under it (107-byte path limit); its own, so the file
    # this test reads is no other Ray's.
    ray_tmp = Path(tempfile.mkdtemp(prefix="cpb-", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    current = ray_tmp / "ray" / "ray_current_cluster"
    if found is not None:
        current.parent.mkdir()
        current.write_text(found)
    sid, address = start_head_in_own_session(["--num-cpus=1"])
    try:
        assert session_pids(sid), "the head did not start"
        assert (current.read_text() if current.exists() else None) == found, address
    finally:
        stop_session(sid)
    assert (current.read_text() if current.exists() else None) == found
