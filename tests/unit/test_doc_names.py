"""Every doc stays true to the repository: each repository path a doc names exists, and each
`steadyserve_*` metric it names is in the server's registry.

The docs are every docs/*.md and every README.md in the tree (hidden folders such as .venv and
.pytest_cache, node_modules, build outputs and the folders .gitignore lists left out).

A path is what follows a top-level folder of the repository (`app/`, `tests/`, `loadtest/`,
`deploy/`, `docs/`, `tools/`), not inside another path (`../shared/tools/flood.sh` lies outside
the repository). Paths under a folder .gitignore lists by its path (`loadtest/results/`) are
what runs write there, not repository files, and are not checked.

docs/BENCHMARKS.md is a dated log: a section may name a file as it was at the commit it
measured. CI may not have that history (a shallow clone), so the rule does not read it: a
path the log names that is gone must be in `MOVED`, old path -> where it went, and every
paragraph that names it must also name the new one (so a reader finds it: "`old`, since
moved to `new`"). `MOVED` is checked too: each old path is gone, each new one exists, and the
log names each old one. Every other doc names current paths only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from app.metrics import Metrics
from tests.support.registry import exported_names
from tests.support.server import REPO_ROOT

PATH_PATTERN = re.compile(r"(?<![\w./-])((?:app|tests|loadtest|deploy|docs|tools)/[\w./-]*\w/?)")
METRIC_PATTERN = re.compile(r"\bsteadyserve_[a-z0-9_]+\b")
LOG = REPO_ROOT / "docs" / "BENCHMARKS.md"
# Files docs/BENCHMARKS.md names as they were when measured: where each went since.
MOVED = {
    "tests/integration/test_generation_engine.py": "tests/integration/generation_engine/",
    "tests/support/tiny_causal_lm.py": "loadtest/tiny_causal_lm.py",
}
_SKIPPED_FOLDERS = frozenset({"node_modules", "__pycache__", "build", "dist"})


def ignored_folders() -> tuple[str, ...]:
    """The folders .gitignore lists by a path inside the repository (`loadtest/results/`)."""
    lines = (REPO_ROOT / ".gitignore").read_text().splitlines()
    return tuple(line for line in lines if re.fullmatch(r"[\w-]+(/[\w-]+)+/", line))


def shipped_docs() -> list[Path]:
    docs = sorted((REPO_ROOT / "docs").glob("*.md"))
    for folder, subfolders, files in os.walk(REPO_ROOT):
        subfolders[:] = [
            name
            for name in subfolders
            if not name.startswith(".")
            and name not in _SKIPPED_FOLDERS
            and not f"{Path(folder, name).relative_to(REPO_ROOT)}/".startswith(ignored_folders())
        ]
        if "README.md" in files:
            docs.append(Path(folder, "README.md"))
    return docs


DOCS = shipped_docs()


def _name(doc: Path) -> str:
    return str(doc.relative_to(REPO_ROOT))


def test_every_doc_and_readme_is_checked() -> None:
    names = {_name(doc) for doc in DOCS}
    assert {
        "README.md",
        "deploy/README.md",
        "deploy/envoy/README.md",
        "loadtest/README.md",
        "docs/ARCHITECTURE.md",
        "docs/BENCHMARKS.md",
        "docs/SPIKES.md",
    } <= names, names
    assert not any(name.startswith(".") for name in names)  # no .venv, no .pytest_cache
    assert "loadtest/results/" in ignored_folders()


def repository_paths(text: str) -> set[str]:
    return {path for path in PATH_PATTERN.findall(text) if not path.startswith(ignored_folders())}


def missing_paths(text: str, is_log: bool) -> list[str]:
    """The repository paths `text` names that do not exist (in the log, a `MOVED` path whose
    every paragraph names its new place excepted)."""
    missing = sorted(path for path in repository_paths(text) if not (REPO_ROOT / path).exists())
    if not is_log:
        return missing
    paragraphs = text.split("\n\n")
    return [
        path
        for path in missing
        if path not in MOVED or any(path in p and MOVED[path] not in p for p in paragraphs)
    ]


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = missing_paths(doc.read_text(), is_log=doc == LOG)
    assert not missing, f"{_name(doc)} names paths that do not exist: {missing}"


def test_the_moved_paths_are_gone_and_their_new_places_exist() -> None:
    log = LOG.read_text()
    for old, new in MOVED.items():
        assert not (REPO_ROOT / old).exists(), f"{old} exists: drop it from MOVED"
        assert (REPO_ROOT / new).exists(), new
        assert old in log, f"docs/BENCHMARKS.md no longer names {old}: drop it from MOVED"


def test_the_path_check_can_fail() -> None:
    architecture = repository_paths((REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text())
    assert {"app/dispatcher.py", "app/checkconfig/"} <= architecture
    assert repository_paths("see `../shared/tools/flood.sh` and /work/shared/tools/x") == set()
    assert missing_paths("`loadtest/results/bench-1/` and tests/unit/gone.py", False) == [
        "tests/unit/gone.py"
    ]
    # The log's moved paths: outside the log they fail; in it, only with the new place
    # missing from a paragraph that names the old one.
    log = LOG.read_text()
    assert missing_paths(log, is_log=True) == []
    assert missing_paths(log, is_log=False) == sorted(MOVED)
    old = "tests/integration/test_generation_engine.py"
    stale = log.replace(f"`{old}`, since split into\n`{MOVED[old]}`", f"`{old}`", 1)
    assert stale != log
    assert missing_paths(stale, is_log=True) == [old]


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_metric_a_doc_names_is_in_the_registry(doc: Path) -> None:
    exported = exported_names() | {family.name for family in Metrics().registry.collect()}
    named = set(METRIC_PATTERN.findall(doc.read_text()))
    assert not named - exported, f"{_name(doc)}: {sorted(named - exported)}"


def test_the_metric_check_reads_names() -> None:
    names = {name for doc in DOCS for name in METRIC_PATTERN.findall(doc.read_text())}
    assert {"steadyserve_request_duration_seconds", "steadyserve_refusals_paused_total"} <= names
