"""The HTTP error body every carpool ingress and its middleware answer with.

Error bodies follow OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) so
OpenAI clients show the message, and the message always says what to change. A module of its
own so that ``carpool.http`` (the app) and ``carpool.auth`` (a middleware it installs) both use
it without importing each other.
"""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    retry_after_s: float | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s else None
    return JSONResponse(status_code=status, content=body, headers=headers)
