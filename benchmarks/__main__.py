"""``python -m benchmarks {suite,run,offline,trace-info}``: the benchmark CLI.

Run from the repository root. ``suite`` is the standard suite (``make bench``); ``run`` is
one ad-hoc measurement against systems it deploys itself or against a running server
(``--url``); ``offline`` measures the bare model; ``trace-info`` shows how a trace window
is scaled. Results go to ``benchmarks/results/<timestamp>/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any

from carpool import local_ray

# Before anything imports Ray: the benchmark's private cluster is closed as `make serve`'s is
# (token auth, every port on 127.0.0.1: carpool/local_ray.py) and never phones home.
os.environ.update(local_ray.ray_environment())
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.arrivals import ArrivalSpec
from benchmarks.deploy import DEFAULT_PORT, SYSTEMS, Resources
from benchmarks.trace import DEFAULT_TRACE


def _json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _variant_arg(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, knobs = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"expected NAME='{{\"max_batch_tokens\": 1024}}', got {text!r}"
        )
    return name, _json_arg(knobs)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None


def _ints(text: str) -> list[int]:
    return [int(x) for x in _floats(text)]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _resources(p: argparse.ArgumentParser) -> None:
    d = Resources()
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="Serve HTTP port (127.0.0.1)")
    p.add_argument("--num-cpus", type=float, default=d.num_cpus, help="per model replica")
    p.add_argument("--torch-threads", type=int, default=d.torch_threads, help="per model replica")
    p.add_argument("--model", default=d.model, help="model source for every system")
    p.add_argument(
        "--carpool-batching",
        type=_json_arg,
        default={},
        help="override carpool's batching knobs, e.g. '{\"max_batch_tokens\": 1024}'",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    suite = sub.add_parser("suite", help="the standard suite (make bench)")
    _common(suite)
    _resources(suite)
    suite.add_argument("--quick", action="store_true", help="a few-minute harness check")
    suite.add_argument(
        "--systems", default="carpool,naive,serve-batch", help="comma-separated systems"
    )
    suite.add_argument(
        "--variant",
        type=_variant_arg,
        action="append",
        default=[],
        help="extra carpool deployment NAME='{knobs}' measured alongside (repeatable)",
    )
    suite.add_argument("--slo-ms", type=float, default=500.0)
    suite.add_argument(
        "--slo-rate",
        type=float,
        help="no SLO search: every system's windows at this offered rate (req/s), to compare "
        "p99 and slowdown at equal load (a diagnosis; use with --readme no)",
    )
    suite.add_argument(
        "--phases",
        default="saturation,slo,goodput,light,burst,bulk",
        help="measured phases to run (comma-separated; the offline limit always runs; also "
        "'model', the discrete-event model)",
    )
    suite.add_argument("--rounds", type=int, help="paired rounds (default 3, --quick 2)")
    suite.add_argument(
        "--goodput-clients",
        help="closed-loop client counts of the goodput phase, clients that resend at once when "
        "refused (comma-separated; default 32,300)",
    )
    suite.add_argument("--seed", type=int, default=0)
    suite.add_argument(
        "--readme",
        choices=("auto", "yes", "no"),
        default="auto",
        help="update benchmarks/README.md and report/*.png (auto: yes unless --quick)",
    )

    run = sub.add_parser("run", help="one measurement (or a sweep / search)")
    _common(run)
    _resources(run)
    where = run.add_argument_group("where")
    where.add_argument(
        "--system",
        action="append",
        choices=sorted(SYSTEMS),
        help="deploy this system and measure it (repeatable)",
    )
    where.add_argument("--url", help="drive a server already running, e.g. http://127.0.0.1:8000")
    where.add_argument("--prefix", default="/embed", help="with --url: the app's route prefix")
    where.add_argument("--kind", choices=("embed", "rank", "generate"), help="with --url")
    where.add_argument("--metrics-url", help="with --url: Ray's metrics endpoint, for histograms")
    where.add_argument("--app", help="with --url: the Serve app name (labels of its metrics)")
    what = run.add_argument_group("workload")
    what.add_argument(
        "--workload",
        default="embed-mixed",
        help="embed-mixed | rank-mixed | generate-mixed | trace | PATH.jsonl",
    )
    what.add_argument("--requests", type=int, default=2000, help="generated requests (pool)")
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--mix", type=_json_arg, default={}, help="generator mix overrides (JSON)")
    what.add_argument("--trace", default=DEFAULT_TRACE, help="trace CSV (relative to the repo)")
    what.add_argument("--trace-start", type=float, default=600.0, help="trace seconds")
    what.add_argument("--token-scale", type=float, default=0.125)
    how = run.add_argument_group("arrivals")
    how.add_argument(
        "--arrival",
        choices=("poisson", "bursty", "closed", "replay", "sweep", "search"),
        default="poisson",
    )
    how.add_argument("--rate", type=float, default=5.0, help="requests/s (mean)")
    how.add_argument("--rates", type=_floats, default=[], help="sweep: e.g. 2,4,8")
    how.add_argument("--duration", type=float, default=15.0, help="seconds per run")
    how.add_argument("--concurrency", type=int, default=16, help="closed loop")
    how.add_argument("--burst-on", type=float, default=2.0)
    how.add_argument("--burst-off", type=float, default=2.0)
    how.add_argument("--slo-ms", type=float, default=500.0, help="search / early abort")
    how.add_argument("--timeout", type=float, default=30.0, help="client timeout per request")
    how.add_argument("--connections", type=int, default=256, help="client connection pool")

    off = sub.add_parser("offline", help="the bare model's throughput by batch size")
    _common(off)
    off.add_argument("--texts", type=int, default=384)
    off.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16, 32, 64, 128])
    off.add_argument("--arrival-batch-sizes", type=_ints, default=[4, 32])
    off.add_argument("--torch-threads", type=int, default=1)
    off.add_argument("--model", default=Resources().model)
    off.add_argument("--seed", type=int, default=0)

    rep = sub.add_parser("report", help="re-render a suite's report from its results.json")
    rep.add_argument("results", type=Path, help="benchmarks/results/<time>/results.json")
    rep.add_argument(
        "--readme", action="store_true", help="also update benchmarks/README.md and report/*.png"
    )

    from benchmarks.peers import cli as peers  # issue 13: its options and handler live there

    peers.add_arguments(sub.add_parser("peers", help="carpool vs Infinity and vLLM (bench-peers)"))

    from benchmarks import path  # issue 42: what the serving path costs per request

    path.add_arguments(sub.add_parser("path", help="server CPU per request, by process role"))

    info = sub.add_parser("trace-info", help="trace statistics and the scaling for a rate")
    info.add_argument("--trace", default=DEFAULT_TRACE)
    info.add_argument("--rate", type=float, default=20.0)
    info.add_argument("--duration", type=float, default=30.0)
    info.add_argument("--trace-start", type=float, default=600.0)
    info.add_argument("--token-scale", type=float, default=0.125)
    return parser


def _command_line() -> str:
    return " ".join([".venv/bin/python -m benchmarks", *map(shlex.quote, sys.argv[1:])])


# --- suite -------------------------------------------------------------------------------


def cmd_suite(args: argparse.Namespace) -> int:
    from benchmarks import report
    from benchmarks.suite import run_suite
    from benchmarks.suite_config import SuiteConfig

    values: dict[str, Any] = dict(
        systems=[s for s in args.systems.split(",") if s],
        port=args.port,
        resources=Resources(
            num_cpus=args.num_cpus, torch_threads=args.torch_threads, model=args.model
        ),
        carpool_batching=args.carpool_batching,
        variants=dict(args.variant),
        slo_ms=args.slo_ms,
        slo_rate=args.slo_rate,
        phases=[p for p in args.phases.split(",") if p],
        seed=args.seed,
        progress=not args.no_progress,
    )
    if args.rounds is not None:
        values["rounds"] = args.rounds
    if args.goodput_clients:
        values["goodput_clients"] = [int(c) for c in args.goodput_clients.split(",") if c]
    config = SuiteConfig.quick(**values) if args.quick else SuiteConfig(**values)
    writes_readme = args.readme == "yes" or (args.readme == "auto" and not args.quick)
    if config.slo_rate is not None and writes_readme:
        # Its SLO figures are items/s at one rate, not each system's largest: not a headline.
        print("--slo-rate is a diagnosis, not a published run: add --readme no", file=sys.stderr)
        return 2
    out_dir = args.out or report.new_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    try:
        run_suite(config, _command_line(), results)
    except BaseException:
        traceback.print_exc()
        print(f"suite failed; partial results (if any) in {out_dir}", file=sys.stderr)
        if results:
            report.write_json(results, out_dir / "results.json")
        return 1
    report.write_json(results, out_dir / "results.json")
    report.suite_plots(results, out_dir)
    (out_dir / "report.md").write_text(report.suite_markdown(results))
    if writes_readme:
        report.suite_plots(results, report.REPORT_DIR)
        report.write_readme(results)
        print(f"updated {report.README} and {report.REPORT_DIR}/")
    print(report.headline_markdown(results))
    print(f"results: {out_dir}")
    return 0


# --- run ---------------------------------------------------------------------------------


def _workload(args: argparse.Namespace) -> Any:
    from benchmarks import workloads

    name = args.workload
    if name in workloads.GENERATORS:
        mixes = {
            "embed-mixed": workloads.EmbedMix,
            "rank-mixed": workloads.RankMix,
            "generate-mixed": workloads.GenerateMix,
        }
        mix = mixes[name].model_validate(args.mix)
        return workloads.GENERATORS[name](args.requests, args.seed, mix)  # type: ignore[operator]
    if name == "trace":
        from benchmarks.trace import TraceScaling, load_azure_trace, scale_trace, trace_workload

        scaled = scale_trace(
            load_azure_trace(args.trace),
            TraceScaling(
                rate=args.rate,
                duration_s=args.duration,
                start_s=args.trace_start,
                token_scale=args.token_scale,
            ),
        )
        return trace_workload(
            scaled, "embed" if (args.kind or "embed") != "generate" else "generate", args.seed
        )
    path = Path(name)
    if path.suffix in (".jsonl", ".json") or path.exists():
        return workloads.load_jsonl(path)
    raise SystemExit(
        f"unknown workload {name!r}: use embed-mixed, rank-mixed, generate-mixed, trace, or a "
        ".jsonl path"
    )


async def _run_all(
    args: argparse.Namespace, base_url: str, systems: list[Any], metrics_url: str | None
) -> list[dict]:
    from benchmarks.loadgen import LoadGenerator, SloGuard
    from benchmarks.runner import Bench
    from benchmarks.search import Probe, find_max_rate

    workload = _workload(args)
    runs: list[dict] = []
    async with LoadGenerator(base_url, args.connections, args.timeout, not args.no_progress) as gen:
        bench = Bench(gen, metrics_url)
        for system in systems:
            await gen.wait_ready(system.target.ready_path, timeout_s=120)
            if args.arrival in ("sweep", "search"):
                rates = args.rates or [args.rate]

                async def probe(rate: float, system: Any = system) -> Probe:
                    spec = ArrivalSpec(
                        kind="poisson", rate=rate, duration_s=args.duration, seed=args.seed
                    )
                    guard = (
                        SloGuard(args.slo_ms)
                        if args.arrival == "search"
                        else SloGuard(args.slo_ms, max_miss_share=1.0, overload_s=10.0)
                    )
                    run = await bench.run(system, workload, spec, guard, tags={"rate": rate})
                    passed = run.aborted is None and run.summary["slo_p99_ms"] <= args.slo_ms
                    run.tags["passed"] = passed
                    record = run.to_dict()
                    record["workload_description"] = workload.description
                    runs.append(record)
                    print(
                        f"{run.label}: p99 {run.summary['slo_p99_ms']:.0f} ms, "
                        f"{run.summary['items_per_s']:.1f} items/s",
                        flush=True,
                    )
                    return Probe(rate, passed, run)

                if args.arrival == "sweep":
                    for rate in rates:
                        await probe(rate)
                else:
                    found = await find_max_rate(probe, rates[0])
                    print(
                        f"{system.name}: highest rate with p99 <= {args.slo_ms:g} ms: "
                        f"{found.rate:.2f} req/s"
                    )
                continue
            spec = ArrivalSpec(
                kind=args.arrival,
                rate=args.rate if args.arrival in ("poisson", "bursty") else None,
                duration_s=args.duration,
                concurrency=args.concurrency,
                burst_on_s=args.burst_on,
                burst_off_s=args.burst_off,
                seed=args.seed,
            )
            if args.arrival == "replay" and workload.arrivals is None:
                raise SystemExit(
                    "--arrival replay needs arrival times: use --workload trace or a JSONL with "
                    "arrival_s on every line"
                )
            run = await bench.run(system, workload, spec)
            record = run.to_dict()
            record["workload_description"] = workload.description
            runs.append(record)
    return runs


def cmd_run(args: argparse.Namespace) -> int:
    from benchmarks import report
    from benchmarks.deploy import ServeCluster, logical_cpus_needed
    from benchmarks.runner import System
    from benchmarks.targets import make_target

    if bool(args.url) == bool(args.system):
        raise SystemExit("give either --system (deploy and measure) or --url (a running server)")
    results: dict[str, Any] = {"kind": "run", "command": _command_line()}
    results["machine_before"] = report.machine_info()
    cluster = None
    try:
        if args.url:
            kind = args.kind or ("rank" if args.workload == "rank-mixed" else "embed")
            name = args.prefix.strip("/") or "server"
            systems = [System(name, make_target(kind, name, args.prefix), app=args.app)]
            base_url, metrics_url = args.url, args.metrics_url
        else:
            specs = [SYSTEMS[name] for name in dict.fromkeys(args.system)]
            resources = Resources(
                num_cpus=args.num_cpus, torch_threads=args.torch_threads, model=args.model
            )
            cluster = ServeCluster(args.port, logical_cpus_needed(specs, resources))
            cluster.start()
            cluster.deploy(
                specs,
                resources,
                {s.name: args.carpool_batching for s in specs if s.name.startswith("carpool")},
            )
            systems = [
                System(s.name, make_target(s.kind, s.name, s.prefix), app=f"bench-{s.name}")
                for s in specs
            ]
            base_url = cluster.base_url
            metrics_url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
        results["runs"] = asyncio.run(_run_all(args, base_url, systems, metrics_url))
    finally:
        if cluster is not None:
            cluster.shutdown()
    results["machine_after"] = report.machine_info()
    out_dir = args.out or report.new_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(results, out_dir / "results.json")
    report.runs_plots(results["runs"], out_dir)
    text = report.runs_markdown(results)
    (out_dir / "report.md").write_text(text)
    print(text)
    print(f"results: {out_dir}")
    return 0


# --- offline / trace-info -----------------------------------------------------------------


def cmd_offline(args: argparse.Namespace) -> int:
    from benchmarks import report
    from benchmarks.offline import measure_offline_limit, texts_of
    from benchmarks.workloads import embed_workload

    texts = texts_of(embed_workload(max(args.texts, 100), args.seed).requests, args.texts)
    result = measure_offline_limit(
        texts,
        args.model,
        args.torch_threads,
        args.batch_sizes,
        args.arrival_batch_sizes,
        progress=not args.no_progress,
    )
    out = result.to_dict()
    out_dir = args.out or report.new_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(
        {"kind": "offline", "offline": out, "command": _command_line()}, out_dir / "results.json"
    )
    report.plot_offline(out, out_dir / "offline_limit.png")
    print(
        report.table(
            ["order", "batch size", "items/s", "tokens/s", "padded tokens/s"],
            [
                [
                    p["order"],
                    p["batch_size"],
                    p["items_per_s"],
                    p["tokens_per_s"],
                    p["padded_tokens_per_s"],
                ]
                for p in out["points"]
            ],
        )
    )
    best = result.best
    print(f"best: {best.items_per_s:.1f} items/s at batch {best.batch_size}; results: {out_dir}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from benchmarks import report
    from benchmarks.suite_figures import headline

    results = json.loads(args.results.read_text())
    if results.get("kind") != "suite":
        raise SystemExit(f"{args.results} is not a suite's results (kind={results.get('kind')!r})")
    out_dir = args.results.parent
    # Judged by today's rules (targets, when a ratio is undefined), from the stored windows.
    results["headline"] = headline(results)
    report.suite_plots(results, out_dir)
    (out_dir / "report.md").write_text(report.suite_markdown(results))
    if args.readme:
        results["rendered_with"] = _command_line()
        report.suite_plots(results, report.REPORT_DIR)
        report.write_readme(results)
        print(f"updated {report.README} and {report.REPORT_DIR}/")
    print(f"re-rendered {out_dir}/report.md and plots")
    return 0


def cmd_trace_info(args: argparse.Namespace) -> int:
    import statistics

    from benchmarks.trace import TRACE_ATTRIBUTION, TraceScaling, load_azure_trace, scale_trace

    rows = load_azure_trace(args.trace)
    ctx = [r.context_tokens for r in rows]
    span = rows[-1].t - rows[0].t
    print(
        f"{len(rows)} requests over {span:.0f} s ({len(rows) / span:.2f}/s); context tokens "
        f"mean {statistics.fmean(ctx):.0f}, p50 {statistics.median(ctx):.0f}, max {max(ctx)}"
    )
    scaled = scale_trace(
        rows,
        TraceScaling(
            rate=args.rate,
            duration_s=args.duration,
            start_s=args.trace_start,
            token_scale=args.token_scale,
        ),
    )
    print(json.dumps(scaled.describe(), indent=1))
    print(TRACE_ATTRIBUTION)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "suite": cmd_suite,
        "run": cmd_run,
        "offline": cmd_offline,
        "report": cmd_report,
        "trace-info": cmd_trace_info,
        "peers": __import__("benchmarks.peers.cli").peers.cli.run,
        "path": __import__("benchmarks.path").path.run,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
