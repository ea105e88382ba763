"""What every carpool HTTP ingress shares: the FastAPI app, its error handling, a body-size
cap and the deadline/priority middleware. Calls to other deployments are ``carpool.calls``.

Error bodies are built by ``carpool.error_body.error_response`` (OpenAI's shape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from carpool.admission import _CONTROLS, DEADLINE_HEADER, PRIORITY_HEADER, parse_controls
from carpool.auth import ApiKeyAuth
from carpool.config import IngressConfig
from carpool.error_body import error_response
from carpool.errors import RequestError
from carpool.priority import apply_ingress_priority


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its body iterator however the stream ends.

    When the client leaves, Starlette cancels the response task wherever it is. If that is
    inside ``send()``, the iterator stays suspended at its ``yield`` and its ``finally`` (which
    cancels the backend's generation) runs only when the garbage collector reaches it: the
    generator keeps a slot busy for seconds, or to ``max_tokens``.
    """

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _describe_validation_error(err: dict[str, Any]) -> tuple[str, str | None]:
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    where = ".".join(loc) if loc else "body"
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid"))
    if kind == "json_invalid":
        ctx = err.get("ctx", {}).get("error", "")
        return f"request body is not valid JSON ({ctx}); send a UTF-8 JSON object", None
    if kind == "missing" and where == "body":
        return "request body is empty; send a JSON object", None
    if kind == "missing":
        return f"field '{where}' is required", where
    if kind == "extra_forbidden":
        return f"field '{where}' is not supported; remove it", where
    if kind == "model_attributes_type" or (kind == "dict_type" and where == "body"):
        return "request body must be a JSON object", None
    msg = msg.removeprefix("Value error, ")
    if msg.startswith(where.split(".")[0]):  # our validators already name the field
        return msg, where
    if where == "body" and kind == "value_error":  # a whole-body check: its message says where
        return msg, None
    return f"{where}: {msg}", where


# How much of an over-limit body is read and thrown away before the 413, at most: enough
# that a client sending a body somewhat over the limit reads its answer instead of a reset,
# small enough that a client streaming without end costs bounded work.
DRAIN_LIMIT_FACTOR = 4
DRAIN_LIMIT_CAP = 64 << 20


def drain_bound(max_bytes: int) -> int:
    """Bytes of an over-limit body read and discarded before answering 413 (then close)."""
    return min(DRAIN_LIMIT_FACTOR * max_bytes, DRAIN_LIMIT_CAP)


class BodySizeLimit:
    """ASGI middleware: refuse bodies over ``max_bytes`` with 413 before reading them whole.

    The refused body is read and discarded, up to ``drain_bound``, before the 413 goes out
    (nginx's lingering close). Answering first and closing with the body unread makes the
    kernel reset the connection, and a client still sending (Python's urllib) then sees
    ``Connection reset by peer`` and never the 413. Past the bound the server answers and
    closes anyway: a reset is then the client's cost, not an unbounded read.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._drain(receive, 0)
                    await self._refuse(scope, receive, send)
                    return
        received = 0

        async def counted_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Drained here, not where the error is caught: FastAPI turns it into its
                    # own 413 (see _body_error) and answers without coming back to us.
                    if message.get("more_body", False):
                        await self._drain(receive, received)
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted_receive, send)
        except _BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _drain(self, receive: Callable, already: int) -> None:
        """Reads and discards the rest of the body, stopping at the bound or a disconnect."""
        bound = drain_bound(self.max_bytes)
        total = already
        while total <= bound:
            message = await receive()
            if message["type"] != "http.request":
                return  # http.disconnect: the client left
            total += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        response = error_response(
            413,
            f"request body is larger than {self.max_bytes} bytes; send fewer or shorter inputs "
            "per request",
            code="body_too_large",
        )
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def _body_error(cause: BaseException | None, max_body_bytes: int) -> JSONResponse:
    """The 4xx for a body FastAPI could not read or decode, saying what to change."""
    if isinstance(cause, _BodyTooLarge):
        # A body without Content-Length that grew past the cap while FastAPI read it.
        return error_response(
            413,
            f"request body is larger than {max_body_bytes} bytes; send fewer or shorter inputs "
            "per request",
            code="body_too_large",
        )
    if isinstance(cause, RecursionError):
        return error_response(
            400,
            "request body nests JSON arrays or objects too deeply to parse; send the documented "
            "shape (a few levels deep)",
            code="json_too_deep",
        )
    if isinstance(cause, UnicodeError):
        return error_response(
            400, "request body is not valid UTF-8; send UTF-8 encoded JSON", code="invalid_utf8"
        )
    return error_response(
        400,
        f"request body could not be parsed ({type(cause).__name__}); send UTF-8 encoded JSON",
    )


@dataclass
class ControlsSettings:
    """Per-ingress defaults; the ingress fills them from its config when it starts."""

    default_deadline_ms: float | None = None


class RequestControlsMiddleware:
    """ASGI middleware: reads the deadline and priority headers once, for every stage.

    A request whose budget is already spent is answered 504 here, before its body is read.
    """

    def __init__(self, app: Any, settings: ControlsSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        deadline = headers.get(DEADLINE_HEADER.encode())
        priority = headers.get(PRIORITY_HEADER.encode())
        try:
            controls = parse_controls(
                deadline.decode("latin-1") if deadline is not None else None,
                priority.decode("latin-1") if priority is not None else None,
                self.settings.default_deadline_ms,
            )
            controls.check("ingress")
        except RequestError as exc:
            response = error_response(exc.status_code, exc.message, exc.param, exc.code)
            await response(scope, receive, send)
            return
        token = _CONTROLS.set(controls)
        try:
            await self.app(scope, receive, send)
        finally:
            _CONTROLS.reset(token)


def apply_ingress_defaults(api: FastAPI, ingress: IngressConfig, own_process: bool = True) -> None:
    """Called by an ingress when it starts, with its IngressConfig. ``own_process=False``: the
    HTTP is served by a model replica (direct streaming), whose priority is the model's."""
    api.state.controls.default_deadline_ms = ingress.default_deadline_ms
    if own_process:
        # Its own process's priority; Ray's proxy only where proxy_cpu_niceness opts in.
        apply_ingress_priority(ingress.cpu_niceness, ingress.proxy_cpu_niceness)


def make_api(title: str, description: str, max_body_bytes: int) -> FastAPI:
    """A FastAPI app with carpool's error handling; each pipeline adds its routes."""
    api = FastAPI(title=title, description=description, version="0.1.0")

    @api.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = [_describe_validation_error(e) for e in errors[:5]]
        message = "; ".join(p[0] for p in parts)
        if len(errors) > 5:
            message += f"; and {len(errors) - 5} more problems"
        return error_response(400, message, param=parts[0][1] if parts else None)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            # FastAPI's words for any exception while reading or decoding the body; the cause
            # says which.
            return _body_error(exc.__cause__, max_body_bytes)
        if exc.status_code == 404:
            message = "no such route; see /docs for this pipeline's endpoints"
        elif exc.status_code == 405:
            message = "method not allowed on this route; see /docs for the right method"
        return error_response(exc.status_code, message)

    @api.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.param, exc.code, exc.retry_after_s)

    api.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    api.state.controls = ControlsSettings()
    api.add_middleware(RequestControlsMiddleware, settings=api.state.controls)
    # Added last, so it runs first: an unauthenticated body is never read.
    api.add_middleware(ApiKeyAuth)
    return api


# Largest request body any ingress reads (16 MiB): far above any valid request under the
# default per-request limits, low enough that a hostile body cannot exhaust a replica.
MAX_BODY_BYTES = 16 * 1024 * 1024
