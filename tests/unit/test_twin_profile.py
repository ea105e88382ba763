"""Cost profiles (carpool_twin): the fits recover known coefficients, the file round-trips and
enforces its schema version and provenance rules, and a tiny random model is profiled end to
end on CPU, in a process that cannot import Ray, FastAPI or pydantic."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from carpool_twin.profile import (
    SCHEMA_VERSION,
    ProfileError,
    find_entry,
    fit_line,
    fit_terms,
    load_profile,
    predict_ms,
    save_profile,
    validate_profile,
)

ROOT = Path(__file__).resolve().parents[2]


def test_line_recovers_known_coefficients() -> None:
    points = [{"padded_tokens": t, "ms": 3.0 + 0.02 * t} for t in (16, 64, 256, 1024, 4096)]
    fit = fit_line(points, "padded_tokens")
    assert fit["coef"]["const"] == pytest.approx(3.0, rel=1e-4)
    assert fit["coef"]["padded_tokens"] == pytest.approx(0.02, rel=1e-4)
    assert fit["rel_rmse"] < 1e-4
    assert predict_ms(fit, {"padded_tokens": 500}) == pytest.approx(13.0, rel=1e-4)


def test_terms_recover_three_coefficients_and_drop_a_negative_one() -> None:
    points = [
        {"batch": b, "kv_tokens": b * c, "ms": 5.0 + 0.4 * b + 0.001 * b * c}
        for b in (1, 4, 16, 64)
        for c in (128, 1024)
    ]
    fit = fit_terms(points, ["batch", "kv_tokens"])
    assert fit["coef"] == pytest.approx({"const": 5.0, "batch": 0.4, "kv_tokens": 0.001}, rel=1e-3)
    # A term that only fits noise with a negative sign is dropped, never kept below zero.
    falling = [{"x": x, "y": x, "ms": 10.0 + 2 * x - 0.5 * (x % 3)} for x in range(1, 10)]
    for p in falling:
        p["y"] = p["x"] % 3
    fit = fit_terms(falling, ["x", "y"])
    assert fit["coef"]["y"] == 0.0
    assert fit["coef"]["x"] > 0


def test_fit_refuses_too_few_points() -> None:
    with pytest.raises(ProfileError, match="measure more sizes"):
        fit_terms([{"a": 1, "b": 2, "ms": 1.0}], ["a", "b"])


def _entry(**overrides: Any) -> dict[str, Any]:
    pts = [{"padded_tokens": t, "rows": 1, "ms": 1 + 0.01 * t} for t in (16, 64, 256)]
    entry = {
        "role": "embedder",
        "name": "m",
        "kind": "encoder",
        "device": "cuda",
        "dtype": "bfloat16",
        "threads": None,
        "pass": {"points": pts, "fits": {"line": fit_line(pts, "padded_tokens")}, "use": "line"},
        "source": "measured",
        "command": "python -m carpool_twin profile",
        "measured_at": "2026-11-26T00:00:00+00:00",
    }
    entry.update(overrides)
    return entry


def _profile(*entries: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "carpool-cost-profile",
        "name": "test",
        "created": "2026-11-26T00:00:00+00:00",
        "hardware": {"gpu": None},
        "software": {},
        "models": list(entries),
    }


def test_profile_round_trips_and_checks_its_schema_version(tmp_path: Path) -> None:
    profile = _profile(_entry())
    path = save_profile(profile, tmp_path / "sub" / "p.json")
    assert load_profile(path) == profile
    assert find_entry(profile, "embedder", device="cuda")["name"] == "m"
    with pytest.raises(ProfileError, match="has no embedder/cpu"):
        find_entry(profile, "embedder", device="cpu")
    old = json.loads(path.read_text())
    old["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(old))
    with pytest.raises(ProfileError, match="schema_version"):
        load_profile(path)


def test_provenance_rules() -> None:
    measured = _entry()
    del measured["command"]
    with pytest.raises(ProfileError, match="command"):
        validate_profile(_profile(measured))
    published = _entry(source="published")
    with pytest.raises(ProfileError, match="citations"):
        validate_profile(_profile(published))
    # A citation for one fit leaves the points uncited: every number needs its source.
    published["citations"] = {"pass.fits": "vendor sheet, table 3"}
    with pytest.raises(ProfileError, match=r"pass\.points"):
        validate_profile(_profile(published))
    published["citations"]["pass.points"] = "https://example.org/paper.pdf, figure 2"
    validate_profile(_profile(published))
    twice = copy.deepcopy(_entry())
    with pytest.raises(ProfileError, match="repeats"):
        validate_profile(_profile(_entry(), twice))
    negative = _entry()
    negative["pass"]["fits"]["line"]["coef"]["padded_tokens"] = -1.0
    with pytest.raises(ProfileError, match="negative"):
        validate_profile(_profile(negative))


# Config files only (no weights): what --random-weights needs, written without importing
# transformers so the test stays fast.
TINY_CONFIGS = {
    "enc": {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": 500,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
    },
    "lm": {
        # Large enough that a 32-row decode step costs clearly more than a 1-row one
        # (a pass of a tinier model is all Python overhead, flat in its size).
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 4000,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    },
}

# Ray, FastAPI and pydantic are made unimportable before carpool_twin loads: a GPU machine
# without them must be able to measure a profile.
NO_SERVING_STACK = """
import sys
for name in ("ray", "fastapi", "pydantic", "starlette"):
    sys.modules[name] = None
from carpool_twin.cli import main
code = main(sys.argv[1:])
leaked = [m for m in ("ray", "fastapi", "pydantic") if sys.modules.get(m) is not None]
assert not leaked, leaked
sys.exit(code)
"""


def test_tiny_models_profiled_end_to_end_without_ray(tmp_path: Path) -> None:
    for name, values in TINY_CONFIGS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(values))
    # The embedder replica takes a sentence-transformers model's own limit: so does its grid.
    (tmp_path / "enc" / "sentence_bert_config.json").write_text('{"max_seq_length": 8}')
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"""
applications:
  - name: embed
    args: {{embedder: {{source: {{model: {tmp_path}/enc}}}}}}
    deployments: [{{name: embedder, user_config: {{max_batch_size: 32, max_batch_tokens: 1024}}}}]
  - name: rank
    args: {{ranker: {{backend: llm, source: {{model: {tmp_path}/lm, max_length: 128}}}}}}
  - name: generate
    args:
      small: {{source: {{model: {tmp_path}/lm}}, mode: continuous, limits: {{max_seq_len: 256}}}}
    deployments: [{{name: small, user_config: {{max_num_seqs: 32, max_step_tokens: 128}}}}]
"""
    )
    out = tmp_path / "profile.json"
    argv = ["profile", "--config", str(config), "--random-weights", "--quick", "--threads", "1"]
    argv += ["--min-time-s", "0.02", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-c", NO_SERVING_STACK, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    profile = load_profile(out)
    assert [e["role"] for e in profile["models"]] == ["embedder", "ranker", "small"]
    assert profile["hardware"]["cpu_usable"] >= 1 and profile["software"]["torch"]
    for entry in profile["models"]:
        assert entry["source"] == "measured" and entry["weights"] == "random"
        assert entry["threads"] == 1 and entry["params"] > 0
    for role in ("embedder", "ranker"):
        section = find_entry(profile, role)["pass"]
        assert all(p["ms"] > 0 for p in section["points"])
        small, big = (
            predict_ms(section, {**p}) for p in (section["points"][0], section["points"][-1])
        )
        # Timings on a loaded CPU: the fit may come out flat, never decreasing or negative.
        assert 0 < small <= big
        assert section["points"][-1]["padded_tokens"] > 10 * section["points"][0]["padded_tokens"]
    embedder = find_entry(profile, "embedder")
    assert embedder["limits"]["max_length"] == 8
    assert {p["length"] for p in embedder["pass"]["points"]} == {8}
    gen = find_entry(profile, "small")
    # 2 layers x 2 KV heads x head dim 64 x (K and V) x 4 bytes
    assert gen["kv_bytes_per_token"] == 2 * 2 * 64 * 2 * 4
    for section, feature, lo, hi in (("prefill", "tokens", 8, 64), ("decode", "batch", 1, 32)):
        line = gen[section]["fits"]["line"]["coef"]
        assert line["const"] > 0 and line[feature] >= 0
        assert 0 < predict_ms(line, {feature: lo}) <= predict_ms(line, {feature: hi})
    contexts = {p["context"] for p in gen["decode"]["points"]}
    assert len(contexts) == 2


def test_a_slow_first_run_warms_the_shape_and_is_never_the_timing() -> None:
    import time

    from carpool_twin.measure import MeasureOptions, time_pass

    calls: list[int] = []

    def run() -> None:  # a shape whose first pass allocates: 60 ms once, 1 ms after
        calls.append(1)
        time.sleep(0.06 if len(calls) == 1 else 0.001)

    # The first run alone is past the point's time limit; it still is not what is timed.
    timing = time_pass(run, MeasureOptions(max_point_s=0.01, min_time_s=0.0))
    assert len(timing["samples_ms"]) >= 2
    assert timing["ms"] < 30


def test_check_validates_every_shipped_profile(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/twin.md's `python -m carpool_twin check profiles/*.json`: cost and path profiles."""
    from carpool_twin.cli import main

    shipped = sorted(
        str(p) for p in (Path(__file__).resolve().parents[2] / "profiles").glob("*.json")
    )
    assert len(shipped) >= 3
    assert main(["check", *shipped]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (") == len(shipped), out
