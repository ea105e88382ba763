"""``python -m carpool.prepare``: resolve every packaged model once (GGUF -> safetensors cache).

Idempotent: a second run finds the cache and returns in about a second.
"""

from __future__ import annotations

import sys

from carpool.models import PACKAGED_MODELS, prepare_packaged_models


def main(argv: list[str]) -> int:
    names = argv or list(PACKAGED_MODELS)
    for name, path in prepare_packaged_models(names).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
