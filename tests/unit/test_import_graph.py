"""The product's import graph: no module-level import cycle, and no product module reaches
into the benchmark harness (issue 25: the engine factory once sat in the interface file and
made a circle with the vLLM adapter; benchmark code once lived in carpool/generation/), and
nothing under carpool/ imports the floors above it: router/, pipelines/, deployments/ (issue
44). The twin (carpool_twin/) stands above router/: it runs the router's own flow, and nothing
that serves imports it."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("carpool", "deployments", "router", "pipelines", "carpool_twin")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def _type_checking_block(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imported_names(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> set[str]:
    """What one import statement in module ``name`` names: each module, and for "from pkg
    import x" also ``pkg.x`` (x may be a module); relative imports resolved."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        anchor = name.split(".") if is_package else name.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return {base, *(f"{base}.{alias.name}" for alias in node.names)}


def module_level_imports(name: str, path: Path) -> set[str]:
    """Modules imported when ``name`` is imported: top-level statements only (imports inside
    functions run later and cannot make an import-time circle), minus TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if _type_checking_block(node):
                continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.update(imported_names(node, name, is_package))
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return found


def edges_between(
    modules: dict[str, Path], imports: Callable[[str, Path], set[str]]
) -> dict[str, set[str]]:
    """Which of ``modules`` each one imports (as ``imports`` reads them)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports(name, path):
            # "from pkg import mod" names a module; "from mod import func" names the module.
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def graph() -> dict[str, set[str]]:
    return edges_between(product_modules(), module_level_imports)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_the_scan_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_known_edges() -> None:
    edges = graph()
    # "from carpool.generation.assembly import EngineCore" is an edge to the module.
    assert "carpool.generation.assembly" in edges["carpool.generation.vllm_engine"]
    assert "carpool.generation" in edges  # packages are nodes too


def test_no_module_level_import_cycle_in_the_product() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("package", PACKAGES)
def test_no_product_module_imports_the_benchmark_harness(package: str) -> None:
    offenders = {
        name
        for name, path in product_modules().items()
        if name.split(".")[0] == package
        and any(m == "benchmarks" or m.startswith("benchmarks.") for m in _all_imports(path))
    }
    assert not offenders, f"product modules import benchmarks: {sorted(offenders)}"


def _all_imports(path: Path) -> set[str]:
    """Every import anywhere in the file, deferred ones included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


# Upper floors: carpool/ is the ground floor they build on, so it imports none of them.
UPPER = ("router", "pipelines", "deployments", "carpool_twin")
# What serves requests: none of it imports the twin, which is a planner and simulator above it.
SERVING = ("carpool", "router", "pipelines", "deployments")


def test_the_ground_floor_imports_no_upper_floor() -> None:
    offenders = sorted(
        f"{name} -> {imported}"
        for name, path in product_modules().items()
        if name.split(".")[0] == "carpool"
        for imported in _all_imports(path)
        if imported.split(".")[0] in UPPER
    )
    assert not offenders, f"carpool/ imports an upper floor: {offenders}"


def test_the_twin_stands_above_the_router_and_nothing_serving_imports_it() -> None:
    """The twin drives router.core's own flow (so it imports router/), never the Serve shells
    (pipelines/, deployments/); and no serving module depends on the twin."""
    modules = product_modules()
    twin = {
        imported.split(".")[0]
        for name, path in modules.items()
        if name.split(".")[0] == "carpool_twin"
        for imported in _all_imports(path)
    }
    assert "router" in twin  # the reason it stands where it does
    assert not twin & {"pipelines", "deployments"}, twin
    serving_imports_twin = sorted(
        name
        for name, path in modules.items()
        if name.split(".")[0] in SERVING
        and any(i.split(".")[0] == "carpool_twin" for i in _all_imports(path))
    )
    assert not serving_imports_twin, serving_imports_twin


# --- the benchmark harness and the dashboards (issue 44) --------------------------------------

# Tools beside the product: they may import it, it never imports them (above).
HARNESS = ("benchmarks", "dashboards")
# One job per module: no file of the harness is longer than this.
HARNESS_MAX_LINES = 600
# Files over the limit for now, each with its reason; the allowance fails once it is not needed.
HARNESS_OVERSIZE: dict[str, str] = {}


def harness_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for package in HARNESS
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def every_import(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, deferred ones included, each "from pkg import x" also as
    ``pkg.x`` (x may be a module). The harness's circles ran through imports inside functions
    (twin_validate's command line importing its halves, which imported it), which do not fail
    at import time but tie the modules into one knot all the same."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(imported_names(node, name, is_package))
    return found


def harness_graph() -> dict[str, set[str]]:
    return edges_between(harness_modules(), every_import)


def test_the_harness_graph_sees_deferred_and_submodule_imports() -> None:
    edges = harness_graph()
    # Inside build_parser: "from benchmarks.peers import cli as peers".
    assert "benchmarks.peers.cli" in edges["benchmarks.__main__"]
    # "from benchmarks import path_report, peers, proc_cpu" names three modules.
    assert {"benchmarks.path_report", "benchmarks.peers"} <= edges["benchmarks.path"]


def test_no_import_cycle_in_the_harness() -> None:
    cycle = find_cycle(harness_graph())
    assert cycle is None, " -> ".join(cycle or [])


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_harness_file_is_over_the_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in harness_modules().values()
        if (n := _lines(p)) > HARNESS_MAX_LINES
    }
    unexplained = {f: n for f, n in long.items() if f not in HARNESS_OVERSIZE}
    assert not unexplained, f"over {HARNESS_MAX_LINES} lines, split by job: {unexplained}"


def test_the_oversize_allowance_is_still_needed() -> None:
    for name, why in HARNESS_OVERSIZE.items():
        path = ROOT / name
        assert path.is_file() and _lines(path) > HARNESS_MAX_LINES, (
            f"{name} is within {HARNESS_MAX_LINES} lines now ({why}): drop its allowance"
        )
