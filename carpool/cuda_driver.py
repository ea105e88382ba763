"""Whether this node's NVIDIA driver can run the CUDA that the installed torch was built with.

vLLM 0.32 pins torch 2.13.0, whose CUDA wheels carry CUDA 13, and CUDA 13 needs a driver of
the 580 series or newer. With an older driver every GPU replica fails (each with torch's own
message, all of them); ``make gpu-node``, cluster.yaml's worker setup and a ``mode: vllm``
replica on CUDA call ``driver_problem`` first and refuse by name: the driver found, the CUDA
torch needs, and the driver that CUDA needs.

    python -m carpool.cuda_driver                 # exit 1 when the driver is too old
    python -m carpool.cuda_driver --require-gpu   # and when there is no NVIDIA driver at all
    python3 carpool/cuda_driver.py --cuda 13.0     # before torch is installed (stdlib only)

``make gpu-node`` also asks it two things pip answers too late: whether the Python that will
hold the venv is one carpool and vLLM install on (``--python``: Ubuntu 22.04's python3 is
3.10, and pip's refusal names neither the fix nor the package), and whether the installed
torch is a CUDA build (``--require-cuda-torch``: a CPU build 2.13.0+cpu satisfies vLLM's
``torch==2.13.0`` pin, so pip keeps it). It runs as a plain script under whatever python3
the machine has, so it stays stdlib-only and free of syntax newer than Python 3.8.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

# The oldest Linux driver of each CUDA major (NVIDIA's CUDA release notes, "CUDA Toolkit and
# Minimum Required Driver Version for CUDA Minor Version Compatibility"): any 13.x runs on a
# 580 driver, any 12.x on 525.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}

PROC_VERSION = Path("/proc/driver/nvidia/version")

# pyproject.toml's requires-python (asyncio.timeout) and vllm==0.32.0's: the oldest Python the
# GPU venv can be made with. tests/unit/test_gpu_deploy.py fails when the two drift apart.
MIN_PYTHON = (3, 11)


def parse_version(text: str) -> tuple[int, ...]:
    """'580.65.06' -> (580, 65, 6); ValueError when it holds no version."""
    match = re.search(r"\d+(?:\.\d+)*", text)
    if not match:
        raise ValueError(f"no version in {text!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def driver_version(proc_version: Path = PROC_VERSION) -> str | None:
    """The loaded NVIDIA kernel driver's version, or None where there is none.

    /proc/driver/nvidia/version first (present in containers that see the GPU, no binary
    needed), else ``nvidia-smi``.
    """
    try:
        text = proc_version.read_text()
    except OSError:
        text = ""
    match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    if match:
        return match.group(1)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None


def torch_cuda_version() -> str | None:
    """The CUDA the installed torch was built with ('13.0'), None for a CPU build or none."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def required_driver(cuda: str) -> tuple[int, ...]:
    """The oldest driver that runs CUDA ``cuda`` (e.g. '13.0' -> (580, 65, 6))."""
    major = parse_version(cuda)[0]
    if major in MIN_DRIVER:
        return MIN_DRIVER[major]
    if major > max(MIN_DRIVER):
        raise ValueError(
            f"CUDA {cuda} is newer than carpool's table of drivers (up to CUDA "
            f"{max(MIN_DRIVER)}): add its minimum driver to MIN_DRIVER in carpool/cuda_driver.py"
        )
    return MIN_DRIVER[min(MIN_DRIVER)]


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(f"{part:02d}" if i == 2 else str(part) for i, part in enumerate(version))


def driver_problem(driver: str | None, cuda: str | None, require_gpu: bool = False) -> str | None:
    """Why this driver cannot run this CUDA (a sentence naming both), or None when it can."""
    if driver is None:
        if require_gpu:
            return (
                "no NVIDIA driver on this node (no /proc/driver/nvidia/version, no nvidia-smi): "
                "a GPU node needs the NVIDIA driver, 580 or newer for torch 2.13's CUDA 13 "
                "(docs/gpu.md)"
            )
        return None
    if cuda is None:
        return None  # a CPU torch: nothing of the driver's is used
    needed = required_driver(cuda)
    have = parse_version(driver)
    if have < needed:
        return (
            f"NVIDIA driver {driver} is too old for CUDA {cuda}, which the installed torch "
            f"was built with: CUDA {parse_version(cuda)[0]} needs driver {_dotted(needed)} or "
            f"newer. Upgrade the driver (the {needed[0]} series or newer; docs/gpu.md), or "
            f"install a torch built for an older CUDA"
        )
    return None


def python_problem(
    version: tuple[int, ...] | None = None, executable: str | None = None
) -> str | None:
    """Why this Python cannot hold carpool's GPU venv (a sentence naming the fix), or None."""
    version = tuple(sys.version_info[:3]) if version is None else tuple(version)
    if version[:2] >= MIN_PYTHON:
        return None
    have = ".".join(str(part) for part in version)
    need = ".".join(str(part) for part in MIN_PYTHON)
    return (
        f"{executable or sys.executable} is Python {have}; carpool and vLLM 0.32 need "
        f"Python {need} or newer, and pip would refuse only after downloading. Install "
        f"python{need} with its venv and headers (Ubuntu 22.04: `sudo add-apt-repository -y "
        f"ppa:deadsnakes/ppa && sudo apt-get install -y python{need} python{need}-venv "
        f"python{need}-dev`), remove a .venv made by the old Python (`rm -rf .venv`), then "
        f"run `PYTHON=python{need} make gpu-node`"
    )


def torch_problem(torch_version: str | None, cuda: str | None) -> str | None:
    """Why the installed torch cannot drive the GPU (a sentence naming the fix), or None."""
    if torch_version is None:
        return "torch is not installed in this Python: run `make gpu-node`"
    if cuda is None:
        return (
            f"torch {torch_version} in {sys.executable} is a CPU build: it satisfies vLLM's "
            "torch==2.13.0 pin, so pip kept it, and every GPU replica would run without CUDA. "
            f"Remove it (`{sys.executable} -m pip uninstall -y torch`) and what made pip "
            "choose it (a CPU index or find-links in `pip config list`, or PIP_* variables), "
            "then rerun `make gpu-node`: PyPI's torch 2.13.0 for Linux is the CUDA build"
        )
    return None


def installed_torch() -> str | None:
    """The installed torch's version ('2.13.0+cpu') from its metadata, without importing it."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check(require_gpu: bool = False) -> None:
    """Raises ``RuntimeError`` with ``driver_problem``'s sentence, if there is one."""
    problem = driver_problem(driver_version(), torch_cuda_version(), require_gpu)
    if problem is not None:
        raise RuntimeError(problem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--require-gpu", action="store_true", help="refuse a node without an NVIDIA driver"
    )
    parser.add_argument(
        "--cuda",
        help="check against this CUDA version instead of the installed torch's (before "
        "torch is installed: `make gpu-node` passes the CUDA that vLLM's torch pin brings)",
    )
    parser.add_argument(
        "--python",
        action="store_true",
        help="first refuse a Python older than carpool's GPU venv needs (run by the python3 "
        "that `make gpu-node` will make the venv with)",
    )
    parser.add_argument(
        "--require-cuda-torch",
        action="store_true",
        help="refuse an installed torch without CUDA (a CPU build kept by pip)",
    )
    args = parser.parse_args(argv)
    problem = python_problem() if args.python else None
    if problem is None and args.require_cuda_torch:
        problem = torch_problem(installed_torch(), torch_cuda_version())
    driver, cuda = driver_version(), args.cuda or torch_cuda_version()
    if problem is None:
        problem = driver_problem(driver, cuda, args.require_gpu)
    if problem is not None:
        print(f"refused: {problem}", file=sys.stderr)
        return 1
    print(f"NVIDIA driver {driver or 'none'}, torch CUDA {cuda or 'none (CPU build)'}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
