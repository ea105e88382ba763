"""One-shot GPU check: serve-gpu.yaml's apps on one GPU, one request each, a short load, one JSON.

For the first machine with a GPU (one GPU, 16 cores, no internet; ``make gpu-check`` installs
what it needs first through ``make gpu-node``). It starts a private Ray on this machine with
the GPU and both of serve-gpu.yaml's node resources (``carpool_head_node`` and
``carpool_gpu_node``), so every app lands here at its fractional ``num_gpus``; sends each
endpoint one request; then a short closed-loop load per endpoint: embeddings items/s, rerank
items/s, and for ``small`` and ``large`` tokens/s with time to first token p50/p99 at 16
streaming clients. Writes one JSON and exits, within ``--budget-s`` (default 540 s: under the
10 minutes the issue allows). Without a GPU it refuses at once, says why, and writes a JSON
with ``status: refused``. Where only torch and transformers are installed (no Ray, no vLLM),
``python -m benchmarks.gpu_torch_check`` runs the part that is carpool's own code: the
encoders' batching and carpool's generation engine on the GPU.

    make gpu-check                                   # = python -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --out benchmarks/results/gpu-check.json --load-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from carpool import local_ray

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu-check.json"
RESOURCES = {"carpool_head_node": 1, "carpool_gpu_node": 1, "carpool_ingress": 16}
EMBED_TEXTS = 16  # items per embeddings request
RERANK_DOCS = 16  # items per rerank request
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MAX_TOKENS = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "serve-gpu.yaml")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients per load")
    parser.add_argument("--load-s", type=float, default=30.0, help="seconds of load per endpoint")
    parser.add_argument(
        "--budget-s", type=float, default=540.0, help="the whole run, start-up included"
    )
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    if args.clients < 1 or args.load_s <= 0 or args.budget_s <= 0:
        parser.error(
            f"--clients ({args.clients}), --load-s ({args.load_s}) and --budget-s "
            f"({args.budget_s}) must be positive"
        )
    if 4 * args.load_s + 60 > args.budget_s:
        parser.error(
            f"four loads of --load-s {args.load_s} s leave no start-up time in --budget-s "
            f"{args.budget_s}: lower --load-s or raise --budget-s"
        )
    return args


def gpu_refusal() -> str | None:
    """Why this machine cannot run the check (no GPU, an old driver), or None."""
    from carpool import cuda_driver

    problem = cuda_driver.driver_problem(
        cuda_driver.driver_version(), cuda_driver.torch_cuda_version(), require_gpu=True
    )
    if problem is not None:
        return problem
    import torch

    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} sees no CUDA device (CPU build, or "
            "CUDA_VISIBLE_DEVICES hides the GPU): `make gpu-node` installs the CUDA build"
        )
    return None


def prepare_config(text: str, index_dir: str, port: int) -> dict[str, Any]:
    """serve-gpu.yaml for one machine: Serve on loopback, the retriever's index in a scratch
    folder, ``large`` kept at one replica (it scales to zero in the shipped config)."""
    config = yaml.safe_load(text)
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}
    for app in config["applications"]:
        retriever = app.get("args", {}).get("retriever")
        if isinstance(retriever, dict) and "index_dir" in retriever:
            retriever["index_dir"] = index_dir
        for deployment in app.get("deployments") or []:
            scaling = deployment.get("autoscaling_config")
            if deployment["name"] == "large" and scaling:
                deployment["autoscaling_config"] = {**scaling, "min_replicas": 1}
    return config


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize_items(items: int, seconds: float, errors: int) -> dict[str, Any]:
    return {
        "items": items,
        "seconds": round(seconds, 2),
        "items_per_s": round(items / seconds, 2) if seconds > 0 else None,
        "errors": errors,
    }


def summarize_stream(
    tokens: int, seconds: float, ttfts_s: list[float], errors: int
) -> dict[str, Any]:
    p50, p99 = percentile(ttfts_s, 50), percentile(ttfts_s, 99)
    return {
        "requests": len(ttfts_s),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
        "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 1),
        "ttft_p99_ms": None if p99 is None else round(p99 * 1000, 1),
        "errors": errors,
    }


def result_skeleton(args: argparse.Namespace, status: str, reason: str | None) -> dict[str, Any]:
    """The JSON's shape; the run fills ``gpu``, ``startup_s``, ``single`` and ``load``."""
    return {
        "status": status,  # ok | refused | failed
        "reason": reason,
        "config": str(args.config),
        "clients": args.clients,
        "load_s": args.load_s,
        "budget_s": args.budget_s,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "gpu": None,
        "versions": {},
        "startup_s": None,
        "single": {},
        "load": {},
        "wall_s": None,
        "command": "make gpu-check",
    }


def write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


# --- the run (GPU only) ----------------------------------------------------------------------


def _gpu_facts() -> dict[str, Any]:
    import torch

    from carpool import cuda_driver

    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 1024**3, 1),
        "driver": cuda_driver.driver_version(),
        "torch_cuda": torch.version.cuda,
    }


def versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for name in ("ray", "vllm", "torch", "transformers"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "missing"
    return found


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _wait_running(deadline: float) -> None:
    import httpx

    token = local_ray.token_path().read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    while time.monotonic() < deadline:
        try:
            url = "http://127.0.0.1:8265/api/serve/applications/"
            apps = httpx.get(url, headers=headers, timeout=10).json()
            statuses = {name: a["status"] for name, a in apps.get("applications", {}).items()}
            if statuses and all(s == "RUNNING" for s in statuses.values()):
                return
            broken = {n: s for n, s in statuses.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}
            if broken:
                raise RuntimeError(f"apps failed to deploy: {broken}")
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(3)
    raise TimeoutError("serve-gpu.yaml's apps were not all RUNNING before the budget ran out")


async def _one(client: Any, base: str, headers: dict[str, str]) -> dict[str, Any]:
    calls = {
        "embeddings": ("/v1/embeddings", {"input": ["hello GPU"]}),
        "rerank": ("/v1/rerank", {"query": "lighthouse", "documents": ["a lighthouse", "a cat"]}),
        "small": ("/v1/chat/completions", _chat("small", stream=False)),
        "large": ("/v1/chat/completions", _chat("large", stream=False)),
        "search": ("/search/v1/search", {"query": "batching", "top_k": 2}),
    }
    out = {}
    for name, (path, body) in calls.items():
        started = time.perf_counter()
        try:
            response = await client.post(base + path, json=body, headers=headers)
            out[name] = {"status": response.status_code}
        except Exception as exc:
            out[name] = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
        out[name]["latency_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return out


def _chat(model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _items_load(
    client: Any, url: str, body: dict[str, Any], items: int, args: argparse.Namespace, h: Any
) -> dict[str, Any]:
    done, errors = 0, 0
    end = time.monotonic() + args.load_s

    async def worker() -> None:
        nonlocal done, errors
        while time.monotonic() < end:
            try:
                response = await client.post(url, json=body, headers=h)
                if response.status_code == 200:
                    done += items
                else:
                    errors += 1
            except Exception:
                errors += 1

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(args.clients)))
    return summarize_items(done, time.monotonic() - started, errors)


async def _stream_load(
    client: Any, url: str, model: str, args: argparse.Namespace, h: Any
) -> dict[str, Any]:
    tokens, errors, ttfts = 0, 0, []
    end = time.monotonic() + args.load_s

    async def worker() -> None:
        nonlocal tokens, errors
        while time.monotonic() < end:
            started = time.perf_counter()
            first = None
            try:
                async with client.stream(
                    "POST", url, json=_chat(model, True), headers=h
                ) as response:
                    if response.status_code != 200:
                        errors += 1
                        continue
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and chunk.get("choices"):
                            first = time.perf_counter() - started
                        if chunk.get("usage"):
                            tokens += chunk["usage"]["completion_tokens"]
                if first is not None:
                    ttfts.append(first)
            except Exception:
                errors += 1

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(args.clients)))
    return summarize_stream(tokens, time.monotonic() - started, ttfts, errors)


async def _traffic(args: argparse.Namespace, key: str, result: dict[str, Any]) -> None:
    import httpx

    base = f"http://127.0.0.1:{args.port}"
    h = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        result["single"] = await _one(client, base, h)
        texts = [f"text {i}: {PROMPT}" for i in range(EMBED_TEXTS)]
        result["load"]["embeddings"] = await _items_load(
            client, base + "/v1/embeddings", {"input": texts}, EMBED_TEXTS, args, h
        )
        docs = [f"document {i} about lighthouses and bottles" for i in range(RERANK_DOCS)]
        result["load"]["rerank"] = await _items_load(
            client, base + "/v1/rerank", {"query": PROMPT, "documents": docs}, RERANK_DOCS, args, h
        )
        for model in ("small", "large"):
            result["load"][model] = await _stream_load(
                client, base + "/v1/chat/completions", model, args, h
            )


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    started = time.monotonic()
    deadline = started + args.budget_s - 4 * args.load_s - 30
    result["gpu"], result["versions"] = _gpu_facts(), versions()
    key = secrets.token_hex(16)
    scratch = Path(tempfile.mkdtemp(prefix="carpool-gpu-check-"))
    config = prepare_config(args.config.read_text(), str(scratch / "index"), args.port)
    config_path = scratch / "serve-gpu.check.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    # The one-box Ray make serve runs: token auth (the token where Ray looks) and every Ray port
    # on 127.0.0.1 (carpool/local_ray.py); Serve's own HTTP keeps serve-gpu.yaml's host.
    env = {**os.environ, **local_ray.ray_environment(), "CARPOOL_API_KEYS": key}
    ray = _bin("ray")
    subprocess.run([ray, "stop", "--force"], env=env, capture_output=True)
    try:
        subprocess.run(
            [
                ray,
                "start",
                "--head",
                "--num-gpus=1",
                f"--resources={json.dumps(RESOURCES)}",
                "--dashboard-host=127.0.0.1",
                "--disable-usage-stats",
            ],
            env=env,
            check=True,
        )
        subprocess.run([_bin("serve"), "deploy", str(config_path)], env=env, check=True)
        _wait_running(deadline)
        result["startup_s"] = round(time.monotonic() - started, 1)
        asyncio.run(_traffic(args, key, result))
        bad = {k: v for k, v in result["single"].items() if v.get("status") != 200}
        result["status"] = "ok" if not bad else "failed"
        result["reason"] = None if not bad else f"endpoints without a 200: {sorted(bad)}"
    finally:
        subprocess.run([_bin("serve"), "shutdown", "-y"], env=env, capture_output=True)
        subprocess.run([ray, "stop"], env=env, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    refusal = gpu_refusal()
    if refusal is not None:
        print(f"refused: {refusal}", file=sys.stderr)
        result = result_skeleton(args, "refused", refusal)
        write(result, args.out)
        return 1
    result = result_skeleton(args, "failed", None)
    try:
        run(args, result)
    except Exception as exc:
        result["status"], result["reason"] = "failed", f"{type(exc).__name__}: {exc}"
    result["wall_s"] = round(time.monotonic() - started, 1)
    write(result, args.out)
    print(json.dumps({k: result[k] for k in ("status", "reason", "load")}, indent=2))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
