"""Ray metrics of a generator replica: an ``EngineListener`` that records steps and finishes.

Every name carries the ``carpool_generator_`` prefix and its unit; Ray adds ``ray_`` and the
``application``/``deployment``/``replica`` labels. Ray is imported only when the exporter is
built, inside a replica. It is called on the engine thread.
"""

from __future__ import annotations

from typing import Any

from carpool.generation.sequence import GenSequence, StepRecord

SEQ_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256]
TOKEN_BUCKETS = [1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 120000]

# name -> (kind, description, buckets); dashboards can check their queries against this.
GENERATOR_METRICS: dict[str, tuple[str, str, list[float] | None]] = {
    "carpool_generator_running_seqs": (
        "gauge",
        "Sequences holding a KV slot (decoding or prefilling) after the last step.",
        None,
    ),
    "carpool_generator_waiting_seqs": ("gauge", "Requests queued for a KV slot.", None),
    "carpool_generator_step_tokens": (
        "histogram",
        "Tokens computed per engine step (decode tokens + padded prefill tokens).",
        TOKEN_BUCKETS,
    ),
    "carpool_generator_decode_batch_seqs": (
        "histogram",
        "Sequences decoded together in one step.",
        SEQ_BUCKETS,
    ),
    "carpool_generator_prefill_time_ms": (
        "histogram",
        "Wall time of a step's prefill pass.",
        MS_BUCKETS,
    ),
    "carpool_generator_decode_time_ms": (
        "histogram",
        "Wall time of a step's decode pass.",
        MS_BUCKETS,
    ),
    "carpool_generator_time_to_first_token_ms": (
        "histogram",
        "From arrival at the replica to the first generated token.",
        MS_BUCKETS,
    ),
    "carpool_generator_time_per_output_token_ms": (
        "histogram",
        "Mean time between a sequence's tokens after the first.",
        MS_BUCKETS,
    ),
    "carpool_generator_request_latency_ms": (
        "histogram",
        "From arrival at the replica to the last token of a sequence.",
        MS_BUCKETS,
    ),
    "carpool_generator_kv_blocks_used": (
        "gauge",
        "KV cache blocks holding tokens of running sequences.",
        None,
    ),
    "carpool_generator_kv_blocks_total": (
        "gauge",
        "KV cache blocks the replica may allocate (max_num_seqs x max_seq_len / block).",
        None,
    ),
    "carpool_generator_kv_cache_bytes": ("gauge", "KV cache memory allocated now.", None),
    "carpool_generator_prompt_tokens_total": ("counter", "Prompt tokens prefilled.", None),
    "carpool_generator_output_tokens_total": ("counter", "Tokens generated.", None),
    "carpool_generator_sequences_finished_total": (
        "counter",
        "Sequences that ended, by finish_reason (stop, length, cancelled, timeout, error).",
        None,
    ),
}

TAG_KEYS = ("model",)
FINISH_TAG_KEYS = ("model", "finish_reason")


class RayGeneratorMetrics:
    """Records engine steps and finished sequences in Ray's metrics."""

    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        self._model = model
        made: dict[str, Any] = {}
        for name, (kind, description, buckets) in GENERATOR_METRICS.items():
            keys = FINISH_TAG_KEYS if name.endswith("sequences_finished_total") else TAG_KEYS
            if kind == "counter":
                made[name] = metrics.Counter(name, description=description, tag_keys=keys)
            elif kind == "gauge":
                made[name] = metrics.Gauge(name, description=description, tag_keys=keys)
            else:
                made[name] = metrics.Histogram(
                    name, description=description, boundaries=buckets, tag_keys=keys
                )
            made[name].set_default_tags({"model": model})  # a fresh dict each: Serve mutates it
        self._m = made

    def on_step(self, record: StepRecord) -> None:
        m = self._m
        m["carpool_generator_running_seqs"].set(record.running)
        m["carpool_generator_waiting_seqs"].set(record.waiting)
        m["carpool_generator_step_tokens"].observe(record.tokens)
        if record.decode_seqs:
            m["carpool_generator_decode_batch_seqs"].observe(record.decode_seqs)
            m["carpool_generator_decode_time_ms"].observe(record.decode_ms)
        if record.prefill_seqs:
            m["carpool_generator_prefill_time_ms"].observe(record.prefill_ms)
            m["carpool_generator_prompt_tokens_total"].inc(record.prefill_tokens)
        m["carpool_generator_kv_blocks_used"].set(record.kv_blocks_used)
        m["carpool_generator_kv_blocks_total"].set(record.kv_blocks_total)
        m["carpool_generator_kv_cache_bytes"].set(record.kv_bytes)

    def on_finish(self, seq: GenSequence) -> None:
        m = self._m
        m["carpool_generator_sequences_finished_total"].inc(
            tags={"finish_reason": seq.finish_reason or "unknown"}
        )
        if seq.output_ids:
            m["carpool_generator_output_tokens_total"].inc(len(seq.output_ids))
        if seq.first_token_at is not None:
            m["carpool_generator_time_to_first_token_ms"].observe(
                (seq.first_token_at - seq.arrival) * 1000
            )
            if seq.finished_at is not None and len(seq.output_ids) > 1:
                m["carpool_generator_time_per_output_token_ms"].observe(
                    (seq.finished_at - seq.first_token_at) * 1000 / (len(seq.output_ids) - 1)
                )
        if seq.finished_at is not None:
            m["carpool_generator_request_latency_ms"].observe(
                (seq.finished_at - seq.arrival) * 1000
            )
