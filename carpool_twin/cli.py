"""``python -m carpool_twin``: measure a cost profile (``profile``) or check one (``check``);
keep a path benchmark's CPU per request as a path profile (``path-profile``).

    python -m carpool_twin profile --config serve.yaml --out profiles/
    python -m carpool_twin profile --config serve-gpu.yaml --device cuda --dtype bfloat16,float32 \\
        --random-weights --models-dir .devprof/models --out "$OUT"
    python -m carpool_twin check profiles/cpu-2core.json
    python -m carpool_twin path-profile benchmarks/results/path-smoke.json --out profiles/

Models are measured one after another in this process, one (dtype, threads) variant at a
time; a variant that fails (out of memory, a missing config) is recorded under ``failed`` and
the rest still run, so one bad model does not cost a whole device run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from carpool_twin.measure import MeasureOptions, measure_model, models_from_serve_config
from carpool_twin.profile import PROFILE_KIND, SCHEMA_VERSION, load_profile, save_profile


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def hardware(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_logical": os.cpu_count(),
        "cpu_usable": usable_cpus(),
        "memory_gib": _mem_gib(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "gpu": None,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "count_visible": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    return info


def software() -> dict[str, Any]:
    import numpy
    import torch
    import transformers

    import carpool

    commit = None
    # No git on a bare device machine: the commit is then unknown, not an error.
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        run = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        commit = run.stdout.strip() or None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "carpool": carpool.__version__,
        "carpool_commit": commit,
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
    }


def default_name(hw: dict[str, Any]) -> str:
    if hw["gpu"]:
        slug = re.sub(r"[^a-z0-9]+", "-", hw["gpu"]["name"].lower().replace("nvidia", ""))
        return "gpu-" + slug.strip("-")
    return f"cpu-{hw['cpu_usable']}core"


def _list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def profile_command(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    log_file = open(args.log, "a") if args.log else None  # noqa: SIM115 (closed below)

    def log(message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, file=sys.stderr, flush=True)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU; use --device cpu")
    specs = models_from_serve_config(args.config)
    if args.models:
        wanted = _list(args.models)
        unknown = sorted(set(wanted) - {s.role for s in specs})
        if unknown:
            raise SystemExit(
                f"--models {unknown} not in {args.config}; choose from {[s.role for s in specs]}"
            )
        specs = [s for s in specs if s.role in wanted]
    hw = hardware(args.device)
    threads = [int(t) for t in _list(args.threads)] if args.threads else [None]
    command = "python -m carpool_twin " + shlex.join(argv)
    # Other work on the machine slows every pass: the load seen before and after is recorded.
    load_before = [round(v, 2) for v in os.getloadavg()]
    started = time.monotonic()
    entries: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for dtype in _list(args.dtype):
        for n in threads:
            if args.device == "cpu":
                torch.set_num_threads(n or usable_cpus())
            for spec in specs:
                variant = {"role": spec.role, "dtype": dtype, "threads": n}
                if args.budget_s and time.monotonic() - started > args.budget_s:
                    log(f"budget of {args.budget_s} s spent: skipping {variant}")
                    skipped.append(variant)
                    continue
                opts = MeasureOptions(
                    device=args.device,
                    dtype=dtype,
                    threads=n,
                    random_weights=args.random_weights,
                    models_dir=args.models_dir,
                    min_time_s=args.min_time_s,
                    max_point_s=args.max_point_s,
                    quick=args.quick,
                    max_others_cores=args.max_others_cores,
                    log=log,
                )
                try:
                    entry = measure_model(spec, opts)
                except Exception as exc:  # recorded; the other models still get measured
                    log(f"FAILED {variant}: {type(exc).__name__}: {exc}")
                    failed.append({**variant, "error": f"{type(exc).__name__}: {exc}"[:500]})
                    continue
                entry.update(
                    source="measured",
                    command=command,
                    measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                )
                entries.append(entry)
                log(summary(entry))
    name = args.name or default_name(hw)
    profile = {
        "schema_version": SCHEMA_VERSION,
        "kind": PROFILE_KIND,
        "name": name,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "source": "measured",
        "command": command,
        "config": str(args.config),
        "hardware": hw,
        "software": software(),
        "options": {
            "device": args.device,
            "random_weights": args.random_weights,
            "min_time_s": args.min_time_s,
            "max_point_s": args.max_point_s,
            "quick": args.quick,
            "max_others_cores": args.max_others_cores,
            "nice": os.nice(0),
            "loadavg_before": load_before,
            "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        },
        "models": entries,
        "failed": failed,
        "skipped": skipped,
    }
    if not entries:
        log(f"nothing measured ({len(failed)} failed); no profile written")
        return 1
    out = Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        out = out / f"{name}.json"
    save_profile(profile, out)
    log(
        f"wrote {out} ({len(entries)} entries, {len(failed)} failed, "
        f"{time.monotonic() - started:.0f} s)"
    )
    if log_file:
        log_file.close()
    return 2 if failed else 0


def summary(entry: dict[str, Any]) -> str:
    """One line per entry: the fitted costs a reader checks first."""
    head = f"{entry['role']} {entry['dtype']} t={entry['threads']}: "
    if entry["kind"] == "generator":
        pre = entry["prefill"]["fits"]["line"]["coef"]
        dec = entry["decode"]["fits"]["line"]["coef"]
        return head + (
            f"prefill {pre['const']:.2f} ms + {pre['tokens'] * 1000:.1f} us/token; decode "
            f"{dec['const']:.2f} ms + {dec['batch']:.3f} ms/seq; "
            f"KV {entry['kv_bytes_per_token']} B/token ({entry['measure_s']} s)"
        )
    line = entry["pass"]["fits"]["line"]
    return head + (
        f"pass {line['coef']['const']:.2f} ms + {line['coef']['padded_tokens'] * 1000:.2f} "
        f"us/padded token (rel rmse {line['rel_rmse']:.2f}, use {entry['pass']['use']}; "
        f"{entry['measure_s']} s)"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m carpool_twin", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("profile", help="measure a cost profile on this machine")
    m.add_argument("--config", default="serve.yaml", help="serve config whose models to time")
    m.add_argument("--models", help="comma-separated roles (embedder,ranker,small,large)")
    m.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    m.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16; a list")
    m.add_argument("--threads", help="CPU torch threads; a list measures each (default: all)")
    m.add_argument(
        "--random-weights",
        action="store_true",
        help="build each model from its config with random weights (same timings, no weights)",
    )
    m.add_argument("--models-dir", help="folder of <model name>/config.json to use first")
    m.add_argument("--out", default="profiles/", help="file, or folder for <name>.json")
    m.add_argument("--name", help="profile name (default cpu-<cores>core or gpu-<gpu>)")
    m.add_argument("--log", help="also append the progress log to this file")
    m.add_argument("--min-time-s", type=float, default=0.3, help="time spent per point")
    m.add_argument("--max-point-s", type=float, default=2.0, help="stop a series past this")
    m.add_argument("--budget-s", type=float, default=0.0, help="skip variants after this")
    m.add_argument(
        "--max-others-cores",
        type=float,
        help="CPU: re-time a point while other processes use more cores than this",
    )
    m.add_argument("--quick", action="store_true", help="coarse grids (smoke tests)")
    s = sub.add_parser(
        "serving-profile",
        help="re-time a profile's embedder passes in a running carpool replica (its HTTP route)",
    )
    s.add_argument("--profile", required=True, help="the profile to start from (its grid)")
    s.add_argument(
        "--url", required=True, help="the embed pipeline's base, e.g. http://127.0.0.1:8000/embed"
    )
    s.add_argument("--models", default="embedder", help="comma-separated roles to re-time")
    s.add_argument("--min-time-s", type=float, default=1.0, help="time spent per point")
    s.add_argument("--out", required=True, help="the profile file to write")
    c = sub.add_parser("check", help="validate profile files")
    c.add_argument("paths", nargs="+")
    pp = sub.add_parser(
        "path-profile",
        help="the serving path's CPU-ms per request by component (carpool_twin.path), from "
        "`python -m benchmarks path`'s JSON",
    )
    pp.add_argument("bench", help="the benchmark's JSON, e.g. benchmarks/results/path-smoke.json")
    pp.add_argument("--out", default="profiles/", help="file, or folder for <name>.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.command == "check":
        from carpool_twin.path import PATH_KIND, load_path_profile

        for path in args.paths:
            if json.loads(Path(path).read_text()).get("kind") == PATH_KIND:
                modes = load_path_profile(path)["modes"]
                print(f"{path}: ok (serving path, modes {', '.join(sorted(modes))})")
                continue
            profile = load_profile(path)
            print(f"{path}: ok ({profile['name']}, {len(profile['models'])} entries)")
            for entry in profile["models"]:
                print("  " + summary(entry))
        return 0
    if args.command == "serving-profile":
        return serving_profile_command(args, argv)
    if args.command == "path-profile":
        return path_profile_command(args, argv)
    return profile_command(args, argv)


def path_profile_command(args: argparse.Namespace, argv: list[str]) -> int:
    from carpool_twin.path import extract_path, validate_path_profile

    bench = json.loads(Path(args.bench).read_text())
    doc = extract_path(bench, args.bench, "python -m carpool_twin " + shlex.join(argv))
    doc["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    validate_path_profile(doc)
    out = Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        out = out / f"{doc['name']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for mode, body in doc["modes"].items():
        print(f"{mode}: {json.dumps(body['cpu_ms_per_request'])}")
    print(f"wrote {out}")
    return 0


def serving_profile_command(args: argparse.Namespace, argv: list[str]) -> int:
    from carpool_twin.serving import retime_profile

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    profile = retime_profile(
        load_profile(args.profile),
        args.url,
        _list(args.models),
        "python -m carpool_twin " + shlex.join(argv),
        args.min_time_s,
        log=log,
    )
    save_profile(profile, args.out)
    log(f"wrote {args.out}")
    return 0
