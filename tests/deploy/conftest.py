"""Fixtures of the deploy tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.deploy.tools import DEPLOY


@pytest.fixture
def deploy_copy(tmp_path: Path) -> Path:
    """A copy of deploy/ the test may edit."""
    copied = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copied)
    return copied
