"""The router's configuration: its policies by name, its lanes and its admission bounds.

Validated where the generate app starts (``pipelines.generate_handler``), and handed to
``router.core.RouterServer``; a renamed or moved field is refused with what to write instead.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from carpool.aging import DEFAULT_AGING_TOKENS_PER_S
from carpool.config import StrictModel
from router.lanes import Lane, LanePolicy


class LaneSpec(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    max_predicted_tokens: float | None = Field(
        default=None, gt=0, description="Upper bound of this lane; null for the last lane."
    )
    target: str | None = Field(
        default=None, description="Own generator deployment; null shares the chosen model's."
    )


class RouterConfig(StrictModel):
    """The router's policies, picked by name."""

    policy: Literal["threshold", "cascade", "learned_cascade"] = Field(
        default="learned_cascade",
        description="How `auto` picks: by predicted length/cues, small-first cascade, or a "
        "cascade that learns which prompts escalate and sends them straight to large.",
    )
    max_small_tokens: float = Field(default=128, gt=0, description="threshold: above -> large.")
    min_mean_logprob: float = Field(
        default=-1.2, le=0, description="cascade: escalate below this mean token logprob."
    )
    max_repetition: float = Field(default=0.3, ge=0, le=1, description="cascade: n-gram repeat.")
    escalate_on_length: bool = Field(default=True, description="cascade: escalate if cut off.")
    latency_target_ms: float = Field(
        default=30_000, gt=0, description="Overflow to small when large's backlog is longer."
    )
    lanes: list[LaneSpec] = Field(
        default_factory=lambda: [
            LaneSpec(name="short", max_predicted_tokens=64),
            LaneSpec(name="long"),
        ]
    )
    lanes_enabled: bool = Field(
        default=True, description="false: one FIFO lane (the benchmarks' baseline)."
    )
    max_in_flight_per_replica: dict[str, int] = Field(
        default_factory=dict,
        description="Requests a model may have in flight per live replica of it, from all "
        "replicas hosting the router (the generate ingress) together; more wait in lanes, "
        "shortest first. The cap follows the model's live replica count, so autoscaling adds "
        "room. A model not listed gets its deployment's max_ongoing_requests (Serve's own "
        "per-replica limit): a backlog then waits at the replicas, where autoscaling counts it.",
    )
    predictor_sync_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How often each replica hosting the router (the generate app's ingress) "
        "merges its length predictor's learning with the others'.",
    )
    aging_tokens_per_s: float = Field(
        default=DEFAULT_AGING_TOKENS_PER_S,
        gt=0,
        description="Lane aging: predicted tokens a waiting request gains per second "
        "(carpool.aging; ~5 for a CPU model decoding tens of tokens/s).",
    )
    max_queued_per_lane: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="Admission bound per lane: requests waiting in one lane (for one model) "
        "before new ones for it are refused with 503 + Retry-After. The batch tier may fill "
        "half of it.",
    )
    default_max_tokens: int = Field(default=256, ge=1, le=131_072)
    predictor_default_tokens: float = Field(default=48, ge=1)
    predictor_snapshot: str | None = Field(
        default=None,
        description="Where the merged length predictor's state persists, on the node of the "
        "actor that merges it (predictor_resources chooses that node).",
    )

    predictor_resources: dict[str, Annotated[float, Field(gt=0, le=1_000)]] | None = Field(
        default=None,
        max_length=16,
        description="Ray custom resources for the actor that merges the length predictors "
        "(one per generate app), e.g. {carpool_head_node: 0.01} to keep it on the head, "
        "which outlives worker nodes. Default: a 0.01 share of each custom resource the "
        "replica hosting the router asks for (the same node type, without taking a unit).",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_in_flight" in data:
            raise ValueError(
                "router.max_in_flight was replaced by max_in_flight_per_replica (requests per "
                "live replica of each model, so the cap grows as a model scales out); rename "
                "it, e.g. max_in_flight_per_replica: {small: 16, large: 16}"
            )
        for moved in ("num_replicas", "resources"):
            if isinstance(data, dict) and moved in data:
                raise ValueError(
                    f"router.{moved}: the router runs inside the generate app's ingress "
                    "replicas (no router deployment, no extra hop), so it has no replicas or "
                    f"resources of its own; remove router.{moved} and set the ingress's "
                    "(args.ingress.resources, or num_replicas of deployment generate_ingress "
                    "under deployments:)"
                )
        return data

    @model_validator(mode="after")
    def _lanes_ordered(self) -> RouterConfig:
        LanePolicy([Lane(s.name, s.max_predicted_tokens, s.target) for s in self.lanes])
        return self
