"""carpool with one change proposed for carpool itself, measured before anyone makes it.

``carpool-wide``: the embed pipeline exactly as ``pipelines.embed`` builds it, except that
the embedder's ``@serve.batch`` lets ``WIDE_CONCURRENT_BATCHES`` collected batches into the
executor instead of ``carpool.config.CONCURRENT_BATCHES`` (4). Ray 2.60 forms a new batch
every ``batch_wait_timeout_s`` whether or not the model is free, and extra batches wait on
the ``max_concurrent_batches`` semaphore; with 4, an executor step can merge only four
batches' worth of requests however many are waiting. Not part of the standard suite; select
it with ``--systems carpool,carpool-wide``.
"""

from typing import Any

from ray import serve
from ray.serve.deployment import Application

from carpool.batching import Job, batch_weight
from deployments.embedder import EmbeddingDeployment
from pipelines.embed import EmbedArgs, EmbedIngress

# Large enough that every batch Serve collects while a step runs reaches the executor; the
# executor still runs one step at a time, so this bounds nothing but waiting.
WIDE_CONCURRENT_BATCHES = 64


def _make_wide_collector() -> Any:
    # The function must be named like the attribute it is stored under (`_collect`): Serve
    # tells a method from a function by looking up `func.__name__` on the first argument.
    @serve.batch(
        max_batch_size=64 * 8192,  # replaced from config by _apply_collection()
        max_concurrent_batches=WIDE_CONCURRENT_BATCHES,
        batch_size_fn=batch_weight,
    )
    async def _collect(self: Any, jobs: list[Job]) -> list[Any]:
        return await self.executor.run(jobs)

    return _collect


class WideEmbeddingDeployment(EmbeddingDeployment):
    _collect = _make_wide_collector()


def build_wide_embed_app(args: dict[str, Any] | None = None) -> Application:
    """``pipelines.embed.build_embed_app`` with ``WideEmbeddingDeployment`` as the embedder."""
    parsed = EmbedArgs.model_validate(args or {})
    cfg = parsed.embedder
    options = cfg.replica.serve_options("embedder", cfg.batching)
    # The default max_ongoing_requests scales with CONCURRENT_BATCHES; keep room for more.
    options["max_ongoing_requests"] = max(options["max_ongoing_requests"], 1024)
    embedder = (
        serve.deployment(WideEmbeddingDeployment)
        .options(**options, user_config=cfg.batching.model_dump())
        .bind(cfg.model_dump())
    )
    ingress = serve.deployment(EmbedIngress).options(
        **parsed.ingress.serve_options("embed_ingress")
    )
    return ingress.bind(embedder, parsed.model_dump())
