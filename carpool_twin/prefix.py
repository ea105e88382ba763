"""``python -m carpool_twin.prefix``: the placement twin checked against on-box runs, and projected.

``--check RESULT.json ...`` (``carpool_twin.prefix_check``) replays each run's requests through
the twin with each system's policy and prints, per run and system, the twin's TTFT p50 and
mean per-replica prefix hit rate against the measured ones, their relative errors and the
median error; the box's engine speed is fitted per run on its ``default`` TPOT, the prefill
pass's share once on the first file's ``default`` TTFT p50 (that row is marked fitted).

``--floor RESULT.json ...`` (``carpool_twin.prefix_floor``) sets each run's TTFT beside the
floor under any router: the same requests spread ``--stretch`` times further apart (none
waits for another) and placed by prefix affinity, on the box as the check prices it.

``--project`` (``carpool_twin.prefix_project``) replays the whole Mooncake trace on 8, 16 and
64 GPUs (one replica per GPU, serve-gpu.yaml's small engine, ``profiles/gpu-h200.json``): per
policy, the highest arrival rate whose TTFT p99 meets the SLO, and that replay's figures.

    python -m carpool_twin.prefix --check benchmarks/results/prefix-replay-mooncake-2.json \\
        benchmarks/results/prefix-replay-mooncake-4-run1.json --out check.json
    python -m carpool_twin.prefix --floor benchmarks/results/prefix-replay-mooncake-2-at-0.8.json
    python -m carpool_twin.prefix --project --gpus 8,16,64 --slo-ttft-p99-ms 500 --out proj.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from carpool_twin.mooncake import TRACE
from carpool_twin.prefix_check import check, check_table
from carpool_twin.prefix_floor import DEFAULT_STRETCH, floor, floor_table
from carpool_twin.prefix_project import PROJECT_POLICIES, project, project_table

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m carpool_twin.prefix", description=__doc__)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", nargs="+", metavar="RESULT.json", help="benchmark result files")
    mode.add_argument("--project", action="store_true", help="project onto --gpus")
    mode.add_argument("--floor", nargs="+", metavar="RESULT.json", help="placement's floor")
    p.add_argument("--trace", default=str(TRACE), help="the Mooncake conversation trace")
    p.add_argument("--out", help="also write the figures as JSON here")
    p.add_argument("--profile", help="default: cpu-2core (check), gpu-h200 (project)")
    p.add_argument(
        "--config", help="default: serve-replicas.yaml (check), serve-gpu.yaml (project)"
    )
    p.add_argument("--host-cores", type=float, default=2.0, help="check: the box's cores")
    p.add_argument("--calibrate-on", default="default", help="check: the system fitted on TPOT")
    p.add_argument("--seeds", type=int, default=5, help="check: replays per figure (median)")
    p.add_argument(
        "--prefill-ratio",
        type=float,
        help="check: the prefill pass's factor against the decode pass's (default: fitted on "
        "the first file's --calibrate-on system's TTFT p50)",
    )
    p.add_argument(
        "--stretch", type=float, default=DEFAULT_STRETCH, help="floor: arrivals this much apart"
    )
    p.add_argument("--gpus", default="8,16,64")
    p.add_argument("--policies", default=",".join(PROJECT_POLICIES))
    p.add_argument("--dtype", default="bfloat16", help="project: the profile's dtype")
    p.add_argument("--slo-ttft-p99-ms", type=float, default=500.0)
    p.add_argument("--per-gpu-guess", type=float, default=50.0, help="project: first rate tried")
    p.add_argument("--step", type=float, default=1.25, help="project: the rate search's step")
    p.add_argument("--bisections", type=int, default=3, help="project: halvings of the bracket")
    p.add_argument(
        "--gpus-per-copy",
        type=int,
        default=8,
        help="project: one copy of the whole trace per this many GPUs (its own conversations)",
    )
    args = p.parse_args(argv)
    command = " ".join(
        ["python -m carpool_twin.prefix", *(argv if argv is not None else sys.argv[1:])]
    )
    if args.check:
        doc = check(
            args.check,
            args.profile or str(ROOT / "profiles" / "cpu-2core.json"),
            args.config or str(ROOT / "serve-replicas.yaml"),
            args.host_cores,
            Path(args.trace),
            args.calibrate_on,
            args.seeds,
            args.prefill_ratio,
        )
        text = check_table(doc)
    elif args.floor:
        doc = floor(
            args.floor,
            args.profile or str(ROOT / "profiles" / "cpu-2core.json"),
            args.config or str(ROOT / "serve-replicas.yaml"),
            args.host_cores,
            Path(args.trace),
            args.seeds,
            args.prefill_ratio,
            args.stretch,
        )
        text = floor_table(doc)
    else:
        doc = project(
            [int(n) for n in args.gpus.split(",")],
            args.policies.split(","),
            args.profile or str(ROOT / "profiles" / "gpu-h200.json"),
            args.config or str(ROOT / "serve-gpu.yaml"),
            args.dtype,
            args.slo_ttft_p99_ms,
            Path(args.trace),
            args.per_gpu_guess,
            args.gpus_per_copy,
            args.step,
            args.bisections,
            Path(args.out) if args.out else None,
            command,
        )
        text = project_table(doc)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": command, **doc}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
