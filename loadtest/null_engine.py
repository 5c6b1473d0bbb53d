"""One steadyserve front end in front of a null engine, to measure the front end's own cost.

The null engine speaks the engine protocol (`app.engine.client.StreamingClient`) but
computes nothing: every request is answered at once with zero vectors of the model's width,
and its published backlog is fixed (`--backlog-ms`): 0 to measure admitted requests, above
`STEADY_MAX_QUEUE_DELAY_MS` to measure requests refused before their body is read. The real
tokenizer, middleware, routes, validation, serialisation and metrics all run.

    python -m loadtest.null_engine --port 8100 --backlog-ms 0
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from app.cli import run_uvicorn
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
from app.frontend_process import configure_logging
from app.main import create_app
from app.model_specs import ModelSpec
from app.settings import Settings

WIDTH = 384


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
        return ModelInfo(task=spec.task, output_width=WIDTH, max_input_tokens=256)

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.null_engine")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--backlog-ms", type=float, default=0.0)
    options = parser.parse_args(argv)
    settings = Settings(host="127.0.0.1", port=options.port, engine="process")
    configure_logging(settings.log_level, "null-engine")
    app = create_app(settings, engine=NullEngine(settings, options.backlog_ms / 1000))
    return run_uvicorn(app, settings)


if __name__ == "__main__":
    raise SystemExit(main())
