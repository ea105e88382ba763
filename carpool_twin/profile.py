"""The cost-profile file: its schema, the fits it carries, and its provenance rules.

A profile is one JSON document::

    {"schema_version": 1, "kind": "carpool-cost-profile", "name": "cpu-2core",
     "source": "measured", "command": "...", "created": "2026-...Z",
     "hardware": {...}, "software": {...}, "models": [ {entry}, ... ]}

Each model entry is one model on one device, dtype and thread count (a profile may hold the
same model at several of them). Its cost sections hold the raw points and the fits:

- encoders (``kind`` ``encoder``, ``ranker_llm``, ``cross_encoder``): ``pass``, one forward
  pass of ``rows`` items padded to ``length`` tokens (``padded_tokens = rows x length``);
- generators (``kind`` ``generator``): ``prefill`` (one engine step feeding ``tokens`` prompt
  tokens) and ``decode`` (one step of ``batch`` sequences at ``context`` tokens each), plus
  ``kv_bytes_per_token``.

A fit is ``ms = const + sum(coef[f] x feature f)``; ``predict_ms`` evaluates one. Every
section names the fit a simulator should use (``use``). Provenance: an entry is ``source:
"measured"`` (with the command and date that measured it) or ``source: "published"`` (taken
from a paper, vendor sheet or benchmark), and a published entry cites a source for every
number in its cost sections (``citations``: path -> source); ``validate_profile`` refuses a
profile that breaks these rules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from carpool.admission import PassCostModel

SCHEMA_VERSION = 1
PROFILE_KIND = "carpool-cost-profile"
SOURCES = ("measured", "published")
ENCODER_KINDS = ("encoder", "ranker_llm", "cross_encoder")
MODEL_KINDS = (*ENCODER_KINDS, "generator")
# The sections a model kind must have, and the feature its one-variable line is fitted on.
SECTIONS: dict[str, dict[str, str]] = {
    "encoder": {"pass": "padded_tokens"},
    "ranker_llm": {"pass": "padded_tokens"},
    "cross_encoder": {"pass": "padded_tokens"},
    "generator": {"prefill": "tokens", "decode": "batch"},
}
# An extended fit replaces the line only when it cuts the relative error by this much: a
# third term fitted on a dozen noisy points must earn its place.
EXTENDED_FIT_GAIN = 0.8


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field and what to change."""


# --- fits ---------------------------------------------------------------------------------


def _errors(points: Sequence[Mapping[str, Any]], coef: Mapping[str, float]) -> tuple[float, float]:
    """(relative RMS error, largest relative error) of a fit over its points."""
    rel = [(predict_ms(coef, p) - p["ms"]) / p["ms"] for p in points if p.get("ms", 0) > 0]
    if not rel:
        return 0.0, 0.0
    return math.sqrt(sum(r * r for r in rel) / len(rel)), max(abs(r) for r in rel)


def _fit_record(
    features: Sequence[str], coef: dict[str, float], points: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    rel_rmse, max_rel = _errors(points, coef)
    return {
        "form": "ms = " + " + ".join(["const", *(f"coef.{f} * {f}" for f in features)]),
        # Six significant digits: far below the run-to-run noise, and a readable file.
        "coef": {k: float(f"{v:.6g}") for k, v in coef.items()},
        "rel_rmse": round(rel_rmse, 4),
        "max_rel_err": round(max_rel, 4),
        "n": len(points),
    }


def fit_line(points: Sequence[Mapping[str, Any]], feature: str) -> dict[str, Any]:
    """``ms = const + slope x feature`` by least squares, as the replicas fit their passes.

    It is carpool's own ``PassCostModel`` (the admission controller's online fit) with no
    decay, so the twin prices a pass the way a replica's admission does: a non-negative
    slope, and a negative intercept folded into the slope.
    """
    if not points:
        raise ProfileError(f"no points to fit on {feature}; measure at least two sizes")
    model = PassCostModel(decay=1.0, min_passes=1)
    for p in points:
        model.observe(int(p[feature]), int(p.get("rows", 1)), float(p["ms"]))
    return _fit_record([feature], {"const": model.fixed_ms, feature: model.ms_per_token}, points)


def fit_terms(points: Sequence[Mapping[str, Any]], features: Sequence[str]) -> dict[str, Any]:
    """``ms = const + sum(c_f x f)`` by least squares, with every coefficient non-negative.

    A negative coefficient (noise, or a term the data cannot separate) would price some
    pass below zero; that term is dropped and the rest refitted, until none is negative.
    """
    import numpy as np

    if len(points) < len(features) + 1:
        raise ProfileError(
            f"{len(points)} points cannot fit {len(features) + 1} terms ({list(features)}); "
            "measure more sizes"
        )
    kept = list(features)
    y = np.array([float(p["ms"]) for p in points])
    while True:
        a = np.array([[1.0] + [float(p[f]) for f in kept] for p in points])
        solution, *_ = np.linalg.lstsq(a, y, rcond=None)
        values = dict(zip(["const", *kept], (float(v) for v in solution), strict=True))
        negative = [f for f in kept if values[f] < 0]
        if not negative and values["const"] >= 0:
            break
        if negative:
            kept.remove(min(negative, key=lambda f: values[f] * max(float(p[f]) for p in points)))
        else:  # a negative intercept: the smallest passes are nearly free; pin it at zero
            a = a[:, 1:]
            solution, *_ = np.linalg.lstsq(a, y, rcond=None)
            values = {"const": 0.0, **dict(zip(kept, (float(v) for v in solution), strict=True))}
            if all(v >= 0 for v in values.values()):
                break
            kept.remove(min(kept, key=lambda f: values[f]))
    coef = {"const": values["const"], **{f: values.get(f, 0.0) for f in features}}
    return _fit_record(features, coef, points)


def choose_fit(fits: Mapping[str, Mapping[str, Any]]) -> str:
    """The line, unless another fit is clearly better (``EXTENDED_FIT_GAIN``)."""
    best = "line"
    for name, fit in fits.items():
        if name != "line" and fit["rel_rmse"] < EXTENDED_FIT_GAIN * fits[best]["rel_rmse"]:
            best = name
    return best


def predict_ms(coef_or_section: Mapping[str, Any], features: Mapping[str, Any]) -> float:
    """A pass's cost in ms from a fit's ``coef`` (or a whole section: its ``use`` fit).

    Features a fit does not use are ignored; one it uses and ``features`` lacks is an error.
    """
    coef = coef_or_section
    if "fits" in coef_or_section:
        coef = coef_or_section["fits"][coef_or_section["use"]]["coef"]
    elif "coef" in coef_or_section:
        coef = coef_or_section["coef"]
    total = float(coef.get("const", 0.0))
    for name, c in coef.items():
        if name == "const" or c == 0:
            continue
        if name not in features:
            raise ProfileError(f"this fit needs feature {name!r}; pass it (have {list(features)})")
        total += float(c) * float(features[name])
    return total


# --- file, schema and provenance -----------------------------------------------------------


def _require(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in mapping:
        raise ProfileError(f"{where} has no {key!r}; add it (see docs/twin.md)")
    return mapping[key]


def _numbers(value: Any, path: str) -> Iterator[str]:
    """Paths of every number under ``value`` (``pass.fits.line.coef.const``...)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield path
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")


def cost_numbers(entry: Mapping[str, Any]) -> list[str]:
    """The numbers a published entry must cite: its cost sections and KV bytes per token."""
    paths: list[str] = []
    for section in SECTIONS.get(entry.get("kind", ""), {}):
        paths.extend(_numbers(entry.get(section), section))
    if "kv_bytes_per_token" in entry:
        paths.append("kv_bytes_per_token")
    return paths


def _cited(path: str, citations: Mapping[str, Any]) -> bool:
    """A citation covers its path and everything under it (``decode`` covers its points)."""
    return any(path == c or path.startswith(c + ".") or path.startswith(c + "[") for c in citations)


def validate_entry(entry: Mapping[str, Any], where: str) -> None:
    kind = _require(entry, "kind", where)
    if kind not in MODEL_KINDS:
        raise ProfileError(f"{where}.kind is {kind!r}; use one of {list(MODEL_KINDS)}")
    for key in ("name", "role", "device", "dtype"):
        _require(entry, key, where)
    source = _require(entry, "source", where)
    if source not in SOURCES:
        raise ProfileError(f"{where}.source is {source!r}; use one of {list(SOURCES)}")
    for section, feature in SECTIONS[kind].items():
        body = _require(entry, section, where)
        fits = _require(body, "fits", f"{where}.{section}")
        use = _require(body, "use", f"{where}.{section}")
        if use not in fits:
            raise ProfileError(f"{where}.{section}.use is {use!r}; name one of {list(fits)}")
        for name, fit in fits.items():
            coef = _require(fit, "coef", f"{where}.{section}.fits.{name}")
            if any(not isinstance(v, int | float) or v < 0 or math.isnan(v) for v in coef.values()):
                raise ProfileError(
                    f"{where}.{section}.fits.{name}.coef has a negative or non-number"
                )
        if "line" in fits and feature not in fits["line"]["coef"]:
            raise ProfileError(f"{where}.{section}.fits.line is not fitted on {feature!r}")
    if kind == "generator":
        kv = _require(entry, "kv_bytes_per_token", where)
        if not isinstance(kv, int) or kv <= 0:
            raise ProfileError(f"{where}.kv_bytes_per_token is {kv!r}; a positive integer")
    if source == "measured":
        for key in ("command", "measured_at"):
            _require(entry, key, f"{where} (measured)")
    else:
        citations = _require(entry, "citations", f"{where} (published)")
        missing = [p for p in cost_numbers(entry) if not _cited(p, citations)]
        if missing:
            raise ProfileError(
                f"{where} is published but cites no source for {missing[:5]}"
                f"{' and more' if len(missing) > 5 else ''}; add citations: {{path: source}}"
            )


def validate_profile(profile: Mapping[str, Any]) -> None:
    """Raises ``ProfileError`` naming the first field that breaks the schema or provenance."""
    version = profile.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(
            f"profile schema_version is {version!r}; this carpool reads version {SCHEMA_VERSION}. "
            "Re-measure it with `python -m carpool_twin profile` or convert it"
        )
    if profile.get("kind") != PROFILE_KIND:
        raise ProfileError(f"profile kind is {profile.get('kind')!r}; expected {PROFILE_KIND!r}")
    for key in ("name", "created", "hardware", "software"):
        _require(profile, key, "profile")
    models = _require(profile, "models", "profile")
    if not isinstance(models, list) or not models:
        raise ProfileError("profile.models is empty; measure at least one model")
    seen: set[tuple[Any, ...]] = set()
    for i, entry in enumerate(models):
        where = f"models[{i}] ({entry.get('role')})"
        validate_entry(entry, where)
        key = (entry["role"], entry["device"], entry["dtype"], entry.get("threads"))
        if key in seen:
            raise ProfileError(f"{where} repeats role/device/dtype/threads {key}; keep one")
        seen.add(key)


def save_profile(profile: Mapping[str, Any], path: str | Path) -> Path:
    """Validates, then writes ``path`` (folders created); returns the path."""
    validate_profile(profile)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1, sort_keys=False) + "\n")
    return out


def load_profile(path: str | Path) -> dict[str, Any]:
    """Reads and validates a profile."""
    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    validate_profile(profile)
    return profile


def find_entry(
    profile: Mapping[str, Any],
    role: str,
    device: str | None = None,
    dtype: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The entry for ``role`` (and device, dtype, threads when given); an error lists the rest."""
    matches = [
        e
        for e in profile["models"]
        if e["role"] == role
        and (device is None or e["device"] == device)
        and (dtype is None or e["dtype"] == dtype)
        and (threads is None or e.get("threads") == threads)
    ]
    if not matches:
        have = [(e["role"], e["device"], e["dtype"], e.get("threads")) for e in profile["models"]]
        raise ProfileError(
            f"profile {profile.get('name')!r} has no {role}/{device}/{dtype}/{threads}; it has {have}"
        )
    return matches[0]
