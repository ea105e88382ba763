"""vLLM's engine-core process in a session of its own (``vllm.engine_session: own``, opt-in).

Why: on a Linux host whose processes sit in the root CPU cgroup (a VM or a bare machine, not
a Kubernetes pod or a systemd service), the kernel's autogroup shares a busy CPU between
sessions first and between threads inside a session second. A vLLM server started on its own
is a session, so beside other services its engine gets a session's share; inside a Ray
replica the engine core is one thread among every replica of Ray's session (the embedder's
passes, Ray's proxy, the ingresses), and waits for a core about half the time under mixed
load (benchmarks/PEERS.md, "Status 2026-11-27, 22:25"). A session of its own gives it the
share it would have as its own server, no more. Under a CPU cgroup (pods, systemd units) the
cgroup decides and this changes nothing.

The cost, and what covers it: Ray cleans up a replica's children by the replica's process
group, which the engine core leaves with ``setsid``. So the engine core watches its parent
and, if the replica is gone (re-parented: killed, crashed), kills its own group (itself and
any worker it started) within a second. A replica that stops normally shuts the engine down
first, as before.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

# Where the parent keeps vLLM's own entry point once it is wrapped (forked children see it).
_ORIGINAL = "_carpool_original_run_engine_core"
PARENT_POLL_S = 1.0


def run_engine_core_in_own_session(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``EngineCoreProc.run_engine_core``, in a new session that ends with its parent.

    The target of the engine-core process: by reference when vLLM spawns it, so it must stay
    a module-level function of a module that imports nothing heavy.
    """
    parent = os.getppid()
    os.setsid()  # a fresh child is never a group leader, so this cannot fail with EPERM
    threading.Thread(
        target=_end_with_parent, args=(parent,), name="carpool-engine-parent", daemon=True
    ).start()
    from vllm.v1.engine.core import EngineCoreProc

    original = getattr(EngineCoreProc, _ORIGINAL, None) or EngineCoreProc.run_engine_core
    if original is run_engine_core_in_own_session:  # a spawned child patched itself: a bug
        raise RuntimeError("vLLM's engine-core entry point is wrapped twice")
    return original(*args, **kwargs)


def _end_with_parent(parent: int, poll_s: float = PARENT_POLL_S) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    # Re-parented: the replica is gone and Ray's group cleanup cannot reach this session.
    os.killpg(0, signal.SIGKILL)


def start_engine_cores_in_own_session() -> None:
    """Makes the engine-core processes this process starts from now on run in their own
    session. Idempotent; call it before ``AsyncLLM`` is built."""
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, _ORIGINAL, None) is None:
        setattr(EngineCoreProc, _ORIGINAL, EngineCoreProc.run_engine_core)
        EngineCoreProc.run_engine_core = staticmethod(run_engine_core_in_own_session)
