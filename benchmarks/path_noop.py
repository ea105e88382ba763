"""serve-noop: Ray Serve's floor for one request, in carpool's shape, with no model.

Ray's proxy (or HAProxy) -> a FastAPI ingress deployment -> one deployment that returns a
constant. Its Serve options are carpool's embed app's (the harness passes them in ``args``,
read from serve.yaml), so what ``python -m benchmarks path`` measures here is what Serve
itself costs per request with that shape; carpool's figure minus this one is carpool's own
code. Lives under benchmarks/, never in the product packages.

No ``from __future__ import annotations``: Serve rebuilds an ingress class's FastAPI routes
elsewhere, where string annotations no longer resolve (pipelines/embed.py, same reason).
"""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

INGRESS = "noop_ingress"
MODEL = "noop_model"  # benchmarks.proc_cpu counts it as the model
# An answer the size of a one-text embeddings response with base64 vectors, without work.
ANSWER = (
    b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":"AAAA"}],'
    b'"model":"noop","usage":{"prompt_tokens":2,"total_tokens":2}}'
)

api = FastAPI(title="serve-noop")


class NoopModel:
    """Stands where carpool's embedder stands; returns at once."""

    async def embed(self, texts: Any) -> bytes:
        return ANSWER


@serve.ingress(api)
class NoopIngress:
    """Reads the JSON body (as any ingress must) and awaits one call to the model stand-in."""

    def __init__(self, model: DeploymentHandle) -> None:
        self.model = model

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        body = await request.json()
        answer = await self.model.embed.remote(body.get("input"))
        return Response(answer, media_type="application/json")

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "noop", "object": "model"}]}


def build_noop_app(args: dict[str, Any] | None = None) -> Application:
    """``args``: ``{"ingress": <Serve options>, "model": <Serve options>}`` (names are set
    here); each defaults to Serve's own when absent."""
    args = args or {}
    model = serve.deployment(NoopModel).options(**{**args.get("model", {}), "name": MODEL})
    ingress = serve.deployment(NoopIngress).options(**{**args.get("ingress", {}), "name": INGRESS})
    return ingress.bind(model.bind())
