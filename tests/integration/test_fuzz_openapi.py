"""Property-based fuzzing of every operation in every carpool app's OpenAPI schema, over HTTP.

Each app (embed, rank, search, rag, generate) is deployed once for this module on tiny models
(``tests/all_apps.py``). Its ``/openapi.json`` is loaded from the running app and schemathesis
generates requests for every operation: valid ones (``positive``: the schema's shapes with
hostile values inside them) and invalid ones (``negative``: wrong types, missing fields,
values out of bounds). Every answer must be below 500, and a 2xx JSON answer must match the
schema. While the fuzzer runs, a background client keeps sending good requests to every app;
at the end all of those must have succeeded, and no replica may have been restarted.

``CARPOOL_FUZZ_EXAMPLES`` sets the examples per operation and mode (default 40: about
750 requests, a module run of about 75 s here). A long run by hand, with fresh random data, and a JSON summary::

    CARPOOL_FUZZ_EXAMPLES=300 CARPOOL_FUZZ_SEED=4242 \\
    CARPOOL_FUZZ_REPORT=/tmp/fuzz.json \\
    .venv/bin/pytest tests/integration/test_fuzz_openapi.py -q
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.all_apps import (
    APPS,
    GOOD_REQUESTS,
    DeployedApps,
    assert_all_healthy,
    deploy_all_apps,
    replica_actors,
)
from tests.factories import pipeline_api

EXAMPLES = int(os.environ.get("CARPOOL_FUZZ_EXAMPLES", "40"))
SEED = os.environ.get("CARPOOL_FUZZ_SEED")  # unset: derandomized, the same cases every run
REPORT = os.environ.get("CARPOOL_FUZZ_REPORT")
# Models a generation request may name: the served ones, so fuzzed requests reach the engines
# (a random string only ever reaches the 404 for an unknown model).
GENERATE_MODELS = [None, "small", "large", "auto", "tiny-small", "tiny-large"]
# The OpenAI app routes by model: every served name, so fuzzed bodies reach every pipeline.
OPENAI_MODELS = [*GENERATE_MODELS, "tiny-encoder", "tiny-cross-encoder", "rag"]


def _operations() -> list[tuple[str, str, str]]:
    """(app, METHOD, path) of every route, read from the apps' FastAPI objects at collection.

    The test also checks that each running app's /openapi.json lists exactly these, so no
    operation escapes the fuzzer.
    """
    found = []
    for app in APPS:
        spec = pipeline_api(app).openapi()
        for path, methods in spec["paths"].items():
            found += [(app, method.upper(), path) for method in methods]
    return found


OPERATIONS = _operations()
STATS: dict[str, Any] = {"requests": 0, "statuses": Counter(), "per_operation": Counter()}


class Background:
    """Sends one good request after another to every app, from a thread, until stopped."""

    def __init__(self, deployed: DeployedApps) -> None:
        self.deployed = deployed
        self.results: list[tuple[str, int | str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="good-traffic", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                for app in APPS:
                    path, body = GOOD_REQUESTS[app]
                    try:
                        status: int | str = client.post(
                            self.deployed.url(app, path), json=body
                        ).status_code
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    self.results.append((app, status))
                self._stop.wait(0.3)

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


@pytest.fixture(scope="module")
def deployed(serve_http: str, tiny_models: dict[str, str]) -> Iterator[DeployedApps]:
    with deploy_all_apps(tiny_models, serve_http, "fz") as apps:
        yield apps


@pytest.fixture(scope="module")
def replicas(deployed: DeployedApps) -> dict[str, tuple[str, int]]:
    return replica_actors(deployed)


@pytest.fixture(scope="module")
def background(deployed: DeployedApps, replicas: dict) -> Iterator[Background]:
    with Background(deployed) as traffic:
        yield traffic


@pytest.fixture(scope="module")
def schemas(deployed: DeployedApps) -> dict[str, Any]:
    """Each app's schema as the running app serves it."""
    loaded = {}
    for app in APPS:
        spec = httpx.get(deployed.url(app, "/openapi.json"), timeout=30).raise_for_status().json()
        loaded[app] = schemathesis.openapi.from_dict(spec)
    return loaded


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def test_every_served_operation_is_fuzzed(schemas: dict[str, Any]) -> None:
    served = {
        (app, op.ok().method.upper(), op.ok().path)
        for app, schema in schemas.items()
        for op in schema.get_all_operations()
    }
    assert served == set(OPERATIONS)


def _takes_input(operation: Any) -> bool:
    return bool(operation.body or operation.path_parameters or operation.query)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize(("app", "method", "path"), OPERATIONS, ids=lambda v: str(v))
def test_fuzzed_requests_never_get_5xx(
    deployed: DeployedApps,
    schemas: dict[str, Any],
    background: Background,
    session: requests.Session,
    app: str,
    method: str,
    path: str,
    mode: GenerationMode,
) -> None:
    operation = schemas[app][path][method]
    if mode == GenerationMode.NEGATIVE and not _takes_input(operation):
        pytest.skip("nothing to make invalid: the operation takes no input")
    base_url = deployed.url(app)
    choices = {"generate": GENERATE_MODELS, "openai_api": OPENAI_MODELS}.get(app)
    takes_model = choices is not None and bool(operation.body)
    models = st.sampled_from(choices) if takes_model else st.none()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=SEED is None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    @given(case=operation.as_strategy(generation_mode=mode), model=models)
    def fuzz(case: Any, model: str | None) -> None:
        if model is not None and isinstance(case.body, dict) and mode.is_positive:
            case.body["model"] = model  # reach the engines, not only the unknown-model 404
        response = case.call(base_url=base_url, session=session, timeout=120)
        STATS["requests"] += 1
        STATS["statuses"][response.status_code] += 1
        STATS["per_operation"][f"{app} {method} {path} {mode}"] += 1
        checks = [not_a_server_error]
        content_type = response.headers.get("content-type") or [""]  # schemathesis: lists
        is_json = content_type[0].startswith("application/json")
        if mode.is_positive and response.status_code < 300 and is_json:
            checks.append(response_schema_conformance)
        case.validate_response(response, checks=checks)
        assert response.status_code < 500, response.text[:500]

    if SEED is not None:
        fuzz = hypothesis_seed(int(SEED))(fuzz)
    try:
        fuzz()
    except Unsatisfiable:
        # e.g. DELETE /v1/documents/{doc_id}: every string is a valid id.
        pytest.skip("the schema admits every value of this operation's inputs")


def test_good_requests_kept_succeeding_on_the_same_replicas(
    deployed: DeployedApps, replicas: dict[str, tuple[str, int]], background: Background
) -> None:
    # Defined last: runs after the fuzzing (pytest keeps definition order).
    time.sleep(1)
    failed = [(app, status) for app, status in list(background.results) if status != 200]
    assert background.results, "the background client sent nothing"
    assert not failed, f"good requests failed while the fuzzer ran: {failed[:20]}"
    assert_all_healthy(deployed, replicas)
    summary = {
        "examples_per_operation_and_mode": EXAMPLES,
        "seed": SEED,
        "operations": len(OPERATIONS),
        "requests": STATS["requests"],
        "statuses": dict(sorted(STATS["statuses"].items())),
        "good_requests_alongside": len(background.results),
        "per_operation": dict(sorted(STATS["per_operation"].items())),
    }
    print(json.dumps(summary, indent=1))
    if REPORT:
        with open(REPORT, "w") as fh:
            json.dump(summary, fh, indent=1)
