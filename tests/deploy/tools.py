"""Locate the real tools the deploy checks drive. A missing tool fails the test that needs it:
`make test` installs every one of them (tools/ensure-tools.sh: promtool; the dev extra: envoy,
kubectl, kubernetes-validate, hadolint), so a skip would only hide a broken install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"


def require_tool(name: str) -> str:
    """The path of `name`: next to this interpreter (venv console scripts) or on PATH."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed (see tools/ensure-tools.sh and the dev extra)")
    return found


def run_tool(*command: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(command), capture_output=True, text=True, timeout=timeout_s, check=False
    )
