"""An engine's published status as tests need one: a ready engine, with what a test changes."""

from __future__ import annotations

from typing import Any

import msgspec

from app.engine.protocol import EngineStatus


def ready_status(engine_id: str, published_at: float, **changes: Any) -> EngineStatus:
    status = EngineStatus(
        engine_id=engine_id,
        pid=1,
        state="ready",
        warmup_done=0,
        warmup_total=0,
        healthy=True,
        backlog_s=0.0,
        seconds_per_input=0.0,
        queued_inputs=0,
        published_at=published_at,
    )
    return msgspec.structs.replace(status, **changes)
