"""Who may use an ingress, and how much of it at once.

Three things, one per concern a shared cluster has:

- **API keys** (``ApiKeyAuth``): ``Authorization: Bearer <key>`` on every route but /healthz,
  keys from ``$CARPOOL_API_KEYS`` (comma-separated) and/or ``$CARPOOL_API_KEYS_FILE`` (one a
  line). No key configured means the ingress is open, as it is by default on 127.0.0.1.
- **Per-key concurrency** (also ``ApiKeyAuth``): a key may hold at most its limit of requests
  in flight on one ingress replica; the next one gets 429 with Retry-After while every other
  key is untouched, so one tenant cannot take every slot. A streamed response holds its slot
  until its last chunk is sent or its client leaves.
- **Exposure** (``exposure_warnings``): an ingress whose Serve HTTP proxy listens on a
  non-loopback address with no API key says so loudly, once in its replica's log and in every
  ``/healthz`` answer (``health_body``).

The limit for a key, from the most specific setting down:

1. ``max_concurrency=N`` after the key in its entry (``key-a max_concurrency=8``; the same
   syntax in ``CARPOOL_API_KEYS`` and in the file; ``0`` means no limit for that key);
2. ``$CARPOOL_API_KEY_MAX_CONCURRENCY`` (``0`` means no limit);
3. with two or more keys, half of the ingress replica's ``max_ongoing_requests`` (rounded
   down, at least 1): another tenant always finds the other half free. With one key there is
   no other tenant to protect, and outside a Serve replica the capacity is unknown: no limit.

Every limit counts per ingress replica (each replica counts its own requests; an app with
three ingress replicas lets a key hold three times its limit across them).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from carpool.error_body import error_response
from carpool.topology import replica_context

logger = logging.getLogger(__name__)

API_KEYS_ENV = "CARPOOL_API_KEYS"
API_KEYS_FILE_ENV = "CARPOOL_API_KEYS_FILE"
MAX_CONCURRENCY_ENV = "CARPOOL_API_KEY_MAX_CONCURRENCY"
MAX_CONCURRENCY_OPTION = "max_concurrency"
# A refused tenant retries after this long: about one request's time on a busy ingress; the
# slot it waits for frees when one of its own requests ends, which nothing here can predict.
TENANT_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class ApiKey:
    """One configured key and its own limit (None: the default; 0: no limit)."""

    key: bytes
    max_concurrency: int | None = None


def _whole_number(value: str, what: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(
            f"{what}={value!r} is not a whole number >= 0; give the most requests one API key "
            "may have in flight on one ingress replica (0 = no limit)"
        )
    return number


def parse_api_key(entry: str, where: str) -> ApiKey | None:
    """``"<key> [max_concurrency=N]"``; None for a blank or ``#`` comment entry.

    Error messages say where the entry is but never quote the key itself.
    """
    parts = entry.split()
    if not parts or parts[0].startswith("#"):
        return None
    limit = None
    for option in parts[1:]:
        name, sep, value = option.partition("=")
        if name != MAX_CONCURRENCY_OPTION or not sep:
            raise ValueError(
                f"{where}: unknown option {option!r} after the key; the only option is "
                f"{MAX_CONCURRENCY_OPTION}=N (e.g. `my-key {MAX_CONCURRENCY_OPTION}=8`)"
            )
        limit = _whole_number(value, f"{where}: {MAX_CONCURRENCY_OPTION}")
    return ApiKey(parts[0].encode(), limit)


def load_api_key_specs() -> list[ApiKey]:
    """Keys with their limits from $CARPOOL_API_KEYS and $CARPOOL_API_KEYS_FILE.

    A key given twice keeps its last entry's limit.
    """
    entries = [
        (entry, f"{API_KEYS_ENV} entry {n}")
        for n, entry in enumerate(os.environ.get(API_KEYS_ENV, "").split(","), 1)
    ]
    path = os.environ.get(API_KEYS_FILE_ENV)
    if path:
        with open(path) as fh:
            entries += [(line, f"{path} line {n}") for n, line in enumerate(fh, 1)]
    keys: dict[bytes, ApiKey] = {}
    for entry, where in entries:
        spec = parse_api_key(entry, where)
        if spec is not None:
            keys[spec.key] = spec
    return list(keys.values())


def load_api_keys() -> list[bytes]:
    """The configured keys alone (empty: the ingress is open)."""
    return [spec.key for spec in load_api_key_specs()]


def default_max_concurrency(n_keys: int, replica_capacity: int | None) -> int | None:
    """The limit of a key without its own ``max_concurrency``; None means no limit."""
    configured = os.environ.get(MAX_CONCURRENCY_ENV, "").strip()
    if configured:
        return _whole_number(configured, MAX_CONCURRENCY_ENV) or None
    if n_keys < 2 or not replica_capacity:
        return None
    return max(1, replica_capacity // 2)


def replica_capacity() -> int | None:
    """This Serve replica's ``max_ongoing_requests``; None outside a Serve replica."""
    context = replica_context()
    if context is None:
        return None
    return getattr(context._deployment_config, "max_ongoing_requests", None)


class ApiKeyAuth:
    """ASGI middleware: API keys on every route but /healthz, and a concurrency limit per key.

    Keys and limits are read once per replica, when the app starts (the ASGI lifespan, which
    Serve runs as the replica starts) or at its first request: a bad entry fails the replica
    at start with a message that says which entry. Comparison is constant-time over every key,
    so the response time leaks nothing about how much of a key was right.
    """

    OPEN_PATHS = ("/healthz",)

    def __init__(
        self,
        app: Any,
        keys: list[ApiKey] | None = None,
        capacity: Callable[[], int | None] = replica_capacity,
    ) -> None:
        self.app = app
        self._given = keys
        self._capacity = capacity
        self.keys: list[bytes] | None = None
        self.limits: list[int | None] = []
        self.in_flight: list[int] = []

    def _configure(self) -> None:
        specs = self._given if self._given is not None else load_api_key_specs()
        default = default_max_concurrency(len(specs), self._capacity() if specs else None)
        self.limits = [
            default if spec.max_concurrency is None else (spec.max_concurrency or None)
            for spec in specs
        ]
        self.in_flight = [0] * len(specs)
        self.keys = [spec.key for spec in specs]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if self.keys is None:
            self._configure()
            if scope["type"] == "lifespan":
                # The replica is starting: say now, in its log, if it is open to anyone.
                await asyncio.to_thread(exposure_warnings)
        if scope["type"] != "http" or not self.keys or scope["path"].endswith(self.OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        # Check every key without stopping early, so timing does not say which one matched.
        matched = -1
        for index, key in enumerate(self.keys):
            if hmac.compare_digest(token, key):
                matched = index
        if scheme.lower() != b"bearer" or matched < 0:
            await _refuse(
                scope,
                receive,
                send,
                401,
                "missing or wrong API key; send `Authorization: Bearer <key>` with a key from "
                "CARPOOL_API_KEYS",
                "invalid_api_key",
            )
            return
        limit = self.limits[matched]
        if limit is not None and self.in_flight[matched] >= limit:
            await _refuse(
                scope,
                receive,
                send,
                429,
                f"this API key already has {limit} requests in flight on this ingress replica "
                "(its concurrency limit); retry after the Retry-After delay, or send fewer "
                "requests at once",
                "tenant_concurrency_limit",
                TENANT_RETRY_AFTER_S,
            )
            return
        await self._call_holding_slot(matched, scope, receive, send)

    async def _call_holding_slot(
        self, index: int, scope: dict, receive: Callable, send: Callable
    ) -> None:
        """Runs the app with one of the key's slots taken, until its response ends.

        The slot frees when the last body chunk has been sent, or when the app returns, fails
        or is cancelled (the client left mid-stream), whichever comes first, and only once.
        """
        self.in_flight[index] += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.in_flight[index] -= 1

        async def counted_send(message: dict) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()

        try:
            await self.app(scope, receive, counted_send)
        finally:
            release()


async def _refuse(
    scope: dict,
    receive: Callable,
    send: Callable,
    status: int,
    message: str,
    code: str,
    retry_after_s: float | None = None,
) -> None:
    response = error_response(status, message, code=code, retry_after_s=retry_after_s)
    await response(scope, receive, send)


# What this replica found about its exposure (None: not looked yet). One look per replica.
_exposure: list[str] | None = None


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; a name or a wildcard address is not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def serve_http_address() -> tuple[str, int] | None:
    """(host, port) Serve's HTTP proxies bind, from this cluster's Serve controller.

    None outside a Serve replica. A blocking call (the controller answers over Ray): run it
    once, off the event loop where one is running.
    """
    try:
        from ray.serve.context import _get_global_client, _get_internal_replica_context
    except ImportError:
        return None
    if _get_internal_replica_context() is None:
        return None
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    options = client.http_config
    return str(options.host), int(options.port)


def find_exposure(address: tuple[str, int] | None, keys: list[bytes]) -> list[str]:
    """The warnings for an ingress served at ``address`` with ``keys`` (pure)."""
    if address is None or keys or is_loopback(address[0]):
        return []
    host, port = address
    return [
        f"OPEN TO ANYONE: Serve's HTTP proxy listens on {host}:{port} (http_options.host), "
        "which is not loopback, and this ingress has no API key, so anyone who can reach that "
        f"port can use every model here. Set {API_KEYS_ENV} (or {API_KEYS_FILE_ENV}) in the "
        "environment of every Ray node (docs/kuberay/README.md, cluster.yaml), or bind "
        "http_options.host to 127.0.0.1 behind your own gateway."
    ]


def exposure_warnings(address: Callable[[], tuple[str, int] | None] | None = None) -> list[str]:
    """Warnings about who can reach this ingress; found and logged once per replica.

    ``address`` is ``serve_http_address`` unless given. Outside Serve, or when the controller
    cannot be asked, there is nothing to say (an unknown bind address is not reported open).
    """
    global _exposure
    if _exposure is None:
        try:
            found = find_exposure((address or serve_http_address)(), load_api_keys())
        except Exception as exc:  # the controller restarting, an unreadable keys file
            logger.info("could not check who can reach this ingress (%s); not checked", exc)
            found = []
        for warning in found:
            logger.warning("%s", warning)
        _exposure = found
    return list(_exposure)


def health_body() -> dict[str, Any]:
    """What every ingress's /healthz answers: ``{"status": "ok"}``, plus any warnings.

    In Serve the look was already taken when the replica started (``ApiKeyAuth`` runs it, off
    the event loop, at the ASGI lifespan), so this answers from the cache.
    """
    warnings = exposure_warnings()
    return {"status": "ok", "warnings": warnings} if warnings else {"status": "ok"}
