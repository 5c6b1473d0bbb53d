"""/metrics in multiprocess mode: every process's files merged, whatever state a file that
is being created (or was left half-created by a killed process) is in."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from app.metrics import MULTIPROCESS_DIR_ENV, Metrics


def test_an_empty_file_does_not_fail_the_scrape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prometheus_client creates a process's file empty and sizes it just after: read in
    between, it raised struct.error and /metrics answered 500 on every front end."""
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, str(tmp_path))
    written = MmapedDict(str(tmp_path / "counter_101.db"))
    key = mmap_key("steadyserve_demo", "steadyserve_demo_total", [], [], "demo")
    written.write_value(key, 3.0, 0.0)
    written.close()
    (tmp_path / "counter_102.db").touch()  # a process killed between create and size
    text = Metrics().render().decode()
    assert "steadyserve_demo_total 3.0" in text
