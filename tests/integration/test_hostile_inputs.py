"""Hand-written hostile requests against every app, at scale, with good requests in flight.

The cases (``tests/bad_inputs.py``) are what a fuzzer rarely builds: bodies over 16 MiB,
100k-deep JSON, invalid UTF-8 and lone surrogates, NaN/Infinity/1e309 in numeric fields,
``max_tokens`` of 2**63, thousands of inputs and documents, garbage in the ``x-carpool-*``
headers. After each app's batch: no answer was 5xx, every good request sent alongside got
200, /healthz and a good request still answer 200, and no replica was restarted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from urllib.parse import quote, unquote

import httpx
import pytest

from tests.all_apps import (
    APPS,
    GOOD_REQUESTS,
    DeployedApps,
    assert_all_healthy,
    deploy_all_apps,
    replica_actors,
)
from tests.bad_inputs import HOSTILE, MIB, Hostile

GOOD_IN_FLIGHT = 8
GOOD_ATTEMPTS = 3
SHED: dict[str, int] = {}  # good requests refused with 503 overloaded (then retried), per app


def _shed(response: httpx.Response) -> bool:
    if response.status_code != 503 or "retry-after" not in response.headers:
        return False
    return response.json().get("error", {}).get("code") == "overloaded"


@pytest.fixture(scope="module")
def deployed(serve_http: str, tiny_models: dict[str, str]) -> Iterator[DeployedApps]:
    with deploy_all_apps(tiny_models, serve_http, "hx") as apps:
        yield apps


@pytest.fixture(scope="module")
def replicas(deployed: DeployedApps) -> dict[str, tuple[str, int]]:
    return replica_actors(deployed)


def _request(case: Hostile) -> tuple[bytes, dict[str, str | bytes]]:
    _, _, body, extra, _ = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers: dict[str, str | bytes] = {"content-type": "application/json", **extra}
    if headers["content-type"] == "":
        del headers["content-type"]
    return content, headers


async def _send_batch(
    deployed: DeployedApps, app: str, cases: list[Hostile]
) -> tuple[list[httpx.Response | Exception], list[httpx.Response]]:
    path, good = GOOD_REQUESTS[app]
    async with httpx.AsyncClient(timeout=300) as client:

        async def hostile(case: Hostile) -> httpx.Response | Exception:
            content, headers = _request(case)
            try:
                return await client.post(
                    deployed.url(app, case[1]), content=content, headers=headers
                )
            except httpx.HTTPError as exc:  # the server dropped the connection: a failure too
                return exc

        async def fine(i: int) -> httpx.Response:
            await asyncio.sleep(0.05 * i)  # spread over the batch, not all at its start
            for _ in range(GOOD_ATTEMPTS - 1):
                r = await client.post(deployed.url(app, path), json=good)
                if not _shed(r):
                    return r
                # Load shedding, not a failure: while the hostile batch (17 MiB bodies among
                # it) holds both cores, admission control may refuse with 503 "overloaded"
                # and Retry-After. A good client waits that long and tries again.
                SHED[app] = SHED.get(app, 0) + 1
                print(f"{app}: a good request was shed: {r.text[:200]}")
                await asyncio.sleep(min(float(r.headers.get("retry-after", "1")), 5.0))
            return await client.post(deployed.url(app, path), json=good)

        results = await asyncio.gather(
            *(hostile(c) for c in cases), *(fine(i) for i in range(GOOD_IN_FLIGHT))
        )
    return list(results[: len(cases)]), list(results[len(cases) :])  # type: ignore[arg-type]


@pytest.mark.parametrize("app", APPS)
def test_hostile_batch_gets_4xx_and_good_requests_still_succeed(
    deployed: DeployedApps, replicas: dict[str, tuple[str, int]], app: str
) -> None:
    cases = HOSTILE[app]
    bad, good = asyncio.run(_send_batch(deployed, app, cases))
    problems = []
    for case, response in zip(cases, bad, strict=True):
        label, path, _, _, expected = case
        if isinstance(response, Exception):
            problems.append(f"{label} ({path}): connection failed: {response!r}")
            continue
        allowed = {expected} if isinstance(expected, int) else expected
        if response.status_code not in allowed:
            problems.append(f"{label} ({path}): {response.status_code} {response.text[:300]}")
        elif response.status_code >= 400:
            try:
                message = response.json().get("error", {}).get("message", "")
            except ValueError:
                problems.append(
                    f"{label} ({path}): {response.status_code} body is not JSON: "
                    f"{response.headers.get('server')} {response.text[:200]!r}"
                )
                continue
            if len(message) < 15:
                problems.append(f"{label}: error message should say what to change: {message!r}")
    assert not problems, "\n".join(problems)
    failed_good = [(r.status_code, r.text[:300]) for r in good if r.status_code != 200]
    assert not failed_good, f"good requests failed ({SHED.get(app, 0)} shed first): {failed_good}"
    assert_all_healthy(deployed, replicas)


async def _chunks(total: int, size: int = MIB) -> AsyncIterator[bytes]:
    yield b'{"input": "'
    for _ in range(total // size):
        yield b"a" * size
    yield b'"}'


@pytest.mark.parametrize("app", APPS)
def test_body_over_the_cap_without_content_length_gets_413(
    deployed: DeployedApps, replicas: dict[str, tuple[str, int]], app: str
) -> None:
    # Chunked transfer: no Content-Length to refuse early, so the cap trips while the body
    # is read, inside FastAPI's body parsing.
    path, _ = GOOD_REQUESTS[app]

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            return await client.post(
                deployed.url(app, path),
                content=_chunks(17 * MIB),
                headers={"content-type": "application/json"},
            )

    response = asyncio.run(send())
    assert response.status_code == 413, response.text[:300]
    assert "larger than" in response.json()["error"]["message"]


ENORMOUS = [
    {"max_tokens": 10**12},
    {"max_tokens": 2**63},
    {"max_tokens": 17},  # one over the tiny model's limit: refused by the replica, not the schema
    {"n": 2**63},
    {"prompt": ["a"] * 64, "n": 16},
    {"stop": ["x"] * 10_000},
    {"prompt": "word " * 80_000},
]


@pytest.mark.parametrize("model", ["small", "large", "auto"])
def test_enormous_generation_requests_are_refused_fast_and_hold_nothing(
    deployed: DeployedApps, model: str
) -> None:
    base = {"model": model, "prompt": "the river", "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        for patch in ENORMOUS:
            for stream in (False, True):
                started = time.monotonic()
                r = client.post(
                    deployed.url("generate", "/v1/completions"),
                    json={**base, **patch, "stream": stream},
                )
                elapsed = time.monotonic() - started
                assert r.status_code == 400, (patch, stream, r.status_code, r.text[:300])
                assert elapsed < 5, f"{patch} took {elapsed:.1f}s to refuse"
        stats = client.get(deployed.url("generate", "/v1/stats")).json()
    for tier in ("small", "large"):
        assert stats[tier]["running"] == 0 and stats[tier]["waiting"] == 0, stats[tier]


def test_rag_citation_header_survives_ids_outside_latin1(deployed: DeployedApps) -> None:
    # An id a header cannot carry verbatim (non-latin-1, a comma, CR/LF) once made every rag
    # answer citing it a 500.
    doc_id = "\U00025244 bridge, \r\nQuillon"
    text = "The Zorblatt bridge of Quillon was painted bright orange in 1987 by fishermen."
    with httpx.Client(timeout=120) as client:
        ingest = client.post(
            deployed.url("rag", "/v1/documents"),
            json={"documents": [{"id": doc_id, "text": text}]},
        )
        assert ingest.status_code == 200, ingest.text
        for stream in (False, True):
            r = client.post(
                deployed.url("rag", "/v1/chat/completions"),
                json={
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": 2,
                    "stream": stream,
                },
            )
            assert r.status_code == 200, r.text[:300]
            cited = [unquote(i) for i in r.headers["x-carpool-citations"].split(",")]
            assert doc_id in cited
            if not stream:
                assert cited == r.json()["citations"]
        deleted = client.delete(deployed.url("rag", f"/v1/documents/{quote(doc_id, safe='')}"))
        assert deleted.status_code == 200, deleted.text
