"""serve-gpu.yaml's shape on a simulated head + two GPU workers (tests/cluster/scenario.py).

Its own Ray cluster in a child process: a driver joins one cluster, and the session's shared
Ray is a single node. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from carpool.local_ray import CLUSTER_MODE_VAR, ray_environment

SCENARIO = Path(__file__).with_name("scenario.py")


def test_serve_gpu_shape_scales_spreads_and_survives_a_worker() -> None:
    # Serve's Python proxy here: the simulated nodes are raylets on one host, and each node's
    # HAProxy would bind the same HTTP, stats and exporter ports (only one starts). On a real
    # cluster every node is its own host (docs/ingress.md).
    env = {
        **os.environ,
        **ray_environment(),  # token auth, the token created where Ray looks
        "RAY_ADDRESS": "",
        "RAY_SERVE_ENABLE_HA_PROXY": "0",
    }
    # Ray's cluster mode: simulated nodes join a head, which its single-machine mode (the
    # one-box Ray's, carpool/local_ray.py) refuses; token auth stays on.
    env.pop(CLUSTER_MODE_VAR, None)
    done = subprocess.run(
        [sys.executable, str(SCENARIO)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("CARPOOL_RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(lines[-1].removeprefix("CARPOOL_RESULT "))
    print(json.dumps(report, indent=1))
    assert report["ok"]
