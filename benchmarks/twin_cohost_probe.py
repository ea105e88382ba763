"""Does other work on this host slow an embedder pass below 2 cores of demand? (issue 26)

Times the profile's own embedder pass (``carpool_twin.measure.encoder_pass``, one torch
thread, the packaged all-MiniLM-L6-v2) at a few shapes while something else runs:

- ``alone``; ``alone_padded``: the same shapes with rows of unequal lengths (a real mask);
- ``proc_busy``: another process spinning pure Python on the other core (100%);
- ``proc_duty30``: another process busy 30% of the time in 4 ms bursts (about what the
  serving path asks at half capacity);
- ``proc_model``: another process running the same passes (caches, memory bandwidth);
- ``thread_busy``: a Python thread of this process spinning (the GIL, as a replica's event
  loop would hold it);
- ``thread_duty30``: that thread busy 30% of the time in 4 ms bursts.

For each: the pass's median wall time, and the CPU time of the thread that ran it.

    flock /tmp/carpool-bench.lock .venv/bin/python -m benchmarks.twin_cohost_probe \\
        --out benchmarks/results/twin-cohost-probe.json

A diagnostic: nothing here is a validated figure or enters the twin.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

SHAPES = ((1, 64), (4, 64), (4, 128), (16, 64))


def _spin(duty: float, stop: Any, burst_s: float = 0.004) -> None:
    """Pure Python work for ``duty`` of the time, in bursts of ``burst_s``."""
    while not stop.is_set():
        end = time.perf_counter() + burst_s
        x = 0
        while time.perf_counter() < end:
            x += 1
        if duty < 1:
            time.sleep(burst_s * (1 - duty) / duty)


def _model_loop(stop: Any) -> None:
    run = _pass(4, 64)
    while not stop.is_set():
        run()


def _load() -> tuple[Any, str]:
    import torch

    from carpool_twin.measure import build_model, locate

    torch.set_num_threads(1)
    folder = locate("packaged:all-MiniLM-L6-v2", None)
    return build_model(folder, "encoder", "cpu", torch.float32, False), "encoder"


_MODEL: Any = None


def _pass(rows: int, length: int) -> Any:
    from carpool_twin.measure import encoder_pass

    global _MODEL
    if _MODEL is None:
        _MODEL = _load()[0]
    return encoder_pass(_MODEL, "encoder", "cpu", rows, length)


def _padded_pass(rows: int, length: int) -> Any:
    """The pass with real padding: row i holds length x (1 - i / (2 rows)) tokens, the rest
    masked, as a replica's mixed-length pass is (the profile times full masks only)."""
    import torch

    _pass(1, 16)
    model = _MODEL
    lengths = [max(1, round(length * (1 - i / (2 * rows)))) for i in range(rows)]

    def run() -> Any:
        ids = torch.randint(5, 1000, (rows, length))
        mask = torch.zeros((rows, length), dtype=torch.long)
        for r, n in enumerate(lengths):
            mask[r, :n] = 1
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            out = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1))
        return out.cpu()

    return run


def _time(rows: int, length: int, seconds: float, padded: bool = False) -> dict[str, float]:
    run = _padded_pass(rows, length) if padded else _pass(rows, length)
    run()
    walls, cpus = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(walls) < 5:
        t0, c0 = time.perf_counter(), time.thread_time()
        run()
        walls.append((time.perf_counter() - t0) * 1000)
        cpus.append((time.thread_time() - c0) * 1000)
    return {
        "n": len(walls),
        "wall_ms": round(statistics.median(walls), 2),
        "wall_min_ms": round(min(walls), 2),
        "cpu_ms": round(statistics.median(cpus), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.twin_cohost_probe")
    p.add_argument("--out", default="benchmarks/results/twin-cohost-probe.json")
    p.add_argument("--seconds", type=float, default=3.0, help="per shape and condition")
    p.add_argument("--rounds", type=int, default=2, help="the conditions, in turn, this often")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    conditions = (
        "alone",
        "alone_padded",
        "proc_busy",
        "proc_duty30",
        "proc_model",
        "thread_busy",
        "thread_duty30",
    )
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in conditions}
    _pass(1, 16)  # load the model before anything is timed
    for rnd in range(args.rounds):
        for cond in conditions:
            stop: Any
            worker: Any = None
            if cond.startswith("proc"):
                stop = ctx.Event()
                target, wargs = (_model_loop, (stop,)) if cond == "proc_model" else (
                    _spin, (1.0 if cond == "proc_busy" else 0.3, stop))  # fmt: skip
                worker = ctx.Process(target=target, args=wargs, daemon=True)
                worker.start()
                time.sleep(8 if cond == "proc_model" else 0.5)  # its model loads first
            elif cond.startswith("thread"):
                stop = threading.Event()
                duty = 1.0 if cond == "thread_busy" else 0.3
                worker = threading.Thread(target=_spin, args=(duty, stop), daemon=True)
                worker.start()
            padded = cond == "alone_padded"
            row = {
                "round": rnd,
                **{f"{r}x{n}": _time(r, n, args.seconds, padded) for r, n in SHAPES},
            }
            if worker is not None:
                stop.set()
                worker.join(10)
            results[cond].append(row)
            print(cond, json.dumps(row), file=sys.stderr, flush=True)
    doc = {
        "command": " ".join([".venv/bin/python -m benchmarks.twin_cohost_probe", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "switch_interval_s": sys.getswitchinterval(),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
