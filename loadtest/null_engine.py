"""One steadyserve front end in front of an engine that computes nothing, to measure the
front end's own cost (`loadtest/frontend_cost.py`).

`python -m loadtest.null_engine` runs `steadyserve serve`'s own process tree
(`app.processes.serve_processes`: supervisor, one front end, the engine process over
ZeroMQ, multiprocess metrics), with one change: the engine's core is `NullEngineCore`
(`loadtest/null_model.py`), the real core with a model whose forward pass is zeros, so every
request is answered as fast as the engine can. Its published backlog is at least
`--backlog-ms`: 0 to measure admitted requests, above `STEADY_MAX_QUEUE_DELAY_MS` to measure
requests refused before their body is read. The front end is the real one, unchanged: the
tokenizer, middleware, routes, validation, serialisation, metrics, and the engine round trip
(encode, send, receive, decode) and status stream.

`NullEngine` is an in-process double of the same engine (on the front end's own event loop,
no IPC) for tests that need a front end alone; `AlwaysReadyEngine` is its base.

    python -m loadtest.null_engine --port 8100 --backlog-ms 0
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import TYPE_CHECKING

import numpy as np

from app.engine.client import StreamingClient
from app.engine.protocol import (
    EmbedOutput,
    EngineStatus,
    Failure,
    FailureKind,
    ModelInfo,
    Output,
    Submit,
    ToEngine,
)
from app.limits import lift_open_file_limit
from app.model_specs import ModelSpec
from app.settings import Settings

if TYPE_CHECKING:
    from app.engine.core import EngineCore
    from app.metrics import Metrics

# all-MiniLM-L6-v2's output width and longest input, as the real engine reports them.
WIDTH = 384
MAX_INPUT_TOKENS = 256


class AlwaysReadyEngine(StreamingClient):
    """An engine double on the front end's own event loop: nothing to start or connect,
    always ready, with a fixed published backlog; a subclass says what the engine reports
    of each model (`model_info`) and how it answers (`_send`). Event loop thread only.

    Also the base of the tests' `ScriptedGenerator` (tests/support/scripted_generator.py).
    """

    engine_id = "double"

    def __init__(self, settings: Settings, backlog_s: float = 0.0) -> None:
        super().__init__(origin=b"double")
        self._settings = settings
        self._backlog_s = backlog_s

    def model_info(self, spec: ModelSpec) -> ModelInfo:
        raise NotImplementedError

    def status(self) -> EngineStatus | None:
        return EngineStatus(
            engine_id=self.engine_id,
            pid=0,
            state="ready",
            warmup_done=0,
            warmup_total=0,
            healthy=True,
            backlog_s=self._backlog_s,
            seconds_per_input=0.0,
            queued_inputs=0,
            published_at=time.monotonic(),
            models={spec.name: self.model_info(spec) for spec in self._settings.models},
        )

    def inputs_in_transit(self, status: EngineStatus) -> int:
        """It takes what is sent the moment it is sent: nothing is ever in transit."""
        return 0

    async def start(self) -> None:
        pass

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        pass

    def refresh_metrics(self) -> None:
        pass

    async def close(self) -> None:
        pass


class NullEngine(AlwaysReadyEngine):
    """Answers every request at once; event loop thread only."""

    engine_id = "null"

    def model_info(self, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(task=spec.task, output_width=WIDTH, max_input_tokens=MAX_INPUT_TOKENS)

    def _send(self, message: ToEngine) -> None:
        if not isinstance(message, Submit):
            return
        rows = len(message.payload.token_ids)
        if self._backlog_s > self._settings.max_queue_delay_ms / 1000:
            self._deliver(Failure(message.request_id, FailureKind.REJECTED, "busy", "queue", 1))
            return
        vectors = np.zeros((rows, WIDTH), dtype=np.float32)
        payload = EmbedOutput(
            vectors.tobytes(), rows, WIDTH, sum(len(ids) for ids in message.payload.token_ids)
        )
        self._deliver(Output(message.request_id, True, payload, queue_s=0.0, compute_s=0.0))


def null_engine_core(settings: Settings, metrics: Metrics, backlog_s: float) -> EngineCore:
    """The `CoreFactory` of the engine process (`app/engine/process.py`), with `backlog_s`
    bound by a partial: `NullEngineCore`, imported there (torch) and nowhere else."""
    from loadtest.null_model import NullEngineCore

    return NullEngineCore(settings, metrics, backlog_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.null_engine")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--backlog-ms", type=float, default=0.0)
    options = parser.parse_args(argv)
    # One front end, as the figure is per front end; a CPU engine: it computes nothing.
    settings = Settings(host="127.0.0.1", port=options.port, frontend_workers=1, device="cpu")
    # Named by its module, not as this `__main__`'s: the engine process unpickles it.
    from app.processes import serve_processes
    from loadtest.null_engine import null_engine_core as factory

    lift_open_file_limit()
    return serve_processes(
        settings, make_core=functools.partial(factory, backlog_s=options.backlog_ms / 1000)
    )


if __name__ == "__main__":
    raise SystemExit(main())
