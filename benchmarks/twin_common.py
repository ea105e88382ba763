"""What the twin's validation harnesses share: the fixed choices, the requests as the twin
sees them, and the CPU and replica accounting around a measured window.

``benchmarks.twin_validate`` is the command line and imports its halves
(``twin_measure_gen``, ``twin_report``); they, ``twin_gpu_engine`` and ``twin_halfload_diag``
take what they share from here, never from ``twin_validate``, so the imports run one way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.workloads import EmbedRequest, Workload
from carpool_twin.replicas import SimRequest

ROOT = Path(__file__).resolve().parent.parent
GEN_CLIENTS = (4, 16, 64)
# Generation configurations: knobs, and the client counts each is measured at. serve.yaml's
# small generator runs 64 sequences and 512-token steps; the other batches 16 sequences.
GEN_CONFIGS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "default": ({"max_num_seqs": 64, "max_step_tokens": 512}, GEN_CLIENTS),
    "max_num_seqs_16": ({"max_num_seqs": 16, "max_step_tokens": 512}, (64,)),
}
# Slots sized to the workloads (prompts of at most a few hundred tokens plus 256 generated):
# 64 x 641 x 46,080 bytes/token (SmolLM2) = 1.9 GB, under the default 2048 MB KV ceiling.
GEN_MAX_SEQ_LEN = 640
GEN_CALIB_REQUESTS = 4  # 1 client x 32 tokens each: the serving cost per engine step
GEN_CALIB_LOADED_CLIENTS = 8  # and 8 clients, 2 requests each: a step's cost under load
MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length: longer texts are truncated to it
SEED = 0


# --- requests, as the twin sees them --------------------------------------------------------


def embed_requests(workload: Workload) -> list[SimRequest]:
    """Token lengths of each text: the workload's words + [CLS]/[SEP] (exact for WordPiece)."""
    out = []
    for r in workload.requests:
        assert isinstance(r, EmbedRequest)
        out.append(
            SimRequest("embed", lengths=tuple(min(MAX_LENGTH, len(t.split()) + 2) for t in r.texts))
        )
    return out


def gen_requests(
    prompt_tokens: list[int], max_tokens: list[int], first: list[int] | None = None
) -> list[SimRequest]:
    """``first``: tokens until each request's first text delta (measured, per prompt)."""
    first = first or [1] * len(prompt_tokens)
    return [
        SimRequest(
            "generate",
            prompt_tokens=p,
            max_tokens=m,
            output_tokens=m,
            model="small",
            first_visible=f,
        )
        for p, m, f in zip(prompt_tokens, max_tokens, first, strict=True)
    ]


# --- accounting ---------------------------------------------------------------------------


def cpu_snapshot(session: int | None = None) -> dict[str, Any]:
    """CPU seconds so far of this process (the load generator), every process under it
    (``ray.init`` starts a cluster as its children) and every process of ``session`` (a Ray
    started in a session of its own: proxy, replicas, controller, raylet, GCS), by process,
    and the whole machine's busy CPU seconds (/proc/stat)."""
    import psutil

    from benchmarks.deploy import session_processes

    me = psutil.Process()
    cluster = session_processes(session) if session is not None else []
    procs: dict[int, tuple[str, float]] = {}
    for proc in [me, *me.children(recursive=True), *cluster]:
        try:
            times = proc.cpu_times()
            title = (proc.cmdline() or [proc.name()])[0]
        except psutil.Error:
            continue
        procs[proc.pid] = (
            "loadgen" if proc.pid == me.pid else title[:60],
            times.user + times.system,
        )
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    # Steal: time the hypervisor gave this VM's cores to others (a slower machine that no
    # process here shows).
    steal = fields[7] / os.sysconf("SC_CLK_TCK") if len(fields) > 7 else 0.0
    return {"procs": procs, "machine_busy_s": busy, "steal_s": steal, "t": time.perf_counter()}


def cpu_used(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds used between two snapshots: by process title, ours in all, the machine."""
    by: dict[str, float] = {}
    for pid, (title, cpu) in after["procs"].items():
        start = before["procs"].get(pid, (title, 0.0))[1]
        by[title] = by.get(title, 0.0) + cpu - start
    return {
        "wall_s": round(after["t"] - before["t"], 3),
        "ours_s": round(sum(by.values()), 3),
        "machine_s": round(after["machine_busy_s"] - before["machine_busy_s"], 3),
        "steal_s": round(after.get("steal_s", 0.0) - before.get("steal_s", 0.0), 3),
        "by_process": {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
    }


def replica_passes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """What the replica's passes did between two ``/v1/stats`` snapshots: passes, items,
    padded tokens and the passes' wall time in all (the stats carry means; totals are the
    mean times the count). Empty without both snapshots."""
    keys = ("forward_passes", "items", "padded_tokens", "mean_forward_ms", "mean_queue_wait_ms")
    if not all(k in before and k in after for k in keys):
        return {}

    def total(d: dict[str, Any], mean: str, count: str) -> float:
        return float(d[mean]) * float(d[count])

    return {
        "passes": after["forward_passes"] - before["forward_passes"],
        "items": after["items"] - before["items"],
        "padded_tokens": after["padded_tokens"] - before["padded_tokens"],
        "forward_ms": round(
            total(after, "mean_forward_ms", "forward_passes")
            - total(before, "mean_forward_ms", "forward_passes"),
            2,
        ),
        "queue_wait_ms": round(
            total(after, "mean_queue_wait_ms", "items")
            - total(before, "mean_queue_wait_ms", "items"),
            2,
        ),
    }


def save_json(path: str, doc: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
