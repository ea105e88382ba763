"""Open-loop arrival schedules: when each request is sent, independent of responses.

Open loop is what real traffic does (users do not wait for each other), so an overloaded
server shows growing queues instead of the load quietly backing off as it does under a
closed loop. Schedules are plain lists of offsets in seconds from the run's start, built
from a seeded RNG so runs repeat exactly.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ArrivalKind = Literal["poisson", "bursty", "closed", "replay"]


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson process at ``rate`` per second over ``[0, duration_s)``: exponential gaps."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def bursty_arrivals(
    mean_rate: float, on_s: float, off_s: float, duration_s: float, rng: random.Random
) -> list[float]:
    """On/off bursts: Poisson at ``mean_rate * (on_s + off_s) / on_s`` while on, none while off.

    The mean over whole cycles is ``mean_rate``, so a bursty run offers the same work as a
    Poisson run at that rate, only concentrated. Starts with an on period.
    """
    if on_s <= 0 or off_s < 0:
        raise ValueError(f"need on_s > 0 and off_s >= 0, got on_s={on_s!r} off_s={off_s!r}")
    peak = mean_rate * (on_s + off_s) / on_s
    times: list[float] = []
    start = 0.0
    while start < duration_s:
        end = min(start + on_s, duration_s)
        times.extend(start + t for t in poisson_arrivals(peak, end - start, rng))
        start += on_s + off_s
    return times


class ArrivalSpec(BaseModel):
    """How requests arrive in one run."""

    model_config = ConfigDict(extra="forbid")

    kind: ArrivalKind = Field(
        default="poisson",
        description="poisson / bursty (open loop at 'rate'), closed (fixed 'concurrency'), "
        "replay (the workload's own arrival times: a trace or a timed JSONL).",
    )
    rate: float | None = Field(default=None, gt=0, description="Mean requests/s (open loop).")
    duration_s: float = Field(default=15.0, gt=0, le=3600, description="Length of the run.")
    concurrency: int = Field(default=16, ge=1, le=4096, description="Closed-loop clients.")
    burst_on_s: float = Field(default=2.0, gt=0, description="Bursty: seconds on.")
    burst_off_s: float = Field(default=2.0, ge=0, description="Bursty: seconds off.")
    seed: int = Field(default=0, description="Seeds the arrival RNG.")

    @model_validator(mode="after")
    def _rate_for_open_loop(self) -> ArrivalSpec:
        if self.kind in ("poisson", "bursty") and self.rate is None:
            raise ValueError(f"arrival kind {self.kind!r} needs a rate (requests/s); set rate")
        return self

    def schedule(self) -> list[float]:
        """Arrival offsets for open-loop kinds (closed and replay have none of their own)."""
        if self.kind not in ("poisson", "bursty") or self.rate is None:
            raise ValueError(f"arrival kind {self.kind!r} has no schedule of its own")
        rng = random.Random(self.seed)
        if self.kind == "poisson":
            return poisson_arrivals(self.rate, self.duration_s, rng)
        return bursty_arrivals(self.rate, self.burst_on_s, self.burst_off_s, self.duration_s, rng)

    def label(self) -> str:
        if self.kind == "closed":
            return f"closed c={self.concurrency}"
        if self.kind == "replay":
            return "replay"
        if self.kind == "bursty":
            return f"bursty {self.rate:g}/s ({self.burst_on_s:g}s on/{self.burst_off_s:g}s off)"
        return f"poisson {self.rate:g}/s"
