"""Replay of the Azure LLM inference trace, scaled to this machine.

The trace (one hour of an LLM conversation service, ~5.5 requests/s with bursts, context
tokens mean 1155) comes from machines far larger than this one. A replay keeps its *shapes*,
the inter-arrival pattern and the length distribution, and scales both:

- time: a window of N consecutive requests is compressed (or stretched) so that it lasts
  ``duration_s`` and so arrives at the target mean rate; the factor is trace seconds per
  replay second;
- tokens: every length is multiplied by a constant factor and clipped to the workload's range.

Both factors go into every report, with the trace's attribution (``TRACE_ATTRIBUTION``).
"""

from __future__ import annotations

import csv
import random
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.workloads import (
    EmbedRequest,
    GenerateRequest,
    Request,
    Workload,
    synth_text,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
# Relative to the repository root: the trace lives beside the repo, not in it.
DEFAULT_TRACE = "../shared/traces/AzureLLMInferenceTrace_conv.csv"

TRACE_ATTRIBUTION = (
    "Azure LLM inference trace 2023 (conversation), from the Azure Public Dataset, licensed "
    'CC-BY 4.0. Patel et al., "Splitwise: Efficient generative LLM inference using phase '
    'splitting", ISCA 2024.'
)


def resolve_trace_path(path: str | Path = DEFAULT_TRACE) -> Path:
    """A relative path is taken from the repository root (so the default works from anywhere)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


@dataclass(frozen=True)
class TraceRow:
    t: float  # seconds since the trace's first request
    context_tokens: int
    generated_tokens: int


def _parse_timestamp(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than strptime's %f takes.
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def load_azure_trace(path: str | Path = DEFAULT_TRACE) -> list[TraceRow]:
    """Rows sorted by time, timestamps made relative to the first request."""
    resolved = resolve_trace_path(path)
    if not resolved.is_file():
        raise FileNotFoundError(
            f"trace {resolved} not found; pass --trace PATH (a CSV with TIMESTAMP, "
            "ContextTokens, GeneratedTokens)"
        )
    raw: list[tuple[float, int, int]] = []
    with open(resolved, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"trace {resolved} lacks columns {sorted(missing)}")
        for row in reader:
            raw.append(
                (
                    _parse_timestamp(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
    if not raw:
        raise ValueError(f"trace {resolved} has no rows")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow(t - t0, c, g) for t, c, g in raw]


class TraceScaling(BaseModel):
    """How a trace window becomes a replay on this machine."""

    model_config = ConfigDict(extra="forbid")

    rate: float = Field(gt=0, description="Target mean requests/s of the replay.")
    duration_s: float = Field(default=30.0, gt=0, description="Replay length in seconds.")
    start_s: float = Field(
        default=0.0, ge=0, description="Where the window starts, in trace seconds."
    )
    token_scale: float = Field(
        default=0.125,
        gt=0,
        le=1,
        description="Context tokens are multiplied by this (1/8 maps the trace's mean 1155 "
        "to ~144, inside an embedder's 4-512 range).",
    )
    generated_token_scale: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="Generated tokens are multiplied by this (max 1000 -> 250).",
    )
    min_tokens: int = Field(default=4, ge=1)
    max_tokens: int = Field(default=512, ge=1)
    min_generated: int = Field(default=8, ge=1)
    max_generated: int = Field(default=256, ge=1)


@dataclass
class ScaledTrace:
    """A trace window ready to replay, with the factors that made it."""

    arrivals: list[float]  # replay seconds from start
    context_tokens: list[int]  # scaled and clipped
    generated_tokens: list[int]
    time_factor: float  # trace seconds per replay second (> 1: compressed)
    window_start_s: float  # trace seconds
    window_end_s: float
    scaling: TraceScaling

    def describe(self) -> dict[str, Any]:
        ctx = self.context_tokens
        return {
            "requests": len(self.arrivals),
            "mean_rate_per_s": len(self.arrivals) / self.scaling.duration_s,
            "time_factor": self.time_factor,
            "window_s": [self.window_start_s, self.window_end_s],
            "token_scale": self.scaling.token_scale,
            "generated_token_scale": self.scaling.generated_token_scale,
            "context_tokens_mean": statistics.fmean(ctx),
            "context_tokens_p50": statistics.median(ctx),
            "context_tokens_max": max(ctx),
            "attribution": TRACE_ATTRIBUTION,
        }


def _clip(value: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(value))))


def scale_trace(rows: list[TraceRow], scaling: TraceScaling) -> ScaledTrace:
    """Takes ``rate * duration_s`` consecutive requests from ``start_s`` and fits them in time.

    The window runs from its first arrival to the arrival just after it, so it holds exactly
    N arrivals and replays at exactly the target mean rate; gaps keep their proportions.
    """
    n = max(1, round(scaling.rate * scaling.duration_s))
    first = next((i for i, r in enumerate(rows) if r.t >= scaling.start_s), len(rows))
    if first + n >= len(rows):
        raise ValueError(
            f"the trace has {len(rows) - first} requests after start_s={scaling.start_s:g} s, "
            f"the replay needs {n + 1} (rate {scaling.rate:g}/s x {scaling.duration_s:g} s); "
            "lower the rate or duration, or start earlier"
        )
    window = rows[first : first + n]
    t0, t_end = window[0].t, rows[first + n].t
    span = t_end - t0
    if span <= 0:
        raise ValueError("the trace window has zero length; pick another start_s")
    factor = span / scaling.duration_s
    return ScaledTrace(
        arrivals=[(r.t - t0) / factor for r in window],
        context_tokens=[
            _clip(r.context_tokens * scaling.token_scale, scaling.min_tokens, scaling.max_tokens)
            for r in window
        ],
        generated_tokens=[
            _clip(
                r.generated_tokens * scaling.generated_token_scale,
                scaling.min_generated,
                scaling.max_generated,
            )
            for r in window
        ],
        time_factor=factor,
        window_start_s=t0,
        window_end_s=t_end,
        scaling=scaling,
    )


def trace_workload(scaled: ScaledTrace, kind: str = "embed", seed: int = 0) -> Workload:
    """Requests for a scaled trace: one text of the scaled context length per request.

    The trace has no texts, so they are synthesised at the recorded (scaled) lengths. For
    generation, the prompt is the context and ``max_tokens`` the scaled generated length.
    """
    rng = random.Random(seed)
    requests: list[Request] = []
    for ctx, gen in zip(scaled.context_tokens, scaled.generated_tokens, strict=True):
        if kind == "embed":
            requests.append(EmbedRequest((synth_text(ctx, rng),), ctx))
        elif kind == "generate":
            requests.append(GenerateRequest(synth_text(ctx, rng), gen, ctx + gen))
        else:
            raise ValueError(f"trace replay makes 'embed' or 'generate' requests, not {kind!r}")
    return Workload(
        f"azure-trace-{kind}",
        requests,
        arrivals=list(scaled.arrivals),
        description={"trace": scaled.describe()},
    )
