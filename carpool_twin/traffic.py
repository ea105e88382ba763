"""Traffic for the twin and the planner: a mix of request kinds at rates, or a trace.

A mix names a rate (requests/s) per kind, each with a length shape: log-normal token lengths
clipped to a range, the shape carpool's own benchmarks use (``embed-mixed``: 1-8 texts of
median 32 tokens; ``rank-mixed``: 5-50 documents of median 48 tokens plus a 10-token query;
``generate-mixed``: prompts of median 64 tokens, ``max_tokens`` log-uniform 8-256). A trace
is a CSV in the Azure LLM inference trace's columns (``TIMESTAMP, ContextTokens,
GeneratedTokens``), replayed as generation requests at its own times (optionally rescaled
to a rate). Both become ``(arrival_s, SimRequest)`` lists with ``arrivals()``.

Written as ``"embed=40,rank=2,generate=5"`` (Poisson rates with the default shapes), a YAML or
JSON file ``{embed: {rate: 40, texts: [1, 8], median: 32}, generate: {rate: 5, model: auto,
output: 0.6}}``, or ``trace:PATH.csv[@rate]``.
"""

from __future__ import annotations

import csv
import datetime
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carpool_twin.replicas import SimRequest
from carpool_twin.sim import poisson

KINDS = ("embed", "rank", "generate")


@dataclass
class KindMix:
    """One kind's rate and shape."""

    rate: float
    items: tuple[int, int] = (1, 8)  # texts (embed) or documents (rank) per request
    median: float = 32.0  # tokens per item (embed, rank document) or prompt (generate)
    sigma: float = 1.0
    low: int = 4
    high: int = 512
    query: int = 10  # rank: query tokens, added to every pair
    max_tokens: tuple[int, int] = (8, 256)  # generate: log-uniform
    output: float = 0.6  # generate: share of max_tokens really produced (EOS earlier)
    escalate: float = 0.1  # generate: share of small answers a cascade finds unsure
    model: str = "small"  # generate: small | large | auto
    max_length: int = 512  # an encoder's truncation

    def draw(self, kind: str, rng: random.Random) -> SimRequest:
        def length() -> int:
            value = rng.lognormvariate(math.log(self.median), self.sigma)
            return int(min(self.high, max(self.low, round(value))))

        if kind == "generate":
            lo, hi = self.max_tokens
            m = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            out = max(1, round(m * self.output))
            unsure = rng.random() < self.escalate
            return SimRequest(
                "generate",
                prompt_tokens=length(),
                max_tokens=m,
                output_tokens=out,
                model=self.model,
                small_mean_logprob=-5.0 if unsure else -0.3,
            )
        n = rng.randint(*self.items)
        extra = self.query if kind == "rank" else 0
        lengths = tuple(min(self.max_length, length() + extra) for _ in range(n))
        return SimRequest(kind, lengths=lengths)


DEFAULTS: dict[str, dict[str, Any]] = {
    "embed": {"items": (1, 8), "median": 32, "max_length": 256},
    "rank": {"items": (5, 50), "median": 48, "low": 8, "query": 10},
    "generate": {"median": 64, "model": "auto"},
}


@dataclass
class Traffic:
    """Kinds at rates, or a trace's generation requests at their own times."""

    kinds: dict[str, KindMix] = field(default_factory=dict)
    trace: list[tuple[float, SimRequest]] | None = None
    source: str = ""
    # arrivals() by (duration, seed): the planner simulates one traffic dozens of times, and
    # drawing its lengths again each time was a fifth of a projection's run time.
    _drawn: dict[tuple[float, int], dict[str, list[tuple[float, SimRequest]]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def scaled(self, factor: float) -> Traffic:
        kinds = {k: KindMix(**{**vars(m), "rate": m.rate * factor}) for k, m in self.kinds.items()}
        trace = None if self.trace is None else [(t / factor, r) for t, r in self.trace]
        return Traffic(kinds, trace, f"{self.source} x{factor:g}")

    def arrivals(
        self, duration_s: float, seed: int = 0
    ) -> dict[str, list[tuple[float, SimRequest]]]:
        """Per kind, ``(time, request)`` over ``duration_s`` (a trace: its first duration_s).

        The same lists for the same arguments (the twin reads requests, never changes them).
        """
        key = (duration_s, seed)
        if key in self._drawn:
            return {k: list(v) for k, v in self._drawn[key].items()}
        out: dict[str, list[tuple[float, SimRequest]]] = {}
        for i, (kind, mix) in enumerate(sorted(self.kinds.items())):
            rng = random.Random(seed * 1000 + i)
            out[kind] = [(t, mix.draw(kind, rng)) for t in poisson(mix.rate, duration_s, rng)]
        if self.trace is not None:
            out["generate"] = [(t, r) for t, r in self.trace if t < duration_s]
        self._drawn[key] = out
        return {k: list(v) for k, v in out.items()}

    def rates(self) -> dict[str, float]:
        rates = {k: m.rate for k, m in self.kinds.items()}
        if self.trace:
            span = max(self.trace[-1][0], 1e-9)
            rates["generate"] = len(self.trace) / span
        return rates


def parse_traffic(text: str) -> Traffic:
    """``embed=40,rank=2``, a YAML/JSON mix file, or ``trace:PATH.csv[@rate]``."""
    if text.startswith("trace:"):
        path, _, rate = text[len("trace:") :].partition("@")
        return load_trace(path, float(rate) if rate else None)
    if Path(text).is_file():
        import yaml

        doc = yaml.safe_load(Path(text).read_text()) or {}
        return mix_from_mapping(doc, text)
    doc: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, rate = part.partition("=")
        if not sep:
            raise ValueError(f"traffic {part!r}: write KIND=RATE, e.g. embed=40 (requests/s)")
        doc[kind.strip()] = {"rate": float(rate)}
    return mix_from_mapping(doc, text)


def mix_from_mapping(doc: Mapping[str, Any], source: str = "") -> Traffic:
    unknown = set(doc) - set(KINDS)
    if unknown:
        raise ValueError(f"traffic names {sorted(unknown)}; kinds are {list(KINDS)}")
    kinds: dict[str, KindMix] = {}
    for kind, body in doc.items():
        body = dict(body or {})
        if "rate" not in body or float(body["rate"]) <= 0:
            raise ValueError(f"traffic {kind}: give a rate > 0 in requests/s")
        fields = {**DEFAULTS[kind], **body}
        for key in ("items", "max_tokens"):
            if key in fields:
                fields[key] = tuple(fields[key])
        kinds[kind] = KindMix(**fields)
    return Traffic(kinds, None, source)


def load_trace(path: str, rate: float | None = None, model: str = "auto") -> Traffic:
    """An Azure-format CSV as generation requests (times from its first row), optionally
    compressed or stretched in time to ``rate`` requests/s."""
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"trace {path} lacks columns {sorted(missing)}; an Azure-format CSV")
        for row in reader:
            stamp = datetime.datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
            rows.append((stamp.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    rows.sort()
    t0 = rows[0][0]
    span = max(rows[-1][0] - t0, 1e-9)
    factor = 1.0 if rate is None else (len(rows) / span) / rate
    trace = [
        (
            (t - t0) * factor,
            SimRequest(
                "generate",
                prompt_tokens=max(1, c),
                max_tokens=max(1, g),
                output_tokens=max(1, g),
                model=model,
            ),
        )
        for t, c, g in rows
    ]
    return Traffic({}, trace, f"trace:{path}" + (f"@{rate:g}" if rate else ""))
