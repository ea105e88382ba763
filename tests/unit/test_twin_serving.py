"""Re-timing a profile's embedder passes through a serving replica (carpool_twin.serving),
against a fake embed pipeline that runs passes at a known price and keeps /v1/stats as the
replica does (means and counts)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

from carpool_twin.profile import ProfileError, validate_profile
from carpool_twin.serving import retime_profile, token_rows


def quiet_ms(rows: int, length: int) -> float:
    return 2.0 + 0.05 * rows * length


class FakeEmbedPipeline:
    """Answers /embed/v1/embeddings with passes of at most ``cap`` padded tokens, each costing
    ``1.3 x quiet + 4 ms``, and /embed/v1/stats with the replica's running means."""

    def __init__(self, cap: int = 10_000, stats_keys: bool = True, max_length: int = 512) -> None:
        self.cap, self.stats_keys, self.max_length = cap, stats_keys, max_length
        self.passes = 0
        self.padded = 0
        self.forward_ms = 0.0
        self.bodies: list[Any] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/embed/v1/stats":
            if not self.stats_keys:
                return httpx.Response(200, json={"passes": self.passes})
            mean = self.forward_ms / self.passes if self.passes else 0.0
            return httpx.Response(
                200,
                json={
                    "forward_passes": self.passes,
                    "padded_tokens": self.padded,
                    "mean_forward_ms": mean,
                },
            )
        assert request.url.path == "/embed/v1/embeddings"
        inputs = json.loads(request.content)["input"]
        self.bodies.append(inputs)
        length = min(self.max_length, max(len(ids) for ids in inputs))
        per_pass = max(1, self.cap // length)
        for start in range(0, len(inputs), per_pass):
            rows = len(inputs[start : start + per_pass])
            self.passes += 1
            self.padded += rows * length
            self.forward_ms += 1.3 * quiet_ms(rows, length) + 4.0
        return httpx.Response(200, json={"data": []})


def _measured(role: str, name: str, kind: str) -> dict[str, Any]:
    """A profile entry's identity and provenance, without its cost sections."""
    return {
        "role": role,
        "name": name,
        "kind": kind,
        "device": "cpu",
        "dtype": "float32",
        "threads": 1,
        "source": "measured",
        "command": "python -m carpool_twin profile",
        "measured_at": "2026-11-26T00:00:00+00:00",
    }


def _profile() -> dict[str, Any]:
    grid = [(1, 16), (4, 64), (16, 128), (64, 64)]
    points = [
        {
            "rows": r,
            "length": n,
            "padded_tokens": r * n,
            "attention": r * n * n,
            "ms": quiet_ms(r, n),
        }
        for r, n in grid
    ]
    fit = {"coef": {"const": 2.0, "padded_tokens": 0.05}, "rel_rmse": 0.0}
    encoder = _measured("embedder", "bge", "encoder")
    encoder["pass"] = {"points": points, "fits": {"line": fit}, "use": "line"}
    generator = _measured("small", "smollm", "generator")
    generator["kv_bytes_per_token"] = 1024
    for section, feature in (("prefill", "tokens"), ("decode", "batch")):
        line = {"coef": {"const": 1, feature: 0.1}}
        generator[section] = {"points": [], "fits": {"line": line}, "use": "line"}
    return {
        "schema_version": 1,
        "kind": "carpool-cost-profile",
        "name": "cpu-test",
        "created": "2026-11-26T00:00:00+00:00",
        "hardware": {},
        "software": {},
        "models": [encoder, generator],
    }


def _retime(fake: FakeEmbedPipeline, min_time_s: float = 1.0, command: str = "cmd") -> dict:
    """The test profile's embedder re-timed against ``fake``."""
    return retime_profile(
        _profile(),
        "http://x/embed",
        ["embedder"],
        command,
        min_time_s=min_time_s,
        transport=httpx.MockTransport(fake.handler),
    )


def test_token_rows_have_the_exact_shape() -> None:
    rows = token_rows(3, 17)
    assert [len(r) for r in rows] == [17, 17, 17]
    assert len({tuple(r) for r in rows}) == 3


def test_passes_are_priced_at_what_the_replica_ran() -> None:
    # Splits the 64 x 64 request into two passes, and cuts the 128-id inputs to 100.
    fake = FakeEmbedPipeline(cap=2048, max_length=100)
    out = _retime(fake, min_time_s=0.0, command="python -m carpool_twin serving-profile ...")
    validate_profile(out)
    entry = out["models"][0]
    by_shape = {(p["length"], p["padded_tokens"]): p for p in entry["pass"]["points"]}
    for r, n in [(1, 16), (4, 64)]:
        point = by_shape[(n, r * n)]
        assert point["ms"] == pytest.approx(1.3 * quiet_ms(r, n) + 4.0, rel=1e-3)
        assert point["quiet_ms"] == pytest.approx(quiet_ms(r, n))
    # 16 inputs of 128 ids ran as 16 x 100: the point is the pass the replica ran.
    cut = by_shape[(100, 1600)]
    assert cut["sent_length"] == 128 and cut["rows"] == 16
    assert cut["attention"] == 1600 * 100
    assert cut["ms"] == pytest.approx(1.3 * quiet_ms(16, 100) + 4.0, rel=1e-3)
    # The replica split 64 rows of 64 into passes of 32: the point is the pass it ran.
    split = by_shape[(64, 32 * 64)]
    assert split["rows"] == 32 and split["passes"] == 2 * split["requests"]
    assert split["ms"] == pytest.approx(1.3 * quiet_ms(32, 64) + 4.0, rel=1e-3)
    # The line is refitted on the serving points; the quiet ones are kept beside them.
    assert entry["pass"]["fits"]["line"]["coef"]["padded_tokens"] == pytest.approx(0.065, rel=0.01)
    assert [p["ms"] for p in entry["pass"]["quiet_points"]] == [
        quiet_ms(r, n) for r, n in [(1, 16), (4, 64), (16, 128), (64, 64)]
    ]
    assert entry["serving"]["url"] == "http://x/embed"
    assert entry["command"].startswith("python -m carpool_twin serving-profile")
    # The generator entry is left as it was, and every request was one shape of the grid.
    assert out["models"][1] == _profile()["models"][1]
    assert all(len({len(ids) for ids in body}) == 1 for body in fake.bodies)


def test_repeats_follow_the_time_asked_for() -> None:
    fake = FakeEmbedPipeline()
    _retime(fake, min_time_s=0.1)
    sent = [(len(b), len(b[0])) for b in fake.bodies[1:]]  # the first is the warm-up
    for r, n in [(1, 16), (4, 64), (16, 128), (64, 64)]:
        expected = max(2, min(20, math.ceil(100 / quiet_ms(r, n))))
        assert sent.count((r, n)) == expected


def test_refusals_name_what_to_change() -> None:
    fake = FakeEmbedPipeline()
    transport = httpx.MockTransport(fake.handler)
    with pytest.raises(ProfileError, match="only embedders"):
        retime_profile(_profile(), "http://x/embed", ["small"], "cmd", transport=transport)
    with pytest.raises(ProfileError, match=r"roles \['ranker'\] not in the profile"):
        retime_profile(_profile(), "http://x/embed", ["ranker"], "cmd", transport=transport)
    with pytest.raises(ProfileError, match="point --url at a carpool embed pipeline"):
        _retime(FakeEmbedPipeline(stats_keys=False))
