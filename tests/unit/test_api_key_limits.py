"""Per-API-key concurrency limits and the open-ingress warning (carpool/auth.py), without Ray.

The middleware is driven as ASGI with a fake app whose responses finish when the test says,
so "in flight" is exact: no sleeps, no server.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient

from carpool import auth
from carpool.auth import ApiKey, ApiKeyAuth, default_max_concurrency, parse_api_key
from carpool.http import make_api

PIPELINES = ("embed", "rank", "search", "rag", "generate", "openai_api")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (auth.API_KEYS_ENV, auth.API_KEYS_FILE_ENV, auth.MAX_CONCURRENCY_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(auth, "_exposure", None)


class GatedApp:
    """An ASGI app whose responses end when ``finish`` is set; ``fail`` makes them raise."""

    def __init__(self, stream: bool = False) -> None:
        self.finish = asyncio.Event()
        self.started = 0
        self.stream = stream
        self.fail = False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.started += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if self.stream:
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await self.finish.wait()
        if self.fail:
            raise RuntimeError("the model failed")
        await send({"type": "http.response.body", "body": b"done", "more_body": False})


async def request(app: Any, key: str | None, path: str = "/v1/thing") -> list[dict]:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def status(sent: list[dict]) -> int:
    return sent[0]["status"]


def headers(sent: list[dict]) -> dict[bytes, bytes]:
    return dict(sent[0]["headers"])


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def middleware(inner: Any, limit: int | None = 1) -> ApiKeyAuth:
    return ApiKeyAuth(inner, keys=[ApiKey(b"key-a", limit), ApiKey(b"key-b", limit)])


def test_a_key_at_its_limit_gets_429_with_retry_after_while_another_key_passes() -> None:
    async def main() -> None:
        inner = GatedApp()
        app = middleware(inner, limit=2)
        held = [asyncio.create_task(request(app, "key-a")) for _ in range(2)]
        await settle()
        assert inner.started == 2

        refused = await request(app, "key-a")
        assert status(refused) == 429
        assert headers(refused)[b"retry-after"] == b"1"
        body = refused[1]["body"].decode()
        assert '"code":"tenant_concurrency_limit"' in body
        assert '"type":"rate_limit_error"' in body
        assert "key-a" not in body  # the key is never echoed
        assert inner.started == 2  # the refused request never reached the app

        other = asyncio.create_task(request(app, "key-b"))  # another tenant: untouched
        await settle()
        assert inner.started == 3
        inner.finish.set()
        assert status(await other) == 200
        assert [status(await t) for t in held] == [200, 200]
        assert app.in_flight == [0, 0]

    asyncio.run(main())


def test_the_slot_is_free_again_after_a_response_completes() -> None:
    async def main() -> None:
        inner = GatedApp()
        app = middleware(inner)
        first = asyncio.create_task(request(app, "key-a"))
        await settle()
        assert status(await request(app, "key-a")) == 429
        inner.finish.set()
        assert status(await first) == 200
        assert status(await request(app, "key-a")) == 200

    asyncio.run(main())


def test_the_slot_is_free_again_after_the_app_raises() -> None:
    async def main() -> None:
        inner = GatedApp()
        inner.fail = True
        app = middleware(inner)
        first = asyncio.create_task(request(app, "key-a"))
        await settle()
        inner.finish.set()
        with pytest.raises(RuntimeError):
            await first
        assert app.in_flight == [0, 0]
        inner.fail = False
        assert status(await request(app, "key-a")) == 200

    asyncio.run(main())


def test_a_stream_holds_its_slot_until_its_last_chunk_or_until_its_client_leaves() -> None:
    async def main() -> None:
        inner = GatedApp(stream=True)
        app = middleware(inner)
        stream = asyncio.create_task(request(app, "key-a"))
        await settle()
        # Headers and a first chunk are out, the stream is not over: the slot is still held.
        assert status(await request(app, "key-a")) == 429
        inner.finish.set()
        sent = await stream
        assert sent[-1]["more_body"] is False and app.in_flight == [0, 0]

        # The client leaves mid-stream: Serve cancels the request; the slot comes back.
        inner.finish = asyncio.Event()
        left = asyncio.create_task(request(app, "key-a"))
        await settle()
        assert app.in_flight == [1, 0]
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        assert app.in_flight == [0, 0]
        inner.finish.set()
        assert status(await request(app, "key-a")) == 200

    asyncio.run(main())


def test_wrong_or_missing_keys_still_get_401_and_healthz_stays_open() -> None:
    async def main() -> None:
        inner = GatedApp()
        inner.finish.set()
        app = middleware(inner)
        assert status(await request(app, "key-c")) == 401
        assert status(await request(app, None)) == 401
        assert status(await request(app, "key-a", path="/embed/healthz")) == 200
        assert app.in_flight == [0, 0]  # /healthz takes no slot

    asyncio.run(main())


def test_limits_come_from_the_key_entry_the_env_or_half_the_replica() -> None:
    assert parse_api_key("  key-a   max_concurrency=8 ", "here") == ApiKey(b"key-a", 8)
    assert parse_api_key("key-b", "here") == ApiKey(b"key-b", None)
    assert parse_api_key("# a comment", "here") is None
    assert parse_api_key("   ", "here") is None
    # Two or more keys: each may hold half of the replica's slots; one key: no other tenant.
    assert default_max_concurrency(2, 512) == 256
    assert default_max_concurrency(3, 1) == 1
    assert default_max_concurrency(1, 512) is None
    assert default_max_concurrency(2, None) is None  # outside Serve: capacity unknown


def test_the_env_sets_the_default_and_zero_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.MAX_CONCURRENCY_ENV, "4")
    assert default_max_concurrency(1, None) == 4
    monkeypatch.setenv(auth.MAX_CONCURRENCY_ENV, "0")
    assert default_max_concurrency(5, 512) is None
    monkeypatch.setenv(auth.MAX_CONCURRENCY_ENV, "lots")
    with pytest.raises(ValueError, match=r"CARPOOL_API_KEY_MAX_CONCURRENCY='lots'"):
        default_max_concurrency(2, 512)


def test_keys_and_limits_from_the_env_and_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\nkey-c max_concurrency=0\n\nkey-d\n")
    monkeypatch.setenv(auth.API_KEYS_ENV, "key-a max_concurrency=1, key-b")
    monkeypatch.setenv(auth.API_KEYS_FILE_ENV, str(keys_file))
    monkeypatch.setenv(auth.MAX_CONCURRENCY_ENV, "3")
    app = ApiKeyAuth(GatedApp())
    app._configure()
    assert app.keys == [b"key-a", b"key-b", b"key-c", b"key-d"]
    # Its own limit, the env default, 0 = unlimited for that key, the env default.
    assert app.limits == [1, 3, None, 3]
    assert auth.load_api_keys() == [b"key-a", b"key-b", b"key-c", b"key-d"]


def test_the_default_follows_the_replicas_capacity() -> None:
    app = ApiKeyAuth(GatedApp(), keys=[ApiKey(b"a"), ApiKey(b"b", 7)], capacity=lambda: 10)
    app._configure()
    assert app.limits == [5, 7]


def test_a_bad_entry_names_where_it_is_and_not_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.API_KEYS_ENV, "ok-key,secret-key max_conc=8")
    with pytest.raises(ValueError) as err:
        auth.load_api_key_specs()
    assert "CARPOOL_API_KEYS entry 2" in str(err.value) and "max_conc=8" in str(err.value)
    assert "secret-key" not in str(err.value)
    monkeypatch.setenv(auth.API_KEYS_ENV, "secret-key max_concurrency=-1")
    with pytest.raises(ValueError, match="whole number"):
        auth.load_api_key_specs()


def test_through_the_ingress_app_429_has_carpools_error_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(auth.API_KEYS_ENV, "key-a max_concurrency=0,key-b")
    monkeypatch.setenv(auth.MAX_CONCURRENCY_ENV, "1")
    api = make_api("t", "t", 1024)

    @api.get("/v1/thing")
    async def thing() -> dict:
        return {"ok": True}

    with TestClient(api) as client:  # runs the lifespan, as Serve does at replica start
        assert client.get("/v1/thing", headers={"Authorization": "Bearer key-b"}).json() == {
            "ok": True
        }
        assert client.get("/v1/thing", headers={"Authorization": "Bearer nope"}).status_code == 401
    middleware_instance = api.middleware_stack
    while not isinstance(middleware_instance, ApiKeyAuth):
        middleware_instance = middleware_instance.app
    assert middleware_instance.limits == [None, 1]


# The open-ingress warning.


def test_only_a_non_loopback_bind_without_keys_is_reported() -> None:
    assert auth.find_exposure(("0.0.0.0", 8000), []) != []
    assert auth.find_exposure(("::", 8000), []) != []
    assert auth.find_exposure(("10.0.3.7", 8000), []) != []
    assert auth.find_exposure(("0.0.0.0", 8000), [b"key"]) == []
    assert auth.find_exposure(("127.0.0.1", 8000), []) == []
    assert auth.find_exposure(("localhost", 8000), []) == []
    assert auth.find_exposure(("::1", 8000), []) == []
    assert auth.find_exposure(None, []) == []  # outside Serve: nothing known, nothing said
    (warning,) = auth.find_exposure(("0.0.0.0", 8000), [])
    assert "0.0.0.0:8000" in warning and "CARPOOL_API_KEYS" in warning


def test_the_warning_is_logged_once_per_replica(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def address() -> tuple[str, int]:
        calls.append(1)
        return ("0.0.0.0", 8000)

    with caplog.at_level(logging.WARNING, logger="carpool.auth"):
        first = auth.exposure_warnings(address)
        second = auth.exposure_warnings(address)
    assert first == second and len(first) == 1 and len(calls) == 1
    assert [r.getMessage() for r in caplog.records] == first


def test_a_failed_lookup_reports_nothing() -> None:
    def address() -> tuple[str, int]:
        raise ConnectionError("controller restarting")

    assert auth.exposure_warnings(address) == []


def test_the_replica_start_checks_exposure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "serve_http_address", lambda: ("0.0.0.0", 8000))
    api = make_api("t", "t", 1024)
    with TestClient(api):  # the lifespan: Serve runs it when the replica starts
        pass
    assert auth._exposure is not None and len(auth._exposure) == 1


@pytest.mark.parametrize("name", PIPELINES)
def test_every_pipelines_healthz_carries_the_warnings(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.factories import pipeline_api

    module = importlib.import_module(f"pipelines.{name}")
    if hasattr(module, "api"):
        (ingress,) = [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type) and hasattr(cls, "healthz")
        ]
        healthz = functools.partial(ingress.healthz, None)
    else:  # routes built per replica over a handler (generate): healthz uses none
        (route,) = [r for r in pipeline_api(name).routes if getattr(r, "path", None) == "/healthz"]
        healthz = route.endpoint
    assert asyncio.run(healthz()) == {"status": "ok"}  # outside Serve: nothing

    monkeypatch.setattr(auth, "_exposure", ["OPEN TO ANYONE: ..."])
    assert asyncio.run(healthz()) == {
        "status": "ok",
        "warnings": ["OPEN TO ANYONE: ..."],
    }
