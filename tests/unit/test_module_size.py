"""Small modules with one job each (docs/ARCHITECTURE.md, §8): no Python file of the
project passes MAX_LINES; app/settings.py once reached 404 unnoticed."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400


def test_no_module_passes_the_line_limit() -> None:
    files = [path for tree in ("app", "tests", "loadtest") for path in (ROOT / tree).rglob("*.py")]
    assert len(files) > 100  # the trees were found
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in files
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not too_long, f"split these by job: {too_long}"
