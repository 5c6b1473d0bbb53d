"""The README's settings table is the one `steadyserve settings` prints, and the metrics the
READMEs name are the server's."""

from __future__ import annotations

import re
from pathlib import Path

from app.metrics import Metrics
from app.settings import settings_table
from tests.support.registry import exported_names

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_setting_as_the_code_describes_it() -> None:
    assert settings_table() in README.read_text(), "run `steadyserve settings` and paste it"


def test_readme_gives_the_two_commands() -> None:
    text = README.read_text()
    assert "make serve" in text and "make test" in text


def test_every_metric_a_readme_names_is_in_the_registry() -> None:
    readmes = [README, *sorted(README.parent.glob("*/README.md"))]
    named = {
        (readme.relative_to(README.parent), name)
        for readme in readmes
        for name in re.findall(r"\bsteadyserve_[a-z0-9_]+\b", readme.read_text())
    }
    assert any(name == "steadyserve_refusals_paused_total" for _, name in named)
    exported = exported_names() | {family.name for family in Metrics().registry.collect()}
    assert not {pair for pair in named if pair[1] not in exported}
