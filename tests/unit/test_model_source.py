"""Where a model's files are: a path that does not exist is said to be one."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.models.source import resolve_source


@pytest.mark.parametrize("source", ["/models/minilm-typo", "./models/minilm", "~/nope", "a/b/c"])
def test_a_missing_directory_is_named_as_one_not_taken_for_a_hub_id(source: str) -> None:
    with pytest.raises(FileNotFoundError, match="no model directory at"):
        resolve_source(source)


def test_a_directory_or_a_hub_id_resolves(tmp_path: Path) -> None:
    assert resolve_source(str(tmp_path)) == str(tmp_path)
    assert resolve_source("sentence-transformers/all-MiniLM-L6-v2") == (
        "sentence-transformers/all-MiniLM-L6-v2"
    )
