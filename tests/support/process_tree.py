"""Stand-ins for the process tree's children and what it hears of its engine, shared by
the tree's unit tests (tests/unit/test_process_tree_*.py, whose `tree` fixture is in
tests/unit/conftest.py): no child is started."""

from __future__ import annotations

import time

from app.engine.protocol import EngineStatus
from app.processes import ProcessTree


class StandIn:
    """What the tree reads of a child process."""

    def __init__(self, pid: int, alive: bool = True) -> None:
        self.pid = pid
        self.alive = alive
        self.exitcode: int | None = None
        self.killed = False

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.killed, self.alive = True, False


def ready_status(pid: int) -> EngineStatus:
    return EngineStatus(
        engine_id=f"engine-{pid}", pid=pid, state="ready", warmup_done=3, warmup_total=3,
        healthy=True, backlog_s=0.0, seconds_per_input=0.0, queued_inputs=0,
        published_at=time.monotonic(),
    )  # fmt: skip


def hear(tree: ProcessTree, status: EngineStatus, seconds_ago: float = 0.0) -> None:
    """`status` heard `seconds_ago`, and told to the tree as its subscriber tells it."""
    tree._engine_status._status = status
    tree._engine_status._received_at = time.monotonic() - seconds_ago
    tree._engine_said(status)
