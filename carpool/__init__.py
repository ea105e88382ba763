"""carpool: several transformer models served together on Ray Serve, batched smartly."""

__version__ = "0.1.0"
