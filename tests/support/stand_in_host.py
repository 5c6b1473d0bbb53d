"""A model host standing in for one in an `EngineCore` (`ModelHost`, the parts the core's
status, admission and gauges read): its task, its work and batch cost as the test sets
them, its queued inputs; it notes each `EngineLoad` it is asked to admit under and answers
`verdict` (None: admitted, then queued by `submit`, answered never)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.admission import Rejected
from app.engine.host import Emit, EngineLoad
from app.engine.protocol import ModelInfo, Submit
from app.model_queues import NO_WORK, BatchCost, ModelWork

SMALL_COST = BatchCost(0.001, 32, 0.03, 0.001)


@dataclass
class StandInHost:
    task: str = "embed"
    current: ModelWork = NO_WORK
    cost: BatchCost | None = SMALL_COST  # None: queues no batches
    queued: int = 0
    verdict: Rejected | None = None
    loads: list[EngineLoad] = field(default_factory=list)

    def info(self) -> ModelInfo:
        return ModelInfo(self.task, 4, 64)

    def queued_inputs(self) -> int:
        return self.queued

    @property
    def queues_batches(self) -> bool:
        return self.cost is not None

    def batch_cost(self) -> BatchCost | None:
        return self.cost

    def work(self, now: float) -> ModelWork:
        return self.current

    def admit(self, request: Submit, load: EngineLoad) -> Rejected | None:
        self.loads.append(load)
        return self.verdict

    def submit(self, request: Submit, emit: Emit) -> None:
        self.queued += 1  # queued: answered later

    def refresh_gauges(self) -> None:
        pass
