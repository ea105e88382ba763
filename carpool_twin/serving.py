"""Re-times a profile's encoder passes in a running carpool replica, through its HTTP route.

A bare forward pass (``carpool_twin.measure``) is not what a serving replica pays: there the
pass also builds its tensors from the request's ids, runs in a worker thread beside the
replica's event loop (which shares the GIL with it between kernels) and shares the host with
Serve's proxy, the ingress and the client. On a 2-core machine a replica's passes took
1.13-1.45x their bare price (benchmarks/TWIN.md, "A pass costs more in a serving replica
than bare"). This command keeps the profile's
grid and measures each point as the replica runs it: one client sends ``rows`` inputs of
``length`` token ids each (the embeddings API takes ids), one request at a time, and the
replica's own pass totals (``/v1/stats``: passes, padded tokens, forward ms) give the
milliseconds of the passes it ran. Only passes the replica reports count, so a request the
replica split shows up as more, smaller passes, recorded as such.

Embedders only: the embed pipeline's ``/v1/embeddings`` is the route that takes token ids.
"""

from __future__ import annotations

import copy
import datetime
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from carpool_twin.measure import fit_encoder_section
from carpool_twin.profile import ProfileError

# The profile's quiet points stay in the entry under this key, for provenance and comparison.
QUIET_KEY = "quiet_points"
STATS_KEYS = ("forward_passes", "padded_tokens", "mean_forward_ms")
# Token ids sent: inside any encoder's vocabulary, clear of the special tokens at the start.
FIRST_ID, ID_SPAN = 1000, 1000


def token_rows(rows: int, length: int) -> list[list[int]]:
    """``rows`` inputs of exactly ``length`` ids; rows differ so no cache can answer one."""
    return [[FIRST_ID + (r * 7919 + i) % ID_SPAN for i in range(length)] for r in range(rows)]


def pass_totals(stats: Mapping[str, Any]) -> tuple[float, float, float]:
    """(passes, padded tokens, forward ms) so far; ``/v1/stats`` carries the mean, not the sum."""
    missing = [k for k in STATS_KEYS if k not in stats]
    if missing:
        raise ProfileError(
            f"the replica's /v1/stats lacks {missing}; point --url at a carpool embed pipeline "
            "(e.g. http://127.0.0.1:8000/embed)"
        )
    passes = float(stats["forward_passes"])
    return passes, float(stats["padded_tokens"]), passes * float(stats["mean_forward_ms"])


class ReplicaClient:
    """The embed pipeline at ``base`` (its route prefix): embeddings by ids, and its stats."""

    def __init__(
        self, base: str, timeout_s: float = 120.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.base = base.rstrip("/")
        self.http = httpx.Client(timeout=timeout_s, trust_env=False, transport=transport)

    def embed(self, inputs: list[list[int]]) -> None:
        resp = self.http.post(f"{self.base}/v1/embeddings", json={"input": inputs})
        if resp.status_code != 200:
            raise ProfileError(
                f"POST {self.base}/v1/embeddings answered {resp.status_code}: {resp.text[:300]}"
            )

    def totals(self) -> tuple[float, float, float]:
        resp = self.http.get(f"{self.base}/v1/stats")
        resp.raise_for_status()
        return pass_totals(resp.json())

    def close(self) -> None:
        self.http.close()


def time_point(
    client: ReplicaClient, rows: int, length: int, repeats: int
) -> dict[str, Any] | None:
    """The replica's mean pass for ``repeats`` requests of one shape, or None if it ran none.

    With one replica behind the route and nothing else sending, every pass between the two
    snapshots is one of ours."""
    inputs = token_rows(rows, length)
    p0, t0, ms0 = client.totals()
    for _ in range(repeats):
        client.embed(inputs)
    p1, t1, ms1 = client.totals()
    passes = p1 - p0
    if passes < 1:
        return None
    padded = (t1 - t0) / passes
    per_pass_rows = rows * repeats / passes
    # What the replica ran: a replica cuts inputs to its model's max_length (a 512-id input
    # reaches a 256-position model as 256), and splits a request it will not run whole.
    ran_length = padded / per_pass_rows
    return {
        "rows": round(per_pass_rows, 2),
        "length": round(ran_length, 1),
        "sent_length": length,
        "padded_tokens": round(padded, 1),
        "attention": round(padded * ran_length, 1),
        "ms": round((ms1 - ms0) / passes, 3),
        "requests": repeats,
        "passes": int(passes),
    }


def repeats_for(quiet_ms: float, min_time_s: float, most: int) -> int:
    """Enough requests of a shape to spend ``min_time_s`` on it, at least 2, at most ``most``."""
    return max(2, min(most, math.ceil(min_time_s * 1000 / max(quiet_ms, 1.0))))


def retime_entry(
    entry: Mapping[str, Any],
    client: ReplicaClient,
    url: str,
    command: str,
    min_time_s: float = 1.0,
    most_repeats: int = 20,
    log: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """``entry`` with its ``pass`` points re-timed in the replica at ``url`` (fits redone);
    the quiet points are kept under ``pass.quiet_points``."""
    if entry.get("kind") != "encoder":
        raise ProfileError(
            f"{entry.get('role')}: only embedders ('encoder') can be re-timed through serving; "
            f"this entry is {entry.get('kind')!r}"
        )
    quiet = entry["pass"]["points"]
    client.embed(token_rows(2, int(quiet[0]["length"])))  # the first request pays for set-up
    points = []
    for q in quiet:
        rows, length = int(q["rows"]), int(q["length"])
        point = time_point(
            client, rows, length, repeats_for(float(q["ms"]), min_time_s, most_repeats)
        )
        if point is None:
            log(f"{rows} x {length}: the replica reported no pass; left out")
            continue
        point["quiet_ms"] = q["ms"]
        log(
            f"{rows} x {length}: {point['ms']:.1f} ms a pass in serving, {q['ms']:.1f} quiet "
            f"({point['ms'] / q['ms']:.2f}x; {point['passes']} passes)"
        )
        points.append(point)
    if len(points) < 2:
        raise ProfileError(f"{entry.get('role')}: fewer than 2 points measured through {url}")
    points.sort(key=lambda p: p["padded_tokens"])
    section = fit_encoder_section(points)
    section[QUIET_KEY] = quiet
    out = copy.deepcopy(dict(entry))
    out["pass"] = section
    out["command"] = command
    out["measured_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out["serving"] = {
        "url": url,
        "method": "one client, one request a shape at a time; the replica's /v1/stats totals",
    }
    return out


def retime_profile(
    profile: Mapping[str, Any],
    url: str,
    roles: list[str],
    command: str,
    min_time_s: float = 1.0,
    log: Callable[[str], None] = lambda _m: None,
    transport: httpx.BaseTransport | None = None,
) -> dict[str, Any]:
    """``profile`` with the entries of ``roles`` re-timed through the embed route at ``url``."""
    found = {e.get("role") for e in profile["models"]}
    unknown = sorted(set(roles) - found)
    if unknown:
        raise ProfileError(f"roles {unknown} not in the profile; it has {sorted(found)}")
    out = copy.deepcopy(dict(profile))
    client = ReplicaClient(url, transport=transport)
    started = time.monotonic()
    try:
        out["models"] = [
            retime_entry(e, client, url, command, min_time_s, log=log)
            if e.get("role") in roles
            else e
            for e in profile["models"]
        ]
    finally:
        client.close()
    out["serving_profile"] = {
        "command": command,
        "url": url,
        "roles": roles,
        "seconds": round(time.monotonic() - started, 1),
    }
    return out
