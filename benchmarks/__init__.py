"""carpool's benchmark harness: batching strategies side by side under realistic load.

One CLI (``python -m benchmarks ...``; ``make bench`` runs the standard ``suite``) drives Serve
deployments over HTTP on 127.0.0.1. The pieces are small and separately testable:

- ``workloads``: typed requests (embed, rank, generate) from built-in long-tailed generators
  or JSONL files; ``trace``: the Azure production trace, scaled to this machine.
- ``arrivals``: open-loop schedules (Poisson, bursty on/off) for ``loadgen``, which also runs
  closed-loop fixed concurrency. ``targets``: how a request looks on the wire.
- ``stats``: percentiles and run summaries; ``search``: the highest rate that keeps a p99 SLO.
- ``baselines`` and ``deploy``: the naive and plain ``@serve.batch`` apps beside carpool's own,
  same model and resources; ``offline``: the model's own limit with no serving at all.
- ``report``: JSON, markdown and PNG plots; ``suite``: the standard suite.
"""
