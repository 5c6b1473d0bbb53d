"""The README's settings table is the one `steadyserve settings` prints."""

from __future__ import annotations

from pathlib import Path

from app.settings import settings_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_setting_as_the_code_describes_it() -> None:
    assert settings_table() in README.read_text(), "run `steadyserve settings` and paste it"


def test_readme_gives_the_two_commands() -> None:
    text = README.read_text()
    assert "make serve" in text and "make test" in text
