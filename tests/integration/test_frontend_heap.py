"""A front end freezes its start-up heap and raises the first GC generation's threshold once
ready (app/heap.py): without it, every full collection walked the tokenizers', FastAPI's
and pydantic's objects, ~27 ms each under load, and requests in flight set off 160
collections a second.
The engine is a null one, so the freeze can only come from the front end."""

from __future__ import annotations

import gc

from app.heap import GEN0_THRESHOLD
from app.main import create_app
from app.settings import Settings
from loadtest.null_engine import NullEngine
from tests.support.asgi import serving


async def test_a_front_end_freezes_its_start_up_heap_once_ready() -> None:
    gc.unfreeze()
    threshold = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    settings = Settings()
    app = create_app(settings, engine=NullEngine(settings))
    try:
        async with serving(app) as client:
            assert gc.get_freeze_count() > 10_000
            assert gc.get_threshold()[0] == GEN0_THRESHOLD
            response = await client.post("/infer", json={"inputs": "still serving"})
            assert response.status_code == 200
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
