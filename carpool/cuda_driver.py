"""Whether this node's NVIDIA driver can run the CUDA that the installed torch was built with.

vLLM 0.32 pins torch 2.13.0, whose CUDA wheels carry CUDA 13, and CUDA 13 needs a driver of
the 580 series or newer. With an older driver every GPU replica fails (each with torch's own
message, all of them); ``make gpu-node``, cluster.yaml's worker setup and a ``mode: vllm``
replica on CUDA call ``driver_problem`` first and refuse by name: the driver found, the CUDA
torch needs, and the driver that CUDA needs.

    python -m carpool.cuda_driver                 # exit 1 when the driver is too old
    python -m carpool.cuda_driver --require-gpu   # and when there is no NVIDIA driver at all
    python3 carpool/cuda_driver.py --cuda 13.0     # before torch is installed (stdlib only)
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
    args = parser.parse_args(argv)
    driver, cuda = driver_version(), args.cuda or torch_cuda_version()
    problem = driver_problem(driver, cuda, args.require_gpu)
    if problem is not None:
        print(f"refused: {problem}", file=sys.stderr)
        return 1
    print(f"NVIDIA driver {driver or 'none'}, torch CUDA {cuda or 'none (CPU build)'}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
