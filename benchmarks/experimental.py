"""``carpool-wide``: an experiment that carpool has since adopted, kept so old runs repeat.

It measured letting 64 collected ``@serve.batch`` batches into the executor instead of 4
(+5% saturation throughput, benchmarks/README.md). ``carpool.config.
COLLECTED_BATCHES_IN_FLIGHT`` is now 64, so the embedder here is carpool's own
``EmbeddingDeployment``; the one difference left is room for more ongoing requests per
replica. Not part of the standard suite; select it with ``--systems carpool,carpool-wide``.
"""

from typing import Any

from ray import serve
from ray.serve.deployment import Application

from deployments.embedder import EmbeddingDeployment
from pipelines.embed import EmbedArgs, EmbedIngress


def build_wide_embed_app(args: dict[str, Any] | None = None) -> Application:
    """``pipelines.embed.build_embed_app`` with at least 1024 ongoing requests per embedder."""
    parsed = EmbedArgs.model_validate(args or {})
    cfg = parsed.embedder
    options = cfg.replica.serve_options("embedder", cfg.batching)
    options["max_ongoing_requests"] = max(options["max_ongoing_requests"], 1024)
    embedder = (
        serve.deployment(EmbeddingDeployment)
        .options(**options, user_config=cfg.batching.model_dump())
        .bind(cfg.model_dump())
    )
    ingress = serve.deployment(EmbedIngress).options(
        **parsed.ingress.serve_options("embed_ingress")
    )
    return ingress.bind(embedder, parsed.model_dump())
