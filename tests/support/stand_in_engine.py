"""What the engine-level unit tests share: settings for an `EngineCore` over stand-in models
(`fake_model.GatedLoader`: no file, no warm-up, one compute thread), and a request's final
answer from a core (a final `Output`, or a `Failure`)."""

from __future__ import annotations

import asyncio
from typing import Any

from app.engine.core import EngineCore
from app.engine.protocol import Failure, FromEngine, Output, Submit
from app.model_specs import ModelSpec
from app.settings import Settings

FRONT_END = b"front-end"


def stand_in_settings(*models: str, **overrides: Any) -> Settings:
    """Settings serving embedding models `models` (each from no file: the stand-in loader
    builds them), two length buckets, batches at once, one compute thread; `overrides` on
    top."""
    defaults: dict[str, Any] = {
        "length_buckets": (16, 32),
        "max_wait_ms": 0,
        "warmup": False,
        "spike_reports": False,
        "dispatcher_threads": 1,
        "torch_threads": 1,
    }
    specs = tuple(ModelSpec(name=name, source="unused") for name in models)
    return Settings(models=specs, **{**defaults, **overrides})


def submitted(
    core: EngineCore, request: Submit, origin: bytes = FRONT_END
) -> asyncio.Future[FromEngine]:
    """Submit `request` as sent by `origin`; the future of its final answer."""
    done: asyncio.Future[FromEngine] = asyncio.get_running_loop().create_future()

    def emit(message: FromEngine) -> None:
        if isinstance(message, Failure) or (isinstance(message, Output) and message.final):
            done.set_result(message)

    core.submit(origin, request, emit)
    return done


async def final_answer(core: EngineCore, request: Submit, origin: bytes = FRONT_END) -> FromEngine:
    """`request`'s final answer, within 10 s."""
    return await asyncio.wait_for(submitted(core, request, origin), 10)
