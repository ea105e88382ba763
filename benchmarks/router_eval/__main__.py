"""``python -m benchmarks.router_eval``: see benchmarks/router_eval/cli.py."""

from benchmarks.router_eval.cli import main

main()
