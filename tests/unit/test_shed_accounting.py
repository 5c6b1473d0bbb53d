"""Shedding before the body is read counts the work this front end has let in but the
engine has not seen yet: without it, a burst of connections resending at once all pass on a
stale published backlog, have their bodies read and tokenized, and are then refused by the
engine (docs/BENCHMARKS.md)."""

from __future__ import annotations

from typing import Any

from app.admission import RejectReason
from app.engine.protocol import EngineStatus, ModelInfo
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.service import Service
from app.settings import Settings
from loadtest.null_engine import AlwaysReadyEngine

# 10 ms per queued input against a 100 ms budget: ten inputs fit.
SECONDS_PER_INPUT = 0.010
BUDGET_MS = 100.0


class PublishedStatus(AlwaysReadyEngine):
    """An engine whose status the test publishes by hand (event loop thread only)."""

    def __init__(self, settings: Settings, least_own_compute_s: float) -> None:
        super().__init__(settings)
        self.backlog_s = 0.0
        self.published_at = 1.0
        self.least_own_compute_s = least_own_compute_s

    def model_info(self, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(task=spec.task, output_width=384, max_input_tokens=256)

    def status(self) -> EngineStatus | None:
        ready = super().status()
        assert ready is not None
        return EngineStatus(
            **{
                **{f: getattr(ready, f) for f in ready.__struct_fields__},
                "backlog_s": self.backlog_s,
                "seconds_per_input": SECONDS_PER_INPUT,
                "published_at": self.published_at,
                "least_own_compute_s": self.least_own_compute_s,
            }
        )


async def started_service(least_own_compute_s: float = 0.0) -> tuple[Service, PublishedStatus]:
    settings = Settings(max_queue_delay_ms=BUDGET_MS, max_inflight=1000)
    engine = PublishedStatus(settings, least_own_compute_s)

    def no_tokenizer(spec: ModelSpec, largest: int) -> Any:
        return object()

    service = Service(settings, Metrics(), engine, tokenizer_loader=no_tokenizer)
    await service.start()
    return service, engine


def let_in(service: Service) -> int:
    """Requests `shed` lets in before the first refusal (queue), each left in flight."""
    count = 0
    while (refused := service.shed(None)) is None:
        count += 1
    assert refused.reason is RejectReason.QUEUE
    return count


async def test_requests_let_in_but_not_yet_sent_count_as_queued_work() -> None:
    service, _ = await started_service()
    # With nothing queued ahead one is always let in; then each waits behind the last.
    assert let_in(service) == 11


async def test_sent_requests_count_until_the_engine_publishes_them_then_leaving_frees_room() -> (
    None
):
    service, engine = await started_service()
    assert let_in(service) == 11
    with service.at_engine(1), service.at_engine(1):
        # Sent: still counted (the engine has not published them yet), so still full.
        assert service.shed(None) is not None
        # The engine publishes a status that holds the two sent: the same total.
        engine.backlog_s, engine.published_at = 2 * SECONDS_PER_INPUT, 2.0
        assert service.shed(None) is not None
    service.leave()
    service.leave()
    # Answered and gone: the engine's next status no longer holds them, 9 wait unsent.
    engine.backlog_s, engine.published_at = 0.0, 3.0
    assert let_in(service) == 2


async def test_the_engines_least_own_compute_counts_as_the_engine_counts_it() -> None:
    # The engine admits a request only while backlog + its own batch's compute fits the
    # budget; a front end that left the latter out let in requests the engine refused
    # (in a 3x open loop, 6,915 in 10 s: docs/BENCHMARKS.md). 30 ms of it leaves room
    # for 7 queued inputs of 10 ms after the first.
    service, _ = await started_service(least_own_compute_s=0.030)
    assert let_in(service) == 8
