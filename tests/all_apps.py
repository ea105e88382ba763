"""Every carpool pipeline deployed at once on tiny models, for the bad-input suites.

``deploy_all_apps(models, "fz")`` runs the embed, rank, search, rag and generate apps under
``/fz-embed``, ``/fz-rank``... and wires search and rag to the embed, rank and generate apps
of the same prefix, as serve.yaml wires the real ones; the OpenAI app (``/fz-openai_api``)
fronts all of them, as serve.yaml's ``/`` does. Generation limits are tiny (at most
``MAX_TOKENS`` tokens), so a fuzzer's request for more is refused fast, and what it may ask
for stays cheap on two cores.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

# Largest max_tokens the tiny generators accept; anything above must get a fast 400.
MAX_TOKENS = 16
APPS = ("embed", "rank", "search", "rag", "generate", "openai_api")
# A request each app must keep answering with 200 while hostile traffic flows.
GOOD_REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "embed": ("/v1/embeddings", {"input": ["a fine sentence", "another one"]}),
    "rank": ("/v1/rerank", {"query": "river", "documents": ["the river", "a city"]}),
    "search": ("/v1/search", {"query": "bridge colour", "top_k": 4, "top_n": 2}),
    "rag": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "What colour is the bridge?"}], "max_tokens": 4},
    ),
    "generate": (
        "/v1/completions",
        {"model": "small", "prompt": "the river", "max_tokens": 4, "temperature": 0},
    ),
    "openai_api": (
        "/v1/embeddings",
        {"model": "tiny-encoder", "input": ["a fine sentence", "another one"]},
    ),
}
SEED_DOCUMENT = {
    "id": "quillon",
    "text": "The Zorblatt bridge in Quillon was painted bright orange in 1987.",
    "metadata": {"topic": "bridges"},
}


@dataclass
class DeployedApps:
    base: str  # the Serve proxy, e.g. http://127.0.0.1:PORT
    names: dict[str, str]  # pipeline -> Serve app name (also its route prefix)

    def url(self, app: str, path: str = "") -> str:
        return f"{self.base}/{self.names[app]}{path}"


def _generator(model: str, mode: str, name: str) -> dict[str, Any]:
    return {
        "source": {"model": model, "served_model_name": name},
        "mode": mode,
        "replica": {"num_cpus": 0.25, "torch_threads": 1},
        "limits": {"max_seq_len": 512, "max_tokens_limit": MAX_TOKENS, "default_max_tokens": 8},
        "batching": {"max_num_seqs": 8, "max_step_tokens": 512, "batch_wait_timeout_s": 0.005},
    }


def app_args(models: dict[str, str], names: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The ``args`` of each pipeline, as its serve config entry would give them."""
    batching = {"max_batch_size": 32, "max_batch_tokens": 4096, "batch_wait_timeout_s": 0.005}
    replica = {"num_cpus": 0.25, "torch_threads": 1}
    return {
        "embed": {
            "embedder": {
                "source": {"model": models["encoder"], "max_length": 64},
                "replica": replica,
                "batching": batching,
            }
        },
        "rank": {
            "ranker": {
                "backend": "cross_encoder",
                "source": {"model": models["cross_encoder"], "max_length": 64},
                "replica": replica,
                "batching": batching,
            }
        },
        "search": {
            "app_name": names["search"],
            "rank_app": names["rank"],
            "retriever": {
                "index_dir": "",  # memory only: fuzzed documents must not outlive the test
                "seed_default_corpus": False,
                "embed_app": names["embed"],
            },
        },
        "rag": {
            "search_app": names["search"],
            "rank_app": names["rank"],
            "generate_app": names["generate"],
            "default_max_tokens": 4,
            "max_tokens_limit": MAX_TOKENS,
            # Every retrieved chunk becomes a source, so a document whose exact text is asked
            # for is always cited; short sources keep the prompt inside the tiny context.
            "top_k": 4,
            "context_chunks": 4,
            "max_source_chars": 200,
        },
        "generate": {
            "small": _generator(models["causal_lm"], "continuous", "tiny-small"),
            "large": _generator(models["causal_lm"], "static", "tiny-large"),
            "router": {"default_max_tokens": 8},
            "ingress": {"num_cpus": 0.1},
        },
        "openai_api": {
            "embed_app": names["embed"],
            "rank_app": names["rank"],
            "generate_app": names["generate"],
            "rag_app": names["rag"],
            "ingress": {"num_cpus": 0.05},
        },
    }


def post_json(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120)


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body."""
    return response.json()["error"]["message"]


@contextmanager
def deploy_all_apps(models: dict[str, str], base: str, prefix: str) -> Iterator[DeployedApps]:
    """Runs the five pipelines and the OpenAI app (``serve.run``); deletes them on exit."""
    from ray import serve

    from pipelines.embed import build_embed_app
    from pipelines.generate import build_generate_app
    from pipelines.openai_api import build_openai_app
    from pipelines.rag import build_rag_app
    from pipelines.rank import build_rank_app
    from pipelines.search import build_search_app

    builders = {
        "embed": build_embed_app,
        "rank": build_rank_app,
        "generate": build_generate_app,
        "search": build_search_app,
        "rag": build_rag_app,
        "openai_api": build_openai_app,
    }
    names = {app: f"{prefix}-{app}" for app in APPS}
    args = app_args(models, names)
    try:
        # All at once (search and rag look their backends up by name at first use).
        serve.run_many(
            [
                serve.RunTarget(build(args[app]), name=names[app], route_prefix=f"/{names[app]}")
                for app, build in builders.items()
            ]
        )
        deployed = DeployedApps(base, names)
        r = httpx.post(
            deployed.url("search", "/v1/documents"), json={"documents": [SEED_DOCUMENT]}, timeout=60
        )
        r.raise_for_status()
        yield deployed
    finally:
        for app in builders:
            serve.delete(names[app], _blocking=False)
        deadline = time.monotonic() + 120
        while set(names.values()) & set(serve.status().applications) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.5)


def replica_actors(deployed: DeployedApps) -> dict[str, tuple[str, int]]:
    """Live Serve replica actors of these apps: actor name -> (actor id, restarts so far).

    Read from the GCS (no dashboard needed). A replica that crashed and was replaced shows
    up under a new name or id, or with a higher restart count.
    """
    from ray._private.state import actors

    prefixes = tuple(f"SERVE_REPLICA::{name}#" for name in deployed.names.values())
    live: dict[str, tuple[str, int]] = {}
    for actor_id, info in actors().items():
        name = info.get("Name") or ""
        if name.startswith(prefixes) and info.get("State") == "ALIVE":
            live[name] = (actor_id, int(info.get("NumRestarts", 0)))
    return live


def assert_all_healthy(deployed: DeployedApps, replicas_before: dict[str, tuple[str, int]]) -> None:
    """Every app answers /healthz and a good request with 200, on the same replicas as before."""
    with httpx.Client(timeout=120) as client:
        for app in APPS:
            health = client.get(deployed.url(app, "/healthz"))
            assert health.status_code == 200, f"{app} /healthz: {health.status_code}"
            path, body = GOOD_REQUESTS[app]
            good = client.post(deployed.url(app, path), json=body)
            assert good.status_code == 200, f"{app} good request: {good.status_code} {good.text}"
    after = replica_actors(deployed)
    assert after == replicas_before, (
        "a replica was restarted or replaced (crash?):\n"
        f"before {sorted(replicas_before.items())}\nafter  {sorted(after.items())}"
    )
