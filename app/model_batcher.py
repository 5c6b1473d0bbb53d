"""The batcher of a token-input model: `Batcher` over token ids, run through the model's
`BufferPool`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from app.batcher import Batcher
from app.buffers import BufferPool
from app.compute_slots import ComputeSlots
from app.dispatcher import Dispatcher
from app.execute import BatchOutput, run_batch, warmup_token_ids
from app.metrics import Metrics
from app.models.base import ModelRunner
from app.scheduler import BatchPolicy, BatchShape


class ModelBatcher(Batcher[list[int], npt.NDArray[np.float32]]):
    """The batcher of a token-input model (`ModelRunner`): rows are token ids, batches run
    through the model's `BufferPool` (`execute.run_batch`), each input's answer is its
    output row. Event loop thread only."""

    def __init__(
        self,
        runner: ModelRunner,
        policy: BatchPolicy,
        pool: BufferPool,
        dispatcher: Dispatcher,
        slots: ComputeSlots,
        metrics: Metrics,
        clock: Callable[[], float],
        on_batch_done: Callable[[BaseException | None], None] = lambda error: None,
        before_batch: Callable[[], None] = lambda: None,
        lost_device_before: Callable[[BaseException], bool] = lambda error: False,
    ) -> None:
        self.runner = runner
        self.pool = pool
        super().__init__(
            runner.name,
            policy,
            self._run_tokens,
            len,
            dispatcher,
            slots,
            metrics,
            clock,
            on_batch_done,
            before_batch,
            lost_device_before,
        )

    def _run_tokens(self, shape: BatchShape, token_ids: Sequence[list[int]]) -> BatchOutput:
        """Compute threads only."""
        policy = self.scheduler.policy
        return run_batch(
            self.pool,
            self.runner,
            shape,
            token_ids,
            self._dispatcher.stream(),
            lambda rows: BatchShape(policy.padded_batch(shape.length, rows), shape.length),
        )

    async def warm_up(
        self, filler_token_id: int, on_shape_done: Callable[[int, int], None]
    ) -> None:
        """`warm_up_rows` with full rows of `filler_token_id`."""
        await self.warm_up_rows(
            lambda shape: warmup_token_ids(shape, filler_token_id), on_shape_done
        )
