"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.processes import ProcessTree
from app.settings import Settings
from tests.support.process_tree import StandIn


@pytest.fixture
async def tree(tmp_path: Path) -> AsyncIterator[ProcessTree]:
    tree = ProcessTree(Settings(), tmp_path)
    tree.frontends = [StandIn(10)]  # type: ignore[list-item]
    tree._heartbeats.started(0)  # its start-up succeeded (now, on the tree's real clock)
    yield tree
    tree._zmq.destroy(linger=0)
