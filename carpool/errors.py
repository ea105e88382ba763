"""Errors a client caused, carried from any stage of a pipeline to its HTTP ingress, and the
error a replica's model settings cause when it starts (``ModelSourceError``)."""

from __future__ import annotations

from typing import Any

# Stamps an overload refusal with the replica raising it (see RequestError.replica).
_AUTO: Any = object()


class RequestError(Exception):
    """A request that cannot be served as sent. The message says what to change.

    Raised in model replicas and ingresses alike; the ingress turns it into an HTTP error
    with an OpenAI-style body. It pickles with its fields, so it survives a Ray hop.
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        *,
        replica: str | None = _AUTO,
        deployment: str | None = None,
        full_for_s: float | None = None,
    ) -> None:
        super().__init__(status_code, message, param, code, retry_after_s)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        # Which replica refused an overload ("app/deployment" and its id): its callers then
        # know that replica is full, not the stage (carpool/calls.py). Set where the
        # refusal is raised inside a Serve replica; None elsewhere or when passed None.
        if replica is _AUTO:
            replica = None
            if code == "overloaded":
                from carpool.topology import current_replica

                where = current_replica()
                if where is not None:
                    deployment, replica = where
        self.replica = replica
        self.deployment = deployment
        # How long the refusing replica expects to stay full (None: unknown). A refusal by
        # count can clear in one slot's time; callers remember it no longer than this.
        self.full_for_s = full_for_s

    def __str__(self) -> str:
        return self.message


def find_request_error(exc: BaseException) -> RequestError | None:
    """Finds a RequestError in an exception that may have been wrapped by Ray."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, RequestError):
            return current
        seen.add(id(current))
        current = getattr(current, "cause", None) or current.__cause__
    return None


class ModelSourceError(ValueError):
    """A model source that cannot be resolved; the message says what to install or change."""
