"""Reliability measurements of the serve.yaml deployment: overload, faults, soak.

``python -m benchmarks.reliability {overload,faults,soak}``; see benchmarks/README.md.
"""
