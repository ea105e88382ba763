"""Multi-node placement and node loss, on a simulated cluster in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from carpool.local_ray import CLUSTER_MODE_VAR, ray_environment

SCENARIO = Path(__file__).with_name("multinode_scenario.py")


def test_models_land_on_gpu_nodes_and_survive_losing_a_node() -> None:
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
        timeout=540,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("CARPOOL_RESULT "))
    report = json.loads(line.removeprefix("CARPOOL_RESULT "))
    print(report)
    assert report["placement_ok"]
