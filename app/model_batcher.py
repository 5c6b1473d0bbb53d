"""The batcher of a token-input model: `Batcher` over token ids, run through the model's
`BufferPool`, its rows with a NaN or an infinity failed (500 `non_finite_output`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from app.batch_rerun import RowsFailed
from app.batch_trace import ComputedBatch
from app.batcher import Batcher
from app.buffers import BufferPool
from app.compute_slots import ComputeSlots
from app.dispatcher import Dispatcher
from app.execute import BatchOutput, run_batch, warmup_token_ids
from app.failures import NonFiniteOutput
from app.metrics import Metrics
from app.models.base import ModelRunner
from app.scheduler import BatchPolicy, BatchShape

log = logging.getLogger(__name__)


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

    def rows_failed(self, output: ComputedBatch[npt.NDArray[np.float32]]) -> RowsFailed | None:
        """The rows of a batch holding a NaN or an infinity (`BatchOutput.non_finite`, found
        on the compute thread), logged once a batch: each fails 500 `non_finite_output`
        (JSON has no NaN); a batch of which every row does counts toward the model's ill
        health, as one that raised: a model computing NaN for every input turns /healthz
        unhealthy, one input that overflows does not (`RowsFailed`)."""
        assert isinstance(output, BatchOutput)  # what `_run_tokens` returns
        if not output.non_finite:
            return None
        log.error(
            "%s: non-finite output (NaN or inf) in %d of the %d rows of a batch: failing "
            "them (500 non_finite_output); does the model overflow its dtype (%s)?",
            self.name,
            len(output.non_finite),
            len(output.rows),
            self.runner.dtype,
        )
        return RowsFailed(frozenset(output.non_finite), NonFiniteOutput.of(self.name))

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
