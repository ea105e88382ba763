"""The README's examples are requests the apps accept. No Ray.

Every `curl` line of a ```bash block and every OpenAI-client call of a ```python block in
README.md is read as a request (method, URL, JSON body), and checked against the OpenAPI
schema of the app that serves its route prefix: the route exists for that method, every
body field is one the request model declares, every required field is there, and the body
validates against the pydantic model itself. So a README example with a wrong route, a
misspelt or removed field, or a bad value fails here, not in a newcomer's terminal.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from pydantic import BaseModel

from tests.factories import pipeline_api

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Route prefixes of serve.yaml's apps; anything else is the `openai` app at `/`.
PREFIXES = {
    "embed": "embed",
    "rank": "rank",
    "generate": "generate",
    "search": "search",
    "rag": "rag",
}
# The OpenAI client's resource calls, as the HTTP routes they POST to under its base_url.
CLIENT_CALLS = {
    ("embeddings", "create"): "/embeddings",
    ("chat", "completions", "create"): "/chat/completions",
    ("completions", "create"): "/completions",
}


@dataclass(frozen=True)
class Example:
    source: str  # the README text it came from, for the failure message
    method: str
    url: str
    body: dict[str, Any] | None


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _commands(block: str) -> list[list[str]]:
    """A bash block's commands as words: continuation lines joined, quotes spanning lines kept
    (a JSON body over several lines), comments dropped."""
    commands, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if words:
            commands.append(words)
        pending = ""
    assert not pending, f"unclosed quote in README: {pending}"
    return commands


def _curl_examples() -> list[Example]:
    out = []
    for block in _blocks("bash"):
        for words in _commands(block):
            if words[0] != "curl":
                continue
            method, body, url = "GET", None, None
            for i, word in enumerate(words):
                if word == "-X":
                    method = words[i + 1]
                elif word in ("-d", "--data", "--data-raw"):
                    body = json.loads(words[i + 1])
                    method = "POST" if method == "GET" else method
                elif re.match(r"^(https?://)?(localhost|127\.0\.0\.1):8000", word):
                    url = word if "://" in word else f"http://{word}"
            line = " ".join(words)
            assert url, f"no carpool URL in README command: {line}"
            out.append(Example(line, method, url, body))
    return out


def _python_examples() -> list[Example]:
    out = []
    for block in _blocks("python"):
        tree = ast.parse(block)
        clients: dict[str, str] = {}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "OpenAI"
            ):
                kwargs = {k.arg: ast.literal_eval(k.value) for k in node.value.keywords}
                clients[node.targets[0].id] = kwargs["base_url"].rstrip("/")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            chain, target = [], node.func
            while isinstance(target, ast.Attribute):
                chain.insert(0, target.attr)
                target = target.value
            if not isinstance(target, ast.Name) or target.id not in clients:
                continue
            route = CLIENT_CALLS.get(tuple(chain))
            assert route, f"README calls {'.'.join(chain)}, which this test does not map"
            body = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            out.append(Example(ast.unparse(node), "POST", clients[target.id] + route, body))
    return out


EXAMPLES = _curl_examples() + _python_examples()


@cache
def _spec(app: str) -> dict[str, Any]:
    return pipeline_api(app).openapi()


def _app_and_path(url: str) -> tuple[str, str]:
    path = urlparse(url).path
    first, _, rest = path.lstrip("/").partition("/")
    if first in PREFIXES:
        return PREFIXES[first], "/" + rest
    return "openai_api", path


def _operation(app: str, path: str, method: str) -> dict[str, Any] | None:
    for template, ops in _spec(app)["paths"].items():
        pattern = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path):
            return ops.get(method.lower())
    return None


def _request_model(name: str) -> type[BaseModel] | None:
    """The pydantic class the OpenAPI schema was drawn from (loaded with the apps)."""
    found = {
        obj
        for mod_name, mod in list(sys.modules.items())
        if mod_name.split(".")[0] in ("carpool", "pipelines", "deployments", "router")
        for obj in vars(mod).values()
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__name__ == name
    }
    return found.pop() if len(found) == 1 else None


def _body_schema(app: str, path: str, op: dict[str, Any], body: dict[str, Any]) -> tuple[str, str]:
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" not in schema and app == "openai_api" and path == "/v1/chat/completions":
        # One chat route for generators and rag: the body is the chosen pipeline's.
        owner = "rag" if body.get("model") == "rag" else "generate"
        owned = _operation(owner, path, "post")
        assert owned, f"/{owner} serves no {path}"
        schema = owned["requestBody"]["content"]["application/json"]["schema"]
        app = owner
    assert "$ref" in schema, f"{app} {path}: the body has no schema to check against"
    return schema["$ref"].rsplit("/", 1)[-1], app


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: f"{e.method} {urlparse(e.url).path}")
def test_readme_example_matches_the_apps_routes_and_fields(example: Example) -> None:
    app, path = _app_and_path(example.url)
    op = _operation(app, path, example.method)
    assert op is not None, (
        f"README: {example.source!r}\n{example.method} {path} is not a route of the "
        f"{app} app; its routes: {sorted(_spec(app)['paths'])}"
    )
    if example.body is None:
        assert "requestBody" not in op or not op["requestBody"].get("required"), example.source
        return
    name, owner = _body_schema(app, path, op, example.body)
    schema = _spec(owner)["components"]["schemas"][name]
    unknown = set(example.body) - set(schema["properties"])
    assert not unknown, f"README: {example.source!r}\nfields {sorted(unknown)} are not in {name}"
    missing = set(schema.get("required", [])) - set(example.body)
    assert not missing, f"README: {example.source!r}\n{name} requires {sorted(missing)}"
    model = _request_model(name)
    assert model is not None, f"no unique pydantic class named {name}"
    model.model_validate(example.body)


def test_the_readme_shows_every_endpoint_family() -> None:
    urls = {(e.method, urlparse(e.url).path) for e in EXAMPLES}
    paths = {p for _, p in urls}
    for path in [
        "/embed/v1/embeddings",
        "/rank/v1/rerank",
        "/generate/v1/chat/completions",
        "/search/v1/search",
        "/rag/v1/chat/completions",
        "/v1/embeddings",
        "/v1/chat/completions",
    ]:
        assert path in paths, f"README has no example of {path}"
    models = {e.body.get("model") for e in EXAMPLES if e.body and "/generate/" in e.url}
    assert {"small", "large", "auto"} <= models, f"generate examples cover {models}"


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    makefile = (ROOT / "Makefile").read_text()
    for target in ("serve", "test"):
        assert f"make {target}" in text
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"Makefile has no {target} target"


@pytest.mark.parametrize(
    "page",
    [README, ROOT / "RELIABILITY.md", *sorted((ROOT / "docs").glob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        resolved = (page.parent / target).resolve()
        assert resolved.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
