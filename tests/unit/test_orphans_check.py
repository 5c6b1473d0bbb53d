"""`die_with_parent`'s check, wherever namespaces are refused (the PID-1 integration test
then skips): a child whose parent reads as PID 1 lives when PID 1 is its supervisor, and
exits when its supervisor is someone else (that one died and the child was re-parented)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
