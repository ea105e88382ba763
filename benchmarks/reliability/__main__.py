"""``python -m benchmarks.reliability {overload,faults,soak} [options]``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.reliability import faults, overload, soak
from benchmarks.reliability.cluster import (
    SERVE_CONFIG,
    Cluster,
    app_closure,
    apply_overrides,
    load_config,
    parse_set,
    subset,
)
from benchmarks.reliability.common import git_state, machine, parse_rates, write_results
from carpool import local_ray

COMMANDS = {
    "overload": (overload, ["embed"]),
    "faults": (faults, None),  # None: every app in the config, as `serve run` deploys it
    "soak": (soak, None),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.reliability",
        description="Overload, fault and soak measurements of carpool's serve.yaml deployment.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", type=Path, default=SERVE_CONFIG, help="serve config (knobs)")
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="APP.DEPLOYMENT.KNOB=VALUE",
            help="override a deployment's user_config knob for this run",
        )
        sp.add_argument(
            "--apps",
            default=None,
            help="comma-separated apps to deploy (plus what they call); default: those the "
            "command loads; 'all' for every app in the config",
        )
        sp.add_argument("--url", default=None, help="measure a server already running instead")
        sp.add_argument("--ray-address", default=None, help="with --url: its Ray (for kills)")
        sp.add_argument("--port", type=int, default=None, help="HTTP port (default: a free one)")
        # Long: the default admission queues up to 30 s of work before it refuses, and a
        # request that waits its turn is not lost.
        sp.add_argument("--timeout", type=float, default=120.0, help="client timeout, s (= lost)")
        sp.add_argument(
            "--cap-concurrency",
            type=int,
            default=None,
            help="closed-loop clients for capacity (default per app: embed 12, rank 4, "
            "search 2, generate 16)",
        )
        sp.add_argument("--cap-duration", type=float, default=15.0)
        sp.add_argument(
            "--capacity",
            action="append",
            default=[],
            metavar="APP=RPS",
            help="skip measuring an app's capacity",
        )
        sp.add_argument("--max-tokens", type=int, default=16, help="generate requests' max_tokens")
        sp.add_argument("--out", type=Path, default=None, help="results folder")
        sp.add_argument(
            "--wait-quiet",
            type=float,
            default=0.0,
            metavar="MINUTES",
            help="first wait up to this long for the 1-minute load average to fall below "
            "--quiet-load (other work on the machine skews every figure)",
        )
        sp.add_argument("--quiet-load", type=float, default=1.0)

    o = sub.add_parser("overload", help="capacity, then normal and 3x overload phases")
    common(o)
    o.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    o.add_argument("--normal", type=float, default=0.75, help="normal load, x capacity")
    o.add_argument("--factor", type=float, default=3.0, help="overload, x capacity")
    o.add_argument(
        "--min-goodput",
        type=float,
        default=0.9,
        help="target: accepted items/s under overload / capacity items/s",
    )
    o.add_argument("--settle", type=float, default=5.0, help="pause between phases, s")
    o.add_argument("--generate", action="store_true", help="also the generate app (small)")
    o.add_argument(
        "--no-refusal-cost", action="store_true", help="skip measuring the CPU of a refusal"
    )
    o.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="APP.DEPLOYMENT.KNOB=V1,V2",
        help="repeat both phases with each value (in-place reconfigure)",
    )
    o.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")

    f = sub.add_parser("faults", help="kill replicas under steady load")
    common(f)
    f.add_argument("--load", type=float, default=0.5, help="fraction of capacity")
    f.add_argument("--rates", action="append", default=[], metavar="APP=RPS")
    f.add_argument(
        "--scenarios",
        default="embedder,ranker,retriever,small,embed_ingress,search_ingress",
        help=f"replicas to kill, in order: {','.join(faults.SCENARIOS)}",
    )
    f.add_argument("--pre", type=float, default=10.0, help="seconds of load before the kill")
    f.add_argument("--post", type=float, default=40.0, help="seconds of load after it")
    f.add_argument("--window", type=float, default=2.0, help="window width, s")
    f.add_argument("--replace-timeout", type=float, default=120.0)
    f.add_argument("--settle", type=float, default=5.0)

    s = sub.add_parser("soak", help="hold a fraction of capacity for minutes")
    common(s)
    s.add_argument("--duration", type=float, default=600.0, help="seconds (default 10 min)")
    s.add_argument("--load", type=float, default=0.8, help="fraction of capacity")
    s.add_argument("--rates", action="append", default=[], metavar="APP=RPS")
    s.add_argument("--window", type=float, default=60.0, help="window width, s")
    s.add_argument("--sample", type=float, default=10.0, help="RSS sampling interval, s")
    s.add_argument("--warmup", type=float, default=60.0, help="excluded from memory growth, s")
    return p


def wait_quiet(timeout_s: float, threshold: float) -> float:
    """Sleeps until the 1-minute load average is below ``threshold`` (or the time is up)."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= threshold and time.monotonic() - t0 < timeout_s:
        print(f"waiting for a quiet machine: load {os.getloadavg()[0]:.2f}", flush=True)
        time.sleep(15)
    return time.monotonic() - t0


def report(path: Path) -> int:
    """Re-renders a result's markdown from its JSON (after a change to the tables)."""
    data = json.loads(path.read_text())
    command = data["command"].split()[3] if len(data["command"].split()) > 3 else ""
    if command not in COMMANDS:
        raise SystemExit(f"{path}: not a reliability result (command {data['command']!r})")
    markdown = COMMANDS[command][0].render(data)
    path.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        if len(argv) != 2:
            raise SystemExit("usage: python -m benchmarks.reliability report RESULT.json")
        return report(Path(argv[1]))
    args = build_parser().parse_args(argv)
    os.environ.update(local_ray.ray_environment())
    module, default_apps = COMMANDS[args.command]
    args.capacity = parse_rates(args.capacity)
    if hasattr(args, "rates"):
        args.rates = parse_rates(args.rates) or None
    config = apply_overrides(load_config(args.config), parse_set(args.set))
    if args.apps == "all" or (default_apps is None and not args.apps):
        apps = [a["name"] for a in config["applications"]]
    else:
        wanted = args.apps.split(",") if args.apps else list(default_apps or [])
        if args.command == "overload" and args.generate and not args.apps:
            wanted.append("generate")
        apps = app_closure(config, wanted)
    config = subset(config, apps)
    cluster = Cluster(config, url=args.url, ray_address=args.ray_address, port=args.port)
    data: dict[str, Any] = {
        "command": "python -m benchmarks.reliability "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "started_at": time.time(),
        "machine": machine(),
        "git": git_state(),
        "deployment": (
            f"attached to {args.url}"
            if args.url
            else f"{args.config.name} apps {', '.join(apps)} on a private Ray (no dashboard), "
            "HTTP proxy on 127.0.0.1"
        ),
        "apps_deployed": apps,
        "overrides": args.set,
    }
    if args.wait_quiet > 0:
        data["waited_for_quiet_s"] = wait_quiet(args.wait_quiet * 60, args.quiet_load)
        data["machine"]["loadavg"] = list(os.getloadavg())
    t0 = time.monotonic()
    try:
        print(f"deploying {', '.join(apps)} ...", flush=True)
        data["startup_s"] = cluster.start()
        print(f"running after {data['startup_s']:.1f} s at {cluster.url}", flush=True)
        data["config_deployed"] = cluster.config
        data.update(asyncio.run(module.main(args, cluster)))
    finally:
        cluster.shutdown()
    data["wall_s"] = time.monotonic() - t0
    markdown = module.render(data)
    path = write_results(args.command, data, markdown, args.out)
    print("\n" + markdown)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
