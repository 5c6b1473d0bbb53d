"""A decoding generate model does not have the engine send its status at every tick: its
next dispatch (its step time, averaged over every step) is in every other model's published
wait, and each step's jitter moved it, so `worth_publishing` found every tick's status
changed (~200 a second, each encoded, sent and decoded by every front end). A model's wait
is sent again once it moved more than `WAIT_TOLERANCE_S` (or `WAIT_TOLERANCE_SHARE`)."""

from __future__ import annotations

import random

import msgspec
import pytest

from app.engine.core import EngineCore
from app.engine.generation_steps import STEP_TIME_SMOOTHING
from app.engine.process import WAIT_TOLERANCE_S, worth_publishing
from app.engine.protocol import EngineStatus
from app.engine.zmq_client import STATUS_HEARTBEAT_S, STATUS_INTERVAL_S
from app.metrics import Metrics
from app.model_queues import BatchCost, ModelWork
from app.settings import Settings
from tests.support.stand_in_host import StandInHost


def decoding_beside_idle_embedders() -> tuple[EngineCore, StandInHost]:
    core = EngineCore(Settings(dispatcher_threads=1, torch_threads=1), Metrics())
    cost = BatchCost(0.010, 4, 0.040, 0.010)
    idle = ModelWork(0.0, 0.0, 0.0, turns=0)
    generator = StandInHost("generate", ModelWork(0.0, 0.0, 0.005, turns=1000), None)
    core.hosts = {  # type: ignore[assignment]
        "minilm": StandInHost("embed", idle, cost),
        "bge": StandInHost("embed", idle, cost),
        "tiny": generator,
    }
    core._ready = True
    return core, generator


def at(status: EngineStatus, tick: int) -> EngineStatus:
    return msgspec.structs.replace(status, published_at=tick * STATUS_INTERVAL_S)


def test_a_decoding_model_whose_step_time_jitters_is_not_sent_at_every_tick() -> None:
    core, generator = decoding_beside_idle_embedders()
    jitter = random.Random(7)
    step_s = 0.005
    ticks = 400  # 2 s
    sent: EngineStatus | None = None
    sends = 0
    for tick in range(ticks):
        measured = 0.005 * jitter.uniform(0.9, 1.1)  # a step a tick, +-10 %
        step_s = (1 - STEP_TIME_SMOOTHING) * step_s + STEP_TIME_SMOOTHING * measured
        generator.current = ModelWork(0.0, 0.0, step_s, turns=1000)
        status = at(core.status(), tick)
        if worth_publishing(status, sent):
            sent, sends = status, sends + 1
    heartbeats = ticks * STATUS_INTERVAL_S / STATUS_HEARTBEAT_S
    assert sends <= heartbeats + 5, sends  # it was every tick: 400


def test_a_wait_that_moved_beyond_the_tolerance_is_sent_at_once() -> None:
    core, generator = decoding_beside_idle_embedders()
    sent = at(core.status(), 0)
    assert not worth_publishing(at(core.status(), 1), sent)
    generator.current = ModelWork(0.0, 0.0, 0.005 + WAIT_TOLERANCE_S / 2, turns=1000)
    assert not worth_publishing(at(core.status(), 2), sent)
    generator.current = ModelWork(0.0, 0.0, 0.005 + 2 * WAIT_TOLERANCE_S, turns=1000)
    moved = at(core.status(), 3)
    assert worth_publishing(moved, sent)
    queue = moved.models["minilm"].queue
    assert queue is not None and queue.backlog_s == pytest.approx(0.007)  # as it is now
    # Anything else of a model's queue is sent at once, its wait within tolerance or not.
    generator.current = ModelWork(0.0, 0.0, 0.005, turns=1000, at_cap=True)
    assert worth_publishing(at(core.status(), 4), sent)
