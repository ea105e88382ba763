"""The torch encoders' bounded share of a shared GPU (issue 43, point 5), without a GPU.

``gpu_memory_fraction`` on the embedder's and the ranker's config: bounded, refused by name
where it cannot be honoured (a replica on the CPU, or a share above its ``num_gpus``), and on
a CUDA device handed to ``torch.cuda.set_per_process_memory_fraction`` before the weights
load. Configs are parsed for real and the device is decided by ``place_replica``; only the
GPU probes and torch's CUDA calls are replaced, since this machine has no GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from pydantic import ValidationError

from carpool.devices import DeviceProbes, DeviceUnusable, limit_gpu_memory, place_replica
from carpool.models import load_pretrained
from deployments.embedder import EmbedderConfig
from deployments.ranker import RankerConfig
from tests.cluster.overlay import load_overlaid

ROOT = Path(__file__).resolve().parents[2]
ENCODERS = [
    pytest.param(EmbedderConfig, "embedder", "embed", id="embedder"),
    pytest.param(RankerConfig, "ranker", "rank", id="ranker"),
]
ON_A_GPU = {"replica": {"num_gpus": 0.125}}


def _serve_gpu() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "serve-gpu.yaml").read_text())


def _args(config: dict[str, Any], app: str) -> dict[str, Any]:
    return next(a for a in config["applications"] if a["name"] == app)["args"]


@pytest.mark.parametrize(("cls", "key", "app"), ENCODERS)
def test_the_fraction_is_bounded_to_0_1(cls: Any, key: str, app: str) -> None:
    assert cls().gpu_memory_fraction is None  # no cap unless asked
    assert cls(gpu_memory_fraction=1.0, replica={"num_gpus": 1}).gpu_memory_fraction == 1.0
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValidationError, match="gpu_memory_fraction"):
            cls(gpu_memory_fraction=bad, **ON_A_GPU)
    described = cls.model_json_schema()["properties"]["gpu_memory_fraction"]
    assert "set_per_process_memory_fraction" in described["description"]


@pytest.mark.parametrize(("cls", "key", "app"), ENCODERS)
def test_a_fraction_on_the_cpu_is_refused_by_name(cls: Any, key: str, app: str) -> None:
    with pytest.raises(ValidationError, match=rf"{key}: gpu_memory_fraction is 0.1 .*num_gpus"):
        cls(gpu_memory_fraction=0.1)  # num_gpus 0: the replica computes on the CPU
    with pytest.raises(ValidationError, match=r"gpu_memory_fraction is 0.1 but source.device"):
        cls(gpu_memory_fraction=0.1, source={"model": "m", "device": "cpu"}, **ON_A_GPU)
    with pytest.raises(ValidationError, match=r"gpu_memory_fraction \(0.2\) exceeds .*0.125"):
        cls(gpu_memory_fraction=0.2, **ON_A_GPU)
    # The same refusal where the device is known only at load (a device other than CUDA).
    with pytest.raises(DeviceUnusable, match=r"gpu_memory_fraction is 0.1 .*'cpu'"):
        limit_gpu_memory(0.1, "cpu", setter=lambda *a: pytest.fail("applied on the CPU"))


def test_serve_gpu_caps_both_encoders_within_what_the_engines_leave() -> None:
    config = _serve_gpu()
    embed = EmbedderConfig.model_validate(_args(config, "embed")["embedder"])
    rank = RankerConfig.model_validate(_args(config, "rank")["ranker"])
    generate = _args(config, "generate")
    engines = sum(generate[m]["vllm"]["gpu_memory_utilization"] for m in ("small", "large"))
    fractions = [embed.gpu_memory_fraction, rank.gpu_memory_fraction]
    assert all(fractions), "serve-gpu.yaml leaves an encoder uncapped on the shared GPU"
    # One replica of each on one GPU (docs/gpu.md): every share at most its num_gpus, all < 1.
    assert embed.gpu_memory_fraction <= embed.replica.num_gpus
    assert rank.gpu_memory_fraction <= rank.replica.num_gpus
    assert sum(fractions) + engines <= 1.0


def test_the_cluster_tiers_cpu_overlay_drops_the_cap() -> None:
    values = {k: "x" for k in ("PORT", "ENCODER", "CROSS_ENCODER", "CAUSAL_LM", "WORK")}
    overlay = ROOT / "tests" / "cluster" / "serve-gpu.cpu-overlay.yaml"
    config = load_overlaid(str(ROOT / "serve-gpu.yaml"), str(overlay), values)
    embed = EmbedderConfig.model_validate(_args(config, "embed")["embedder"])
    rank = RankerConfig.model_validate(_args(config, "rank")["ranker"])
    assert embed.gpu_memory_fraction is None and rank.gpu_memory_fraction is None


class _Model:
    """Stands in for the weights: records where it is put (CPU torch cannot move to CUDA)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def to(self, device: str) -> _Model:
        self.events.append(("to", device))
        return self

    def eval(self) -> _Model:
        return self


@pytest.mark.parametrize(("cls", "key", "app"), ENCODERS)
def test_on_a_cuda_replica_the_fraction_is_set_before_the_weights_arrive(
    cls: Any, key: str, app: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # serve-gpu.yaml's encoder config, placed as its deployment places it on a GPU replica,
    # then loaded as TextEmbedder / the scorers load it.
    config = cls.model_validate(_args(_serve_gpu(), app)[key])
    probes = DeviceProbes(gpu_ids=lambda: ["0"], torch=lambda: (True, "torch for CUDA 13.0"))
    placed = place_replica(config, "torch", probes)
    assert placed.source.device == "cuda"
    events: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d: events.append(("cap", f, d))
    )
    loaded = load_pretrained(
        placed.source.model,
        object,
        placed.source.device,
        placed.source.dtype,
        model=_Model(events),
        tokenizer=object(),
        gpu_memory_fraction=placed.gpu_memory_fraction,
    )
    assert loaded.device == "cuda"
    assert events == [("cap", config.gpu_memory_fraction, 0), ("to", "cuda")]


def test_the_cap_goes_to_the_device_the_replica_computes_on() -> None:
    calls: list[tuple[float, int]] = []
    assert limit_gpu_memory(0.25, "cuda:1", setter=lambda f, d: calls.append((f, d)))
    assert limit_gpu_memory(0.5, "cuda", setter=lambda f, d: calls.append((f, d)))
    assert not limit_gpu_memory(None, "cuda", setter=lambda f, d: calls.append((f, d)))
    assert not limit_gpu_memory(None, "cpu")  # no cap asked: nothing to refuse
    assert calls == [(0.25, 1), (0.5, 0)]
