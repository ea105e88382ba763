"""Which ``/v1`` requests HAProxy may send straight to a pipeline's own prefix.

The OpenAI app (``/v1``) owns no model: a request there is parsed by its ingress, routed by
``model`` and sent on with a Ray call to the pipeline that serves that model, which answers
it with the same handler as at its own prefix. When the body names a model only one pipeline
serves, HAProxy can make that choice itself, before any Python runs: ``/v1/embeddings``
naming the embed app's model goes to ``/embed/v1/embeddings`` (with ``direct_ingress``, the
embedder replica), ``/v1/completions`` and ``/v1/chat/completions`` naming a generator tier
go to ``/generate/v1/...`` (with ``direct_streaming``, the small replica, with the router in
it). One process and one Ray hop fewer per request; the answer is the target app's, as it
would have been through ``/v1``.

What goes through ``/v1`` as before: an omitted ``model`` (the endpoint's default applies
there), a model no route names (``rag``, a typo: ``/v1`` answers, or says where it is
served), ``/v1/rerank`` (the rank app has its own ingress: no hop to save), and everything
when HAProxy is off (``RAY_SERVE_ENABLE_HA_PROXY=0``).

``python -m pipelines.direct_routes serve.yaml`` prints the routes as the JSON that
``python -m carpool.haproxy env --direct-routes`` takes (``make serve``, cluster.yaml).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from carpool.haproxy import DirectRoute, dump_routes
from pipelines.embed import EmbedArgs, served_model_name
from pipelines.generate_handler import GenerateArgs, model_aliases
from pipelines.openai_api import ENDPOINT_PIPELINES, OpenAIArgs

# The builders each kind's app is deployed with (import_path's module).
OPENAI_MODULE = "pipelines.openai_api"
PIPELINE_MODULES = {"embed": "pipelines.embed", "generate": "pipelines.generate"}
# Endpoints whose pipeline is picked by model name alone, so a name match is the same choice
# the OpenAI app makes (rerank is left out: its app's own ingress is the same one hop).
ROUTED_ENDPOINTS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions")


def _module(app: dict[str, Any]) -> str:
    return str(app.get("import_path", "")).split(":", 1)[0]


def _prefix(app: dict[str, Any]) -> str | None:
    """The app's route prefix without a trailing slash ("" for "/"); None: no HTTP."""
    prefix = app.get("route_prefix", "/")  # Serve's default for an app in a config
    if prefix is None:
        return None
    return str(prefix).rstrip("/")


def _served_names(kind: str, args: dict[str, Any]) -> list[str]:
    if kind == "embed":
        return [served_model_name(EmbedArgs.model_validate(args))]
    return sorted(model_aliases(GenerateArgs.model_validate(args)))


def direct_routes(applications: Sequence[dict[str, Any]]) -> list[DirectRoute]:
    """The routes for a serve config's ``applications``: for each OpenAI app, each routed
    endpoint whose pipeline app is in the same config, at its own prefix.

    An app whose args do not validate is left out (its deploy will say why); pure otherwise.
    """
    by_name = {str(app.get("name")): app for app in applications}
    routes: list[DirectRoute] = []
    for front in applications:
        if _module(front) != OPENAI_MODULE:
            continue
        base = _prefix(front)
        if base is None:
            continue
        served_apps = OpenAIArgs.model_validate(front.get("args") or {}).apps()
        for endpoint in ROUTED_ENDPOINTS:
            kind = ENDPOINT_PIPELINES[endpoint][0]
            target = by_name.get(served_apps.get(kind, ""))
            if target is None or _module(target) != PIPELINE_MODULES[kind]:
                continue
            prefix = _prefix(target)
            if not prefix or prefix == base:
                continue  # no HTTP of its own, or the same path: nothing to route around
            try:
                names = _served_names(kind, target.get("args") or {})
            except ValidationError as exc:
                print(f"direct routes: {target.get('name')!r} left out: {exc}", file=sys.stderr)
                continue
            routes.append(DirectRoute(base + endpoint, prefix + endpoint, tuple(names)))
    return routes


def routes_of_file(path: str | Path) -> list[DirectRoute]:
    """The routes of a serve config file (``serve run``'s format)."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    return direct_routes(config.get("applications") or [])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.direct_routes", description=__doc__)
    parser.add_argument("config", help="a serve config (serve.yaml, serve-gpu.yaml)")
    args = parser.parse_args(argv)
    print(dump_routes(routes_of_file(args.config)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
