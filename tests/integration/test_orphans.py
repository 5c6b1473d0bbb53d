"""Children of the supervisor live while it does, and only then: in a container the
supervisor is PID 1 (the image's entry point), which its children must not read as "my
parent died" (they exited at start, every engine and front end, forever)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

CHILD_OF_PID_1 = """
import multiprocessing, os, sys
from app.engine.orphans import die_with_parent

def child(parent_pid):
    die_with_parent(parent_pid)
    sys.exit(7)  # it lived past the check

if __name__ == "__main__":
    assert os.getpid() == 1, os.getpid()
    process = multiprocessing.get_context("spawn").Process(target=child, args=(os.getpid(),))
    process.start()
    process.join()
    print(process.exitcode)
"""


def test_a_child_of_a_supervisor_that_is_pid_1_lives(tmp_path: Path) -> None:
    # Neither condition skips: a skip would let CI pass without this test ever running.
    # `make test` provides unshare (tools/ensure-tools.sh), and CI's machine allows the
    # namespace.
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail(
            "util-linux's unshare is needed to run a process as PID 1: `make test` installs it "
            "(tools/ensure-tools.sh), or apt-get install util-linux"
        )
    script = tmp_path / "pid1.py"
    script.write_text(CHILD_OF_PID_1)
    # A new PID namespace, as a container's: the script is its PID 1.
    command = [unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    sandbox = subprocess.run([*command, "true"], capture_output=True, text=True, timeout=60)
    if sandbox.returncode != 0:
        pytest.fail(
            "cannot make a user and PID namespace here (user namespaces refused by a container "
            f"or a policy such as kernel.unprivileged_userns_clone=0): {sandbox.stderr.strip()}"
        )
    result = subprocess.run(
        [*command, sys.executable, str(script)],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "7", result.stderr
