"""``python -m carpool.prepare [serve.yaml ...]``: resolve packaged models once.

With serve config paths, prepares exactly the ``packaged:`` models those configs use (what
`make models` does); with none, every packaged model. GGUF models are converted to the
safetensors cache the first time; later runs find the cache and take about a second.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from carpool.models import PACKAGED_MODELS, PACKAGED_PREFIX, prepare_packaged_models


def packaged_sources(node: Any) -> Iterator[str]:
    """Every ``packaged:<name>`` string anywhere in a parsed serve config."""
    if isinstance(node, str) and node.startswith(PACKAGED_PREFIX):
        yield node[len(PACKAGED_PREFIX) :]
    elif isinstance(node, dict):
        for value in node.values():
            yield from packaged_sources(value)
    elif isinstance(node, list):
        for value in node:
            yield from packaged_sources(value)


def main(argv: list[str]) -> int:
    if argv:
        names: list[str] = []
        for path in argv:
            for name in packaged_sources(yaml.safe_load(Path(path).read_text())):
                if name not in names:
                    names.append(name)
    else:
        names = list(PACKAGED_MODELS)
    for name, path in prepare_packaged_models(names).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
