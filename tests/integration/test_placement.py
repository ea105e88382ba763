"""Placement under Serve and HAProxy: which of small's replicas a request reaches.

Two replicas of a tiny continuous-engine generator serving ``/generate`` themselves
(``direct_streaming``), with carpool's router (``placement.policy: cost``) and with
HAProxy's ``leastconn``. The engines' own counters say where a prompt's prefix was found
cached: with the router every repeat of a prompt lands where its prefix is (half of all
prompt tokens sent twice); by connections alone, one-at-a-time sends go to either idle
replica and a repeat finds its prefix only by chance.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from pipelines.generate import build_generate_app

PREFIX = "/it-placement"
CONTEXT = 4096
# Long enough to span many of the router's 64-character blocks and the engine's prefix blocks.
# An odd count, so that one-at-a-time sends alternating between two idle replicas put each
# prompt's repeat on the other replica.
PROMPTS = [f"conversation {i}: " + "the carpool batch token and the river " * 30 for i in range(9)]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.factories import save_tiny_lm

    path = Path(tmp_path_factory.mktemp("placement")) / "tiny-lm"
    return save_tiny_lm(path, max_position_embeddings=CONTEXT)


def _deploy(serve_http: str, tiny_lm: str, policy: str) -> str:
    args: dict[str, Any] = {
        "small": {
            "source": {"model": tiny_lm, "served_model_name": "tiny-small"},
            "mode": "continuous",
            "replica": {"num_cpus": 0.1, "torch_threads": 1},
            "limits": {"max_seq_len": CONTEXT, "max_tokens_limit": 64, "default_max_tokens": 4},
            "batching": {"max_num_seqs": 4, "max_step_tokens": 512},
        },
        "large": None,
        "router": None,
        "direct_streaming": True,
        "placement": {"policy": policy, "stats_period_s": 0.2},
    }
    app = build_generate_app(args)
    app._bound_deployment = app._bound_deployment.options(num_replicas=2)
    serve.run(app, name="it-placement", route_prefix=PREFIX)
    return serve_http + PREFIX


def _cached_tokens() -> tuple[int, int]:
    """(prompt tokens, of which cached) summed over the app's small replicas' engines."""
    total = cached = 0
    replicas = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if "it-placement#small#" not in entry["name"]:
            continue
        actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
        stats = ray.get(actor.record_routing_stats.remote())
        total += stats["prompt_tokens"]
        cached += stats["prompt_cached_tokens"]
        replicas += 1
    assert replicas == 2
    return total, cached


def _repeat_prompts(url: str) -> float:
    """Sends every prompt twice, one request (and connection) at a time; the share of the
    prompt tokens the engines found cached."""
    before = _cached_tokens()
    for _ in range(2):
        for prompt in PROMPTS:
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": "small", "prompt": prompt, "max_tokens": 2, "temperature": 0},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            # Paced as a person types: each replica's report (every stats_period_s) has
            # replaced what the router booked for the request before.
            time.sleep(0.5)
    total, cached = (a - b for a, b in zip(_cached_tokens(), before, strict=True))
    return cached / total


@pytest.mark.skipif(
    os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "0", reason="HAProxy asks the router"
)
def test_the_router_sends_each_repeat_where_its_prefix_is(serve_http: str, tiny_lm: str) -> None:
    url = _deploy(serve_http, tiny_lm, "cost")
    try:
        # The first send of each prompt is new wherever it goes; every repeat finds its prefix
        # cached on the replica the router sent the first one to: the engine caches whole
        # 64-token blocks, 192 of a prompt's ~246 tokens, so at most ~0.39 of all tokens.
        assert _repeat_prompts(url) > 0.3
        # Bad JSON is still the replica's to refuse (the router places it by load alone).
        r = httpx.post(
            f"{url}/v1/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code in (400, 422), r.text
    finally:
        serve.delete("it-placement")


@pytest.mark.skipif(
    os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "0", reason="HAProxy's leastconn"
)
def test_by_connections_alone_repeats_miss_their_prefix(serve_http: str, tiny_lm: str) -> None:
    """The same traffic without the router: the control that shows the test above can fail."""
    url = _deploy(serve_http, tiny_lm, "leastconn")
    try:
        assert _repeat_prompts(url) < 0.2
    finally:
        serve.delete("it-placement")
