"""Pipelines: one Serve application per pipeline, each with its own HTTP ingress."""
