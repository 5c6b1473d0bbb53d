"""docs/ARCHITECTURE.md stays true: its module list is the tree's, its metrics table names every
metric in the server's registry, every section the code cites exists, and nothing cites the
design file outside the repository any more. (That every path and metric name it writes
exists, as in every doc: tests/unit/test_doc_names.py.)"""

from __future__ import annotations

import re
from pathlib import Path

from app.metrics import Metrics
from app.scheduler import CloseReason
from tests.support.server import REPO_ROOT

DOC = REPO_ROOT / "docs" / "ARCHITECTURE.md"
CITATION_PATTERN = re.compile(r"docs/ARCHITECTURE\.md §(\d+)")
# The design notes live outside the repository: nothing shipped may send readers there.
OUTSIDE_DESIGN = "DESIGN" + ".md"
SOURCES = ("app", "tests", "loadtest")


def _module_list() -> list[Path]:
    """The paths ARCHITECTURE.md §2 lists, folders by their indentation."""
    block = DOC.read_text().split("## 2. Modules", 1)[1].split("```", 2)[1]
    folders = {0: REPO_ROOT}  # indentation -> the folder its names are in
    paths = []
    for line in block.splitlines():
        match = re.match(r"^( *)([\w.]+/?)(\s|$)", line)
        if not match:
            continue
        depth, name = len(match.group(1)), match.group(2)
        path = folders[depth] / name
        if name.endswith("/"):
            folders[depth + 2] = path
        paths.append(path)
    return paths


def test_every_module_in_the_module_list_exists() -> None:
    paths = _module_list()
    for path in paths:
        assert path.exists(), f"{path.relative_to(REPO_ROOT)} (ARCHITECTURE.md §2)"
    assert len(paths) > 20


def test_the_module_list_names_every_module_of_the_folders_it_opens() -> None:
    """A folder listed with modules under it lists all of them (one listed alone, such as
    `checkconfig/`, is described as a whole)."""
    listed = set(_module_list())
    opened = {REPO_ROOT / "app"} | {path.parent for path in listed if path.suffix == ".py"}
    missing = sorted(
        str(module.relative_to(REPO_ROOT))
        for folder in opened
        for module in folder.glob("*.py")
        if module.name != "__init__.py" and module not in listed
    )
    assert not missing, f"add to ARCHITECTURE.md §2: {missing}"


def test_every_metric_in_the_registry_is_in_the_doc() -> None:
    named = set(re.findall(r"\bsteadyserve_[a-z0-9_]+\b", DOC.read_text()))
    # As the doc names them: a counter with its `_total`, a histogram by its family name.
    ours = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in Metrics().registry.collect()
        if family.name.startswith("steadyserve_")
    }
    assert not ours - named, sorted(ours - named)


def test_section_citations_in_the_code_point_at_sections_that_exist() -> None:
    sections = set(re.findall(r"^## (\d+)\. ", DOC.read_text(), flags=re.MULTILINE))
    cited: set[str] = set()
    shipped = [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")]
    shipped += [p for root in SOURCES for p in (REPO_ROOT / root).rglob("*") if p.is_file()]
    for path in shipped:
        if path.suffix in (".py", ".md", ".sh", ".yaml"):
            text = path.read_text()
            assert OUTSIDE_DESIGN not in text, f"{path} cites {OUTSIDE_DESIGN} (not in the repo)"
            cited |= set(CITATION_PATTERN.findall(text))
    assert cited, "module docstrings cite docs/ARCHITECTURE.md sections"
    assert cited <= sections, sorted(cited - sections)


def _section(number: int) -> str:
    return DOC.read_text().split(f"\n## {number}. ", 1)[1].split("\n## ", 1)[0]


def test_the_compute_threads_row_names_every_batch_executor() -> None:
    """§3 said every batch runs through `execute.run_batch`: a `tensor` model's runs
    through `tensor_batch.py`'s executor."""
    from app.execute import run_batch
    from app.tensor_batch import run_tensor_batch

    [row] = [line for line in _section(3).splitlines() if line.startswith("| engine: compute")]
    for executor in (run_batch, run_tensor_batch):
        assert f"`{executor.__module__.removeprefix('app.')}.{executor.__name__}`" in row


def test_the_request_path_closes_a_batch_on_the_scheduler_s_reasons() -> None:
    """§4 said a batch closes on the "oldest deadline": `Scheduler.poll` closes on the
    earliest, the most urgent input's (`CloseReason.DEADLINE`)."""
    match = re.search(r"Scheduler\.poll closes a batch \(([^)]*)\)", _section(4))
    assert match is not None
    reasons = [reason.split(":")[0].strip() for reason in match.group(1).split("|")]
    assert reasons == ["full", "max wait", "earliest deadline"]
    assert [reason.name for reason in CloseReason] == ["FULL", "MAX_WAIT", "DEADLINE"]
