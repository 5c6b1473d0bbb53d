"""`die_with_parent`'s check without namespaces: a child whose parent reads as PID 1 lives
when PID 1 is its supervisor, and exits when its supervisor is someone else (that one died and
the child was re-parented). The PID-1 integration test (tests/integration/test_orphans.py)
needs unshare and a PID namespace, and fails, never skips, where it has neither: a skip would
let CI pass without it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration import test_orphans

PROBE = """
import os, sys
os.getppid = lambda: 1  # this child's parent reads as PID 1
from app.engine.orphans import die_with_parent
die_with_parent(int(sys.argv[1]))
sys.exit(7)  # it lived past the check
"""


@pytest.mark.parametrize(("supervisor_pid", "exit_status"), [(1, 7), (4242, 1)])
def test_a_child_lives_only_while_its_own_supervisor_is_its_parent(
    supervisor_pid: int, exit_status: int
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(supervisor_pid)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == exit_status, result.stderr


def _pid_1_test_failure(tmp_path: Path) -> str:
    """The message the PID-1 test fails with; a skip (or a pass) fails this test."""
    try:
        test_orphans.test_a_child_of_a_supervisor_that_is_pid_1_lives(tmp_path)
    except pytest.skip.Exception as skipped:
        pytest.fail(f"the PID-1 test skipped, so CI could pass without it: {skipped}")
    except pytest.fail.Exception as failed:
        return str(failed)
    pytest.fail("the PID-1 test passed")


def test_the_pid_1_test_fails_without_unshare(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "util-linux" in _pid_1_test_failure(tmp_path)


def test_the_pid_1_test_fails_where_no_namespace_can_be_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def refused(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "unshare: Operation not permitted")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/unshare")
    monkeypatch.setattr(subprocess, "run", refused)
    assert "Operation not permitted" in _pid_1_test_failure(tmp_path)
