"""Model deployments: one module per model role, each a thin Serve shell over a plain class."""
