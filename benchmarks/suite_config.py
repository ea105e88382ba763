"""The standard suite's knobs (``python -m benchmarks suite``): one validated model.

The defaults are the published configuration; ``SuiteConfig.quick`` is a few-minute check of
the harness, not a figure to publish.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.deploy import Resources
from benchmarks.workloads import EmbedMix

Phase = Literal["saturation", "slo", "goodput", "light", "burst", "bulk", "model"]
DEFAULT_PHASES: list[Phase] = ["saturation", "slo", "goodput", "light", "burst", "bulk"]


class SuiteConfig(BaseModel):
    """Knobs of the standard suite; the defaults are the published configuration."""

    model_config = ConfigDict(extra="forbid")

    systems: list[str] = Field(default_factory=lambda: ["carpool", "naive", "serve-batch"])
    port: int = Field(default=8100, ge=1, le=65535)
    resources: Resources = Field(default_factory=Resources)
    carpool_batching: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of serve.yaml's embedder batching knobs."
    )
    variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Extra carpool deployments 'carpool-<name>' with these batching overrides "
        "(an 'ingress' key: the ingress's settings; a 'replica' key: the embedder replica's), "
        "measured in the same run (for tuning); the goodput phase measures them beside carpool.",
    )
    phases: list[Phase] = Field(
        default_factory=lambda: list(DEFAULT_PHASES),
        description="Which measured phases to run (the offline limit always runs; the SLO "
        "phase needs saturation's capacity, goodput too, light load naive's).",
    )
    seed: int = 0
    rounds: int = Field(default=3, ge=1, le=9, description="Paired rounds per comparison.")
    window_requests: int = Field(
        default=300, ge=10, description="A measurement window ends after this many requests..."
    )
    window_s: float = Field(default=60.0, gt=0, description="...or after this long.")
    pool_requests: int = Field(
        default=200,
        ge=10,
        description="Distinct embed requests in the load pool; each one's idle latency is "
        "measured, so keep it to a few hundred.",
    )
    idle_passes: int = Field(
        default=2, ge=1, description="Idle latency = the fastest of this many tries."
    )
    mix: EmbedMix = Field(default_factory=EmbedMix)
    slo_ms: float = Field(default=500.0, gt=0)
    slo_slowdown: float = Field(default=5.0, gt=1, description="p99 slowdown bound.")
    slo_rate: float | None = Field(
        default=None,
        gt=0,
        le=1000,
        description="Skip the SLO phase's search: every system's windows run at this offered "
        "rate (req/s), to compare tails at equal load. Its ratios are then items/s at one "
        "rate, not the largest rate each system holds: a diagnosis, not a headline.",
    )
    warmup_s: float = Field(default=4.0, ge=0)
    concurrency: int = Field(default=32, ge=1, description="Closed-loop clients (capacity).")
    search_requests: int = Field(
        default=150, ge=10, description="Requests per search probe (locating, not reported)."
    )
    search_max_s: float = Field(default=20.0, gt=0)
    max_probes: int = Field(default=4, ge=2, description="Probes per criterion and system.")
    offline_texts: int = Field(default=384, ge=16)
    offline_batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 16, 32, 64, 128])
    model_seconds: float = Field(default=300.0, ge=0, description="'model' phase: sim. seconds.")
    goodput_systems: list[str] = Field(
        default_factory=lambda: ["carpool"],
        description="Systems put through overload (naive queues everything: slow to drain).",
    )
    goodput_clients: list[int] = Field(default_factory=lambda: [32, 300])
    goodput_closed_s: float = Field(default=20.0, gt=0)
    goodput_loads: list[float] = Field(default_factory=lambda: [3.0, 10.0])
    goodput_open_s: float = Field(default=15.0, gt=0, description="Arrivals per overload run.")
    light_load: float = Field(default=0.5, gt=0, le=1, description="Share of naive's capacity.")
    rank_systems: list[str] = Field(default_factory=lambda: ["carpool-rank", "naive-rank"])
    burst_requests: int = Field(default=64, ge=1)
    bulk_clients: int = Field(default=2, ge=1)
    bulk_texts: int = Field(default=16, ge=1)
    bulk_words: int = Field(default=200, ge=1)
    bulk_s: float = Field(default=30.0, gt=0)
    client_timeout_s: float = Field(
        default=120.0, gt=0, description="Long, so a queued request is not counted lost."
    )
    connections: int = Field(default=512, ge=1, description="Room for 300 closed-loop clients.")
    progress: bool = True

    @classmethod
    def quick(cls, **overrides: Any) -> SuiteConfig:
        """A few-minute version for checking the harness, not for publishing."""
        values: dict[str, Any] = dict(
            rounds=2,
            window_requests=40,
            window_s=8.0,
            pool_requests=40,
            idle_passes=1,
            warmup_s=2.0,
            search_requests=40,
            search_max_s=6.0,
            max_probes=2,
            offline_texts=64,
            offline_batch_sizes=[1, 16, 64],
            model_seconds=30.0,
            goodput_clients=[32, 300],
            goodput_closed_s=4.0,
            goodput_open_s=3.0,
            burst_requests=16,
            bulk_s=5.0,
        )
        values.update(overrides)
        return cls(**values)
