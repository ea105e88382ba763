"""``python -m benchmarks.schedstat``: where the machine's CPU went during a benchmark window.

A diagnostic for this machine's benchmarks, never part of serving (it reads every process
on the host). ``record OUT`` snapshots every thread's cumulative run time and run-queue wait
(``/proc/<pid>/task/<tid>/schedstat``) every few seconds until stopped; ``report OUT`` prints,
per process, the share of a core it ran and the share it spent runnable but waiting for a
core, over the window where a named process (default ``VLLM::Worker``) was busy.

It is how PEERS.md attributes carpool's gap to vLLM's own server on 2 cores: with carpool,
vLLM's worker waited for a core ~22% of the time (Ray's proxy, carpool's ingress and the
generator replica ran beside it); with vLLM's own server, ~7%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def snapshot() -> dict[str, Any]:
    tasks: dict[str, list[Any]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            cmd = raw.replace(b"\0", b" ")[:120].decode(errors="replace")
            for tid in os.listdir(f"/proc/{pid}/task"):
                run, wait, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                tasks[tid] = [pid, comm, cmd, int(run), int(wait)]
        except OSError:  # the process ended while being read
            continue
    return {"t": time.time(), "tasks": tasks}


def record(out: Path, every_s: float) -> None:
    with out.open("a") as f:
        while True:
            f.write(json.dumps(snapshot()) + "\n")
            f.flush()
            time.sleep(every_s)


def busy_windows(snaps: list[dict[str, Any]], comm: str, share: float) -> list[tuple[int, int]]:
    """Runs of consecutive snapshot intervals in which a thread named ``comm`` ran more than
    ``share`` of a core."""
    busy = []
    for i in range(1, len(snaps)):
        a, b = snaps[i - 1], snaps[i]
        dt = b["t"] - a["t"]
        ran = max(
            (
                (run - a["tasks"][tid][3]) / 1e9 / dt
                for tid, (_, name, _, run, _) in b["tasks"].items()
                if name.startswith(comm) and tid in a["tasks"]
            ),
            default=0.0,
        )
        busy.append(ran > share)
    windows, start = [], None
    for i, on in enumerate([*busy, False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            windows.append((start, i))
            start = None
    return windows


def window_table(a: dict[str, Any], b: dict[str, Any], rows: int = 12) -> None:
    """Per process, between snapshots ``a`` and ``b``: share of a core run and waited."""
    dt = b["t"] - a["t"]
    procs: dict[str, list[Any]] = defaultdict(lambda: [0.0, 0.0, ""])
    for tid, (pid, comm, cmd, run, wait) in b["tasks"].items():
        old = a["tasks"].get(tid, [0, "", "", 0, 0])
        p = procs[pid]
        p[0] += (run - old[3]) / 1e9
        p[1] += (wait - old[4]) / 1e9
        if comm.startswith("VLLM"):  # vLLM names its engine thread; its cmdline says less
            p[2] = f"{comm}: {cmd}"
        elif not p[2]:
            p[2] = cmd
    print(f"window of {dt:.0f} s ({time.strftime('%H:%M:%S', time.gmtime(a['t']))} UTC)")
    print("| process | ran (% of a core) | waited for a core (%) |")
    print("|---|---|---|")
    for pid, (run, wait, cmd) in sorted(procs.items(), key=lambda kv: -kv[1][0])[:rows]:
        if run / dt >= 0.005:
            print(f"| {cmd.strip()[:60]} ({pid}) | {run / dt * 100:.1f} | {wait / dt * 100:.1f} |")
    total = sum(run for run, _, _ in procs.values())
    print(f"\nall processes: {total / dt * 100:.1f}% of a core\n")


def report(path: Path, comm: str, share: float, min_intervals: int) -> None:
    snaps = [json.loads(line) for line in path.read_text().splitlines() if line]
    for lo, hi in busy_windows(snaps, comm, share):
        if hi - lo < min_intervals:
            continue
        # Skip the ramp at both ends: the window's own edges are half-busy.
        window_table(snaps[lo + 1], snaps[hi - 1] if hi - 1 > lo + 1 else snaps[hi])


def thread_table(a: dict[str, Any], b: dict[str, Any], pid: str, rows: int = 10) -> None:
    """Per thread of process ``pid``: whether its main thread was short of a core (ran +
    waited near 100%) or the process's waiting is spread over idle helper threads."""
    dt = b["t"] - a["t"]
    threads = []
    for tid, (owner, comm, _, run, wait) in b["tasks"].items():
        if owner == pid:
            old = a["tasks"].get(tid, [0, "", "", 0, 0])
            threads.append(((run - old[3]) / 1e9 / dt, (wait - old[4]) / 1e9 / dt, comm, tid))
    print(
        f"threads of {pid}:\n| thread | ran (% of a core) | waited for a core (%) |\n|---|---|---|"
    )
    for run, wait, comm, tid in sorted(threads, reverse=True)[:rows]:
        print(f"| {comm} ({tid}) | {run * 100:.1f} | {wait * 100:.1f} |")
    print()


def report_between(path: Path, start: float, end: float, pids: list[str] | None = None) -> None:
    """The snapshots just inside [start, end] (time.time() seconds), e.g. a benchmark's
    measured window as its JSON records it; with ``pids``, those processes thread by thread."""
    snaps = [json.loads(line) for line in path.read_text().splitlines() if line]
    inside = [s for s in snaps if start <= s["t"] <= end]
    if len(inside) < 2:
        print(f"fewer than 2 snapshots between {start:.0f} and {end:.0f}: record more often")
        return
    window_table(inside[0], inside[-1])
    for pid in pids or []:
        thread_table(inside[0], inside[-1], pid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="snapshot until killed")
    r.add_argument("out", type=Path)
    r.add_argument("--every-s", type=float, default=5.0)
    s = sub.add_parser("report", help="per-process CPU in each busy window")
    s.add_argument("path", type=Path)
    s.add_argument("--comm", default="VLLM::Worker", help="thread name that marks a window")
    s.add_argument("--share", type=float, default=0.6, help="busy above this share of a core")
    s.add_argument("--min-intervals", type=int, default=6)
    s.add_argument(
        "--between", type=float, nargs=2, metavar=("START", "END"), help="time.time() bounds"
    )
    s.add_argument("--threads", nargs="*", default=[], metavar="PID", help="with --between")
    args = p.parse_args(argv)
    if args.cmd == "record":
        record(args.out, args.every_s)
    elif args.between:
        report_between(args.path, *args.between, args.threads)
    else:
        report(args.path, args.comm, args.share, args.min_intervals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
