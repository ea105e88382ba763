"""Merges a serve config overlay onto a serve config (the cluster tier's CPU engines)."""

from __future__ import annotations

import copy
from string import Template
from typing import Any

import yaml

# Lists whose entries merge by their `name` rather than being replaced whole.
NAMED_LISTS = ("applications", "deployments")


def merge(base: Any, overlay: Any) -> Any:
    """``overlay`` over ``base``: mappings key by key (null removes a key), named lists
    entry by entry (by `name`; new names are appended), anything else replaced."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = copy.deepcopy(base)
        for key, value in overlay.items():
            if value is None:
                out.pop(key, None)
            elif key in NAMED_LISTS and isinstance(value, list):
                out[key] = _merge_named(out.get(key) or [], value)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    return copy.deepcopy(overlay)


def _merge_named(base: list[dict], overlay: list[dict]) -> list[dict]:
    out = [copy.deepcopy(entry) for entry in base]
    index = {entry["name"]: i for i, entry in enumerate(out)}
    for entry in overlay:
        if entry["name"] in index:
            out[index[entry["name"]]] = merge(out[index[entry["name"]]], entry)
        else:
            out.append(copy.deepcopy(entry))
    return out


def load_overlaid(config_path: str, overlay_path: str, values: dict[str, str]) -> dict:
    """The serve config at ``config_path`` with the overlay applied, ${...} filled in."""
    with open(config_path) as fh:
        base = yaml.safe_load(fh)
    with open(overlay_path) as fh:
        overlay = yaml.safe_load(Template(fh.read()).substitute(values))
    return merge(base, overlay)
