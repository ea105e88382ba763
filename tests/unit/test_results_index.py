"""Committed results are the cited ones, listed in one index, and no log is committed.

benchmarks/RESULTS.md lists every result file git tracks under benchmarks/, docs/ and
profiles/ with the document that cites it (or the code that loads it). A new result that
nobody cites, a listed file that is gone, or a tracked ``.log`` fails here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "benchmarks" / "RESULTS.md"
# What counts as a result: data and figures anywhere in these trees, and everything under
# benchmarks/results/ (reports and plans written there too).
RESULT_SUFFIXES = {".json", ".jsonl", ".csv", ".txt", ".png", ".log", ".tsv", ".parquet"}
TREES = ("benchmarks", "docs", "profiles")


def _tracked(*patterns: str) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if (ROOT / line).exists()]


def _is_result(path: str) -> bool:
    return path.startswith("benchmarks/results/") or Path(path).suffix in RESULT_SUFFIXES


def _index() -> dict[str, tuple[str, str]]:
    """file -> (cited by, loaded by), from the index's table."""
    rows = {}
    for line in INDEX.read_text().splitlines():
        match = re.match(r"^\| `([^`]+)` \| (.*?) \| (.*?) \|$", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def test_every_tracked_result_is_in_the_index() -> None:
    results = sorted(p for p in _tracked(*TREES) if _is_result(p))
    missing = [p for p in results if p not in _index()]
    assert not missing, f"add these to benchmarks/RESULTS.md with what cites them: {missing}"


def test_every_index_entry_is_tracked() -> None:
    tracked = set(_tracked(*TREES))
    gone = [p for p in _index() if p not in tracked]
    assert not gone, f"benchmarks/RESULTS.md lists files git does not track: {gone}"


def test_every_entry_is_cited_where_the_index_says_or_loaded() -> None:
    for path, (cited, loaded) in _index().items():
        docs = re.findall(r"\]\(([^)]+)\)", cited)
        assert docs or loaded.strip("` -"), f"{path}: nothing cites or loads it; remove it"
        directory = str(Path(path).parent) + "/"
        for link in docs:
            doc = (INDEX.parent / link).resolve()
            text = doc.read_text()
            assert path in text or directory in text, f"{path}: {link} does not cite it"


def test_no_log_file_is_tracked() -> None:
    logs = _tracked("*.log")
    assert not logs, f"logs are not committed (git rm them): {logs}"
