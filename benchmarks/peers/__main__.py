"""``python -m benchmarks.peers``: the same as ``python -m benchmarks peers``."""

import sys

from benchmarks.peers.cli import main

sys.exit(main())
