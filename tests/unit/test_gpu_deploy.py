"""What a first `ray up cluster.yaml` or `kubectl apply` on GPU nodes would hit (issue 43).

Each test reads the shipped files (cluster.yaml, the Dockerfile, the Makefile, the KubeRay
manifests, serve-gpu.yaml) or runs carpool's own refusals; none needs a GPU, and none was
run on one (docs/gpu.md says what is untested).
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool import cuda_driver
from carpool.generation.vllm_options import GIB, VllmOptions, engine_args, gpu_budget_problem
from tests.unit.test_cluster_config import _make_target

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "docs" / "kuberay"
MANIFESTS = [KUBERAY / "rayservice.yaml", KUBERAY / "rayservice-gpu.yaml"]

# AWS instance shapes (vCPUs, GiB of memory, GPU GiB) from AWS's instance-type pages.
INSTANCES = {
    "g5.xlarge": (4, 16, 24),
    "g5.2xlarge": (8, 32, 24),
    "g6.2xlarge": (8, 32, 24),
    "m6i.2xlarge": (8, 32, 0),
}
# What one GPU node holds at serve-gpu.yaml's fractions (one replica of each model): host
# memory of a CUDA torch process (context + allocator + model), of a vLLM replica (its
# engine-core process loads the model again), and Ray's raylet, agents and HAProxy. Estimates
# from vLLM's and Ray's own guidance, not measured here (no GPU): docs/gpu.md.
HOST_GIB = {"torch_replica": 3.0, "vllm_replica": 6.0, "ray": 3.0}
ENGINE_CORE_CPUS = 2  # one busy engine-core process per vLLM replica


def _cluster() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def _gpu_node_recipe() -> list[str]:
    return _make_target("gpu-node") + _make_target("$(GPU_INSTALLED)")


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


# 1. The head's autoscaler imports boto3.


def test_rays_aws_node_provider_needs_boto3_and_the_head_has_it() -> None:
    import ray

    aws = Path(ray.__file__).parent / "autoscaler" / "_private" / "aws"
    assert re.search(r"^import boto3", (aws / "config.py").read_text(), re.M)
    cluster = _cluster()
    assert cluster["provider"]["type"] == "aws"
    # The head runs the image: the image installs boto3, and the head's setup checks it.
    (image_pip,) = re.findall(r"pip install [^\n]*-e '\.\[[^\]]*\]'", _dockerfile())
    assert "boto3" in _installed_by(image_pip)
    assert any("import boto3" in c for c in cluster["head_setup_commands"])
    # `make gpu-node` (a node without Docker) installs it too.
    assert any("boto3" in _installed_by(line) for line in _gpu_node_recipe() if "-e '." in line)


def _installed_by(pip_line: str) -> set[str]:
    """The distributions `pip install -e '.[extras]'` in ``pip_line`` brings beside carpool's
    own dependencies: the extras' requirements, a `carpool[other]` among them followed."""
    import tomllib

    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    match = re.search(r"-e '\.\[([^\]]*)\]'", pip_line)
    todo, seen, names = list(match.group(1).split(",")) if match else [], set(), set()
    while todo:
        extra = todo.pop().strip()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in optional[extra]:
            name = re.match(r"[\w.-]+", requirement).group(0).lower()
            own = re.fullmatch(r"carpool\[([^\]]+)\]", requirement.replace(" ", ""))
            if own:
                todo.extend(own.group(1).split(","))
            else:
                names.add(name)
    return names


def test_ray_up_runs_where_make_install_installed_boto3() -> None:
    """`ray up cluster.yaml` imports Ray's AWS node provider, and so boto3, on the machine
    that runs it: the project's venv (`make install`) must have it, and docs/cluster.md says
    how a launcher installs it."""
    (install,) = [
        line for line in _make_target("$(INSTALLED)") if "pip install" in line and "-e '." in line
    ]
    assert "boto3" in _installed_by(install), (
        f"`make install` runs {install!r}, which brings no boto3: `ray up cluster.yaml` from "
        "the venv fails importing Ray's AWS node provider; add the `cluster` extra to `dev`"
    )
    assert _installed_by("pip install -e '.[cluster]'") == {"boto3"}
    guide = (ROOT / "docs" / "cluster.md").read_text()
    assert "pip install -e '.[cluster]'" in guide and "boto3" in guide
    assert ".venv/bin/ray up cluster.yaml" in guide


# 2. Triton builds a C launcher against Python.h.


def test_the_image_and_gpu_node_have_a_c_compiler_and_python_h() -> None:
    dockerfile = _dockerfile()
    assert re.search(r"apt-get install [^\n]*\bgcc\b", dockerfile)
    assert "Python.h" in dockerfile  # checked in the build, not in a replica
    recipe = " ".join(_gpu_node_recipe())
    assert "$(PYTHON_H_CHECK)" in recipe and "python3.11-dev" in (ROOT / "Makefile").read_text()
    assert "command -v cc" in recipe or "command -v gcc" in recipe


def test_the_python_h_check_runs_and_names_the_package() -> None:
    makefile = (ROOT / "Makefile").read_text()
    check = makefile.split("PYTHON_H_CHECK := ", 1)[1].split("\n", 1)[0]
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0 or "python3.11-dev" in done.stderr, done.stderr
    # The refusal, forced: a Python whose include folder has no Python.h.
    broken = check.replace('sysconfig.get_paths()["include"]', '"/nonexistent"')
    refused = subprocess.run([sys.executable, "-c", broken], capture_output=True, text=True)
    assert refused.returncode == 1 and "install python3.11-dev" in refused.stderr


# 3. A pullable image with an explicit pull policy.


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_pod_image_is_pullable_with_a_pull_policy(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            image = container["image"]
            registry, _, rest = image.partition("/")
            assert "." in registry or ":" in registry, f"{image}: no registry (Docker Hub)"
            tag = rest.rpartition(":")[2] if ":" in rest else ""
            assert tag and tag != "latest", f"{image}: pulled again on every start"
            assert container.get("imagePullPolicy") in ("IfNotPresent", "Always"), container


PULL_SECRET = "carpool-registry"
IMAGE = "ghcr.io/<you>/carpool:0.1.0"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_pod_can_pull_a_private_image_with_the_documented_secret(path: Path) -> None:
    """GHCR makes a pushed package private: every pod names the pull Secret the docs create
    (a public image needs none; the kubelet warns and pulls anonymously without it)."""
    manifest = yaml.safe_load(path.read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        secrets = group["template"]["spec"].get("imagePullSecrets") or []
        assert {"name": PULL_SECRET} in secrets, (
            f"docs/kuberay/{path.name}: the {group.get('groupName', 'head')} pod names no "
            f"imagePullSecrets {PULL_SECRET}: a private image stays ImagePullBackOff"
        )
    create = f"kubectl create secret docker-registry {PULL_SECRET} --docker-server=ghcr.io"
    assert create in (KUBERAY / "README.md").read_text()
    assert create in (ROOT / "docs" / "cluster.md").read_text()


def test_the_docs_make_the_image_pullable_without_a_login_for_ray_up() -> None:
    """cluster.yaml's hosts pull with no registry login, so the docs make the package public
    and check it logged out, where `ray up` is described."""
    cluster = _cluster()
    assert cluster["docker"]["image"] == IMAGE and cluster["docker"]["pull_before_run"]
    assert not any("docker login" in c for c in cluster.get("initialization_commands", []))
    check = f"docker logout ghcr.io && docker pull {IMAGE}"
    gpu = (ROOT / "docs" / "gpu.md").read_text()
    assert check in gpu and "**Package settings**" in gpu and "→ **Public**" in gpu
    assert check in (ROOT / "docs" / "cluster.md").read_text()
    assert check in (ROOT / "cluster.yaml").read_text()
    # Nothing private goes into a public image.
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "**/auth_token", "**/api_keys"} <= set(ignored)


# 4. The driver against torch's CUDA.


def test_cuda_13_needs_a_580_driver_and_the_refusal_names_both() -> None:
    assert cuda_driver.required_driver("13.0") == (580, 65, 6)
    assert cuda_driver.required_driver("12.8") == (525, 60, 13)
    problem = cuda_driver.driver_problem("550.54.15", "13.0")
    assert problem and "550.54.15" in problem and "13.0" in problem and "580" in problem
    assert cuda_driver.driver_problem("580.65.06", "13.0") is None
    assert cuda_driver.driver_problem("590.10", "13.1") is None
    assert cuda_driver.driver_problem(None, "13.0") is None  # no GPU: nothing to run
    assert "no NVIDIA driver" in cuda_driver.driver_problem(None, "13.0", require_gpu=True)
    with pytest.raises(ValueError, match="MIN_DRIVER"):
        cuda_driver.required_driver("14.0")


def test_the_driver_is_read_from_the_kernel_modules_version_file(tmp_path: Path) -> None:
    version = tmp_path / "version"
    version.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build"
        "  (dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 09:59:25 UTC 2025\n"
        "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
    )
    assert cuda_driver.driver_version(version) == "580.95.05"
    version.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024"
    )
    assert cuda_driver.driver_version(version) == "535.183.01"


def test_no_gpu_here_is_refused_by_the_command_gpu_nodes_run() -> None:
    cluster = _cluster()
    assert any("carpool.cuda_driver --require-gpu" in c for c in cluster["worker_setup_commands"])
    assert any("cuda_driver" in line and "--require-gpu" in line for line in _gpu_node_recipe())
    if cuda_driver.driver_version() is not None:
        pytest.skip("this machine has an NVIDIA driver")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "carpool" / "cuda_driver.py"),
            "--require-gpu",
            "--cuda",
            "13.0",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "no NVIDIA driver" in done.stderr


# 4b. `make gpu-node` on Ubuntu 22.04 (python3 is 3.10) and beside a CPU torch (issue 52).


def test_make_gpu_node_checks_the_python_before_it_makes_or_fills_a_venv() -> None:
    recipe = _make_target("$(GPU_INSTALLED)")
    first = recipe[0]
    assert first.startswith("$(PYTHON) carpool/cuda_driver.py") and "--python" in first.split(), (
        f"$(GPU_INSTALLED) starts with {first!r}: a Python 3.10 gets as far as pip"
    )
    venv = next(i for i, line in enumerate(recipe) if "-m venv" in line)
    pips = [i for i, line in enumerate(recipe) if "pip install" in line]
    # A .venv an older Python made (an earlier `make install`) is refused too.
    (venv_check,) = [
        i for i, line in enumerate(recipe) if line == "$(PY) carpool/cuda_driver.py --python"
    ]
    assert venv < venv_check < min(pips)


def _run_cuda_driver_as(version: tuple[int, int, int], *args: str) -> subprocess.CompletedProcess:
    """carpool/cuda_driver.py run as the Makefile runs it, by a Python reporting ``version``."""
    script = (
        "import runpy, sys; "
        f"sys.version_info = {(*version, 'final', 0)!r}; "
        f"sys.argv = ['cuda_driver.py', *{list(args)!r}]; "
        f"runpy.run_path({str(ROOT / 'carpool' / 'cuda_driver.py')!r}, run_name='__main__')"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


def test_an_old_python_is_refused_with_the_fix_named() -> None:
    done = _run_cuda_driver_as((3, 10, 12), "--python")
    assert done.returncode == 1, done.stderr
    for words in (
        "Python 3.10.12",
        "3.11 or newer",
        "PYTHON=python3.11 make gpu-node",
        "ppa:deadsnakes/ppa",
        "python3.11 python3.11-venv python3.11-dev",
        "rm -rf .venv",
    ):
        assert words in done.stderr, (words, done.stderr)
    assert _run_cuda_driver_as((3, 11, 9), "--python").returncode == 0
    assert cuda_driver.python_problem((3, 12, 0)) is None


def test_the_version_check_runs_on_the_pythons_it_refuses() -> None:
    """`$(PYTHON) carpool/cuda_driver.py` runs under Ubuntu 22.04's 3.10 (and older): no
    syntax newer than 3.8, and the minimum is pyproject.toml's."""
    import ast
    import tomllib

    source = (ROOT / "carpool" / "cuda_driver.py").read_text()
    ast.parse(source, feature_version=(3, 8))
    assert "from __future__ import annotations" in source  # `str | None` stays unevaluated
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=" + ".".join(map(str, cuda_driver.MIN_PYTHON))


def test_a_cpu_torch_is_replaced_before_and_refused_after_installing() -> None:
    recipe = _make_target("$(GPU_INSTALLED)")
    install = next(i for i, line in enumerate(recipe) if "-e '.[vllm" in line)
    (drop,) = [i for i, line in enumerate(recipe) if "$(CPU_TORCH_CHECK)" in line]
    assert drop < install and "pip uninstall -y" in recipe[drop]
    refuse = [i for i, line in enumerate(recipe) if "--require-cuda-torch" in line]
    assert refuse and install < refuse[0] < len(recipe) - 1  # before the stamp
    assert any("--require-cuda-torch" in line for line in _make_target("gpu-node"))
    problem = cuda_driver.torch_problem("2.13.0+cpu", None)
    assert problem and "2.13.0+cpu" in problem and "pip uninstall -y torch" in problem
    assert "pip config list" in problem
    assert cuda_driver.torch_problem("2.13.0", "13.0") is None


def test_the_cpu_torch_here_is_seen_both_ways() -> None:
    """This machine's venv holds torch 2.13.0+cpu: the Makefile's check finds it (so `make
    gpu-node` would uninstall it), and the post-install check refuses it."""
    torch_version = cuda_driver.installed_torch()
    if torch_version is None or "+cpu" not in torch_version:
        pytest.skip(f"torch {torch_version} here is not a CPU build")
    makefile = (ROOT / "Makefile").read_text()
    check = makefile.split("CPU_TORCH_CHECK := ", 1)[1].split("\n", 1)[0]
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0
    done = subprocess.run(
        [sys.executable, "-m", "carpool.cuda_driver", "--require-cuda-torch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "is a CPU build" in done.stderr, done.stderr


# 5. Engines sharing a GPU get explicit budgets.


def _generators() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load((ROOT / "serve-gpu.yaml").read_text())
    (generate,) = [a for a in config["applications"] if a["name"] == "generate"]
    return {k: generate["args"][k] for k in ("small", "large")}


# Weights of the packaged generators in fp32 (the converted folders' size): SmolLM2-135M and
# Qwen2.5-Coder-0.5B (630M parameters with the untied embedding, PLATFORM.md).
WEIGHTS = {"small": 135e6 * 4, "large": 630e6 * 4}


def test_serve_gpus_engines_have_fixed_kv_caches_that_fit_a_24gb_gpu() -> None:
    total = 22.0 * GIB  # what torch reports for a 24 GB A10G or L4
    shares = 0.0
    for name, args in _generators().items():
        options = VllmOptions.model_validate(args["vllm"])
        assert options.kv_cache_memory_gib, f"{name}: vLLM would profile a shared GPU"
        problem = gpu_budget_problem(name, options, int(WEIGHTS[name]), int(total))
        assert problem is None, problem
        assert options.gpu_memory_utilization <= args["replica"]["num_gpus"]
        shares += args["replica"]["num_gpus"]
    assert shares <= 1.0


def test_a_budget_that_does_not_fit_is_refused_by_name() -> None:
    options = VllmOptions(gpu_memory_utilization=0.3, kv_cache_memory_gib=8)
    problem = gpu_budget_problem("large", options, int(2.5 * GIB), int(22 * GIB))
    assert problem and problem.startswith("large:") and "kv_cache_memory_gib" in problem
    over = gpu_budget_problem("small", VllmOptions(gpu_memory_utilization=0.5), 0, 1, 0.3)
    assert over and "num_gpus 0.3" in over


def test_a_generator_asking_vllm_for_more_than_its_gpu_share_is_refused() -> None:
    from carpool.generation.config import GeneratorConfig

    small = dict(_generators()["small"])
    GeneratorConfig.model_validate(small)
    small["vllm"] = {**small["vllm"], "gpu_memory_utilization": 0.5}
    with pytest.raises(ValueError, match=r"gpu_memory_utilization \(0.5\).*num_gpus \(0.3\)"):
        GeneratorConfig.model_validate(small)


def test_kv_cache_memory_goes_to_vllm_on_cuda_only() -> None:
    options = VllmOptions(kv_cache_memory_gib=3)
    assert engine_args(options, "m", 4096, 64, "bfloat16", "cuda")["kv_cache_memory_bytes"] == (
        3 * GIB
    )
    assert "kv_cache_memory_bytes" not in engine_args(options, "m", 4096, 64, "float32", "cpu")


# 6. Node sizes that hold what serve-gpu.yaml puts on them.


def _serve_gpu_replicas() -> list[dict]:
    """The ``replica`` section of every model deployment serve-gpu.yaml places."""
    config = yaml.safe_load((ROOT / "serve-gpu.yaml").read_text())
    return [
        section["replica"]
        for app in config["applications"]
        for section in app.get("args", {}).values()
        if isinstance(section, dict) and "replica" in section
    ]


def _host_gib(replicas: list[dict]) -> float:
    """Host memory of those replicas (vLLM's hold a GPU share of at least 0.25) and Ray."""
    vllm = [r for r in replicas if r["num_gpus"] >= 0.25]
    return (
        HOST_GIB["torch_replica"] * (len(replicas) - len(vllm))
        + HOST_GIB["vllm_replica"] * len(vllm)
        + HOST_GIB["ray"]
    )


def test_cluster_yaml_node_types_fit_their_instances_and_the_models() -> None:
    cluster = _cluster()
    worker = cluster["available_node_types"]["gpu_worker"]
    cpus, memory_gib, gpu_gib = INSTANCES[worker["node_config"]["InstanceType"]]
    assert worker["resources"]["CPU"] <= cpus and worker["resources"]["GPU"] == 1
    replicas = _serve_gpu_replicas()
    assert sum(r["num_cpus"] for r in replicas) + ENGINE_CORE_CPUS <= cpus
    host = _host_gib(replicas)
    assert host <= memory_gib * 0.85, (host, memory_gib)
    assert gpu_gib >= 24
    head = cluster["available_node_types"]["head"]
    assert head["resources"]["CPU"] <= INSTANCES[head["node_config"]["InstanceType"]][0]


def _generator_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_rayservice", KUBERAY / "make_rayservice.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(Gi|Mi)", quantity).groups()
    return float(number) / (1024 if unit == "Mi" else 1)


def test_the_gpu_pod_fits_the_node_it_is_sized_for() -> None:
    node = _generator_module().GPU_NODE
    cpus, memory_gib, _ = INSTANCES[node["instance"]]
    assert (cpus, memory_gib) == (node["cpus"], node["memory_gib"])
    assert (
        _cluster()["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"]
        == (node["instance"])
    )
    manifest = yaml.safe_load((KUBERAY / "rayservice-gpu.yaml").read_text())
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (gpu,) = [g for g in groups if g["groupName"] == "gpu"]  # and the CPU ingress group
    requests = gpu["template"]["spec"]["containers"][0]["resources"]["requests"]
    # The kubelet, the device plugin and daemonsets keep about a vCPU and a few GiB.
    assert float(requests["cpu"]) <= cpus - 1
    assert _gib(requests["memory"]) <= memory_gib - 4
    assert float(gpu["rayStartParams"]["num-cpus"]) >= 6  # four replicas and two engines
    readme = (KUBERAY / "README.md").read_text()
    assert "sized like `cluster.yaml`'s: 4 CPUs" not in readme
    assert node["instance"] in readme


def test_the_gpu_pods_memory_holds_its_processes_and_object_store() -> None:
    """Six CUDA processes (four replicas, two vLLM engine cores), Ray, and the object store in
    /dev/shm (counted in the pod's memory) under the pod's limit; Ray's default object store
    (30% of the limit) would not fit beside them."""
    manifest = yaml.safe_load((KUBERAY / "rayservice-gpu.yaml").read_text())
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (gpu,) = [g for g in groups if g["groupName"] == "gpu"]
    limit = _gib(gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"])
    store_bytes = gpu["rayStartParams"].get("object-store-memory")
    store = int(store_bytes) / 2**30 if store_bytes else 0.3 * limit  # Ray's default
    processes = _host_gib(_serve_gpu_replicas())
    assert processes + store <= limit, (
        f"the GPU pod's {limit} GiB holds {processes} GiB of processes and a {store:.1f} GiB "
        "object store only if object-store-memory is set (make_rayservice.py)"
    )
    volumes = {v["name"]: v for v in gpu["template"]["spec"]["volumes"]}
    assert _gib(volumes["dshm"]["emptyDir"]["sizeLimit"]) >= store  # the store fits /dev/shm


def test_the_image_compiles_nothing_with_the_base_images_cuda_12_nvcc() -> None:
    """Ray's -gpu base carries CUDA 12.1's nvcc; vLLM's default FlashInfer sampler would
    JIT-compile with it for a CUDA 13 torch. The image turns that sampler off."""
    assert re.search(r"^ENV VLLM_USE_FLASHINFER_SAMPLER=0$", _dockerfile(), re.M)
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in (ROOT / "docs" / "gpu.md").read_text()


# 7. Covered in test_cluster_config.py (nodes run the image; gpu-node has no dev extras).

# 8. Ray's CLI on the head sends the token.


def test_ray_exec_shells_have_token_auth() -> None:
    from ray.autoscaler._private import command_runner

    # `ray exec` runs its command in `bash -i` after `source ~/.bashrc`.
    assert "source ~/.bashrc" in inspect.getsource(command_runner._with_interactive)
    setup = " ".join(_cluster()["setup_commands"])
    assert re.search(r"echo '[^']*RAY_AUTH_MODE=token[^']*' >> ~/.bashrc", setup), setup


# 9. KubeRay details.


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_no_deprecated_fields_and_shm_on_every_pod(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    for field in ("serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"):
        assert field not in manifest["spec"], f"{field}: deprecated and unused since v1.6"
    cluster = manifest["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        (container,) = spec["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        assert "/dev/shm" in mounts, f"{container['name']}: object store on disk"
        empty_dir = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert empty_dir["medium"] == "Memory"
        limit = container["resources"]["limits"]["memory"]
        assert _gib(empty_dir["sizeLimit"]) <= _gib(limit) / 2


def test_gpu_pods_tolerate_the_gpu_taint() -> None:
    manifest = yaml.safe_load((KUBERAY / "rayservice-gpu.yaml").read_text())
    for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        if int(limits.get("nvidia.com/gpu", 0)) == 0:
            continue
        tolerations = group["template"]["spec"].get("tolerations", [])
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
            tolerations
        ), group["groupName"]
