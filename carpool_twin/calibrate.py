"""Fitting the twin's serving costs on calibration runs, never on a figure it predicts.

A cost profile times bare forward passes: a model in a loop, nothing else in the process. In
a serving replica the same pass takes longer: its event loop, Serve's own threads and the
rest of the serving path (proxy, ingress, load generator) wake during it, take the GIL or
the core, and the pass waits (``benchmarks/TWIN.md``, "A pass costs more in a serving replica than
bare": a Python
thread of the same process busy 30% of the time made a small pass 1.2-1.7x slower, another
process waking in 4 ms bursts 1.1-1.4x). That extra time holds the replica like the pass
itself does, so it enters the twin as pass cost (occupancy, which queues under load), not
as latency added to every request (which does not).

``serving_pass_scale`` reads it from a 1-client calibration run: the replica's own record of
its passes' wall time there (``/v1/stats``) over the twin's price of the same requests'
passes.

Its limit, measured (``benchmarks/TWIN.md``, "A pass costs more in a serving replica than
bare"): the factor is not one number.
At 1 client it was 1.20 for the default's small passes and 0.90 for ``split_policy:
greedy``'s multi-row ones (the profile prices passes by padded tokens alone, and shapes of
one padded size differ by up to 30%), and the same shapes ran at 1.18 and, three minutes
later, 0.94 (the VM's speed drifts). Carried from one configuration's calibration run to
another configuration or phase it made the twin worse there; it is kept as a measured
input, not as a settled model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

from carpool_twin.replicas import SimRequest
from carpool_twin.sim import Overheads
from carpool_twin.topology import TwinSpec


def priced_pass_ms(spec: TwinSpec, role: str, requests: Sequence[SimRequest], count: int) -> float:
    """The profile's price (ms, in all) of the passes ``role`` runs for the first ``count``
    of ``requests`` sent one at a time (a 1-client closed loop, nothing else on the host)."""
    bare = copy.deepcopy(spec)
    bare.overheads = Overheads()
    bare.scale = 1.0
    for pool in bare.pools.values():
        pool.pass_scale = 1.0
        pool.request_ms = 0.0
    twin = bare.build()
    twin.run(clients=1, requests=requests, duration_s=math.inf, warmup_s=0, max_requests=count)
    replicas = twin.pools[role].replicas
    return 1000 * sum(twin.busy_s.get(r.name, 0.0) for r in replicas)


def serving_pass_scale(
    spec: TwinSpec,
    role: str,
    requests: Sequence[SimRequest],
    answered: int,
    forward_ms: float,
) -> float:
    """How many times its profile price a pass of ``role`` takes under serving.

    From a 1-client closed loop that sent ``requests`` in order and got ``answered`` of them
    back, while the replica's passes took ``forward_ms`` of wall time in all. With one request
    in flight carpool's executor plans each request's passes from that request alone, so the
    twin's passes for the same requests are the same passes (same count, same shapes), and
    the ratio of the two totals is what serving adds per pass.
    """
    if answered < 1 or forward_ms <= 0:
        raise ValueError(
            f"a pass scale needs a calibration run with answers and pass time; got "
            f"{answered} answered, {forward_ms} ms of passes"
        )
    priced = priced_pass_ms(spec, role, requests, answered)
    if priced <= 0:
        raise ValueError(f"the twin priced no {role} passes for {answered} requests")
    return forward_ms / priced
