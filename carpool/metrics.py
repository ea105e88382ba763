"""Exports what batching decided as Prometheus metrics through Ray.

Ray adds the ``ray_`` prefix and the ``application``/``deployment``/``replica`` labels, so
``carpool_forward_items`` is scraped as ``ray_carpool_forward_items_bucket{deployment=...}``.
Every name carries its unit. Ray is imported only when an exporter is built, inside a
replica, so the batching code stays testable without Ray.
"""

from __future__ import annotations

from typing import Any

from carpool.batching import PassRecord

# Bucket edges: items per pass up to the largest batches we allow; tokens in powers of two.
ITEM_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256]
TOKEN_BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]

# name -> (kind, description, buckets); the dashboards test checks panels against this list.
BATCH_METRICS: dict[str, tuple[str, str, list[float] | None]] = {
    "carpool_forward_passes_total": ("counter", "Forward passes run.", None),
    "carpool_forward_items": ("histogram", "Items (texts, pairs) per forward pass.", ITEM_BUCKETS),
    "carpool_forward_padded_tokens": (
        "histogram",
        "Padded tokens per forward pass (items x longest item).",
        TOKEN_BUCKETS,
    ),
    "carpool_real_tokens_total": ("counter", "Real (unpadded) tokens computed.", None),
    "carpool_padded_tokens_total": ("counter", "Padded tokens computed (real + padding).", None),
    "carpool_padding_waste_ratio": (
        "gauge",
        "Share of computed tokens that were padding, since the replica started.",
        None,
    ),
    "carpool_step_items": (
        "histogram",
        "Items the executor planned from when it chose a pass (the queue it saw).",
        ITEM_BUCKETS,
    ),
    "carpool_queue_wait_ms": (
        "histogram",
        "Time from a request's arrival at the replica to the start of its forward pass.",
        MS_BUCKETS,
    ),
    "carpool_forward_time_ms": ("histogram", "Wall time of one forward pass.", MS_BUCKETS),
    "carpool_dropped_items_total": (
        "counter",
        "Items never computed, by reason: refused (admission, 503), deadline (504 at admission "
        "or expired while queued), cancelled (the client left).",
        None,
    ),
}
# Counters that carry a reason label besides the model.
_REASON_METRICS = {"carpool_dropped_items_total"}


class RayBatchMetrics:
    """A ``PassListener`` that records every forward pass in Ray's metrics."""

    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        self._tags = {"model": model}
        self._real = 0
        self._padded = 0
        made: dict[str, Any] = {}
        for name, (kind, description, buckets) in BATCH_METRICS.items():
            if name in _REASON_METRICS:
                made[name] = metrics.Counter(
                    name, description=description, tag_keys=("model", "reason")
                )
            elif kind == "counter":
                made[name] = metrics.Counter(name, description=description, tag_keys=("model",))
            elif kind == "gauge":
                made[name] = metrics.Gauge(name, description=description, tag_keys=("model",))
            else:
                made[name] = metrics.Histogram(
                    name, description=description, boundaries=buckets, tag_keys=("model",)
                )
        for metric in made.values():
            metric.set_default_tags(dict(self._tags))  # Serve mutates the dict it gets
        self._m = made

    def on_pass(self, record: PassRecord) -> None:
        m = self._m
        m["carpool_forward_passes_total"].inc()
        m["carpool_forward_items"].observe(record.items)
        m["carpool_forward_padded_tokens"].observe(record.padded_tokens)
        m["carpool_real_tokens_total"].inc(record.real_tokens)
        m["carpool_padded_tokens_total"].inc(record.padded_tokens)
        m["carpool_step_items"].observe(record.step_items)
        m["carpool_forward_time_ms"].observe(record.forward_ms)
        for wait in record.queue_wait_ms:
            m["carpool_queue_wait_ms"].observe(wait)
        self._real += record.real_tokens
        self._padded += record.padded_tokens
        if self._padded:
            m["carpool_padding_waste_ratio"].set(1 - self._real / self._padded)

    def on_drop(self, reason: str, items: int) -> None:
        if items > 0:
            self._m["carpool_dropped_items_total"].inc(items, tags={"reason": reason})
