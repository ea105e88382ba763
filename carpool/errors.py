"""Errors a client caused, carried from any stage of a pipeline to its HTTP ingress."""

from __future__ import annotations


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
    ) -> None:
        super().__init__(status_code, message, param, code, retry_after_s)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

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
