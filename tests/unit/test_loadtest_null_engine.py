"""The front-end cost bench's engine (loadtest/null_engine.py, null_model.py).

It was a double on the front end's own event loop: requests answered by a direct call and a
status built in place, so the bench priced a front end with no engine round trip at all. It
is now the real engine core, with a model that computes nothing, served by the real engine
process over ZeroMQ (`serve_processes` with a `CoreFactory`). Here its core is served over
real ZeroMQ sockets to the front end's real client, on the test's event loop; the bench
itself runs end to end in tests/e2e/test_overload_bench_e2e.py."""

from __future__ import annotations

import asyncio
import functools
import pickle
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.admission import Rejected
from app.engine.process import EngineServer
from app.engine.protocol import EmbedOutput, EmbedPayload, Submit
from app.engine.zmq_client import EngineAddresses, ZmqEngineClient
from app.metrics import Metrics
from app.settings import Settings
from loadtest import null_engine
from loadtest.null_engine import WIDTH, null_engine_core

SETTINGS = Settings(length_buckets=(16, 32), max_batch_size=8, spike_reports=False)


@pytest.fixture
def backlog_s() -> float:
    return 0.0


@pytest.fixture
async def client(tmp_path: Path, backlog_s: float) -> AsyncIterator[ZmqEngineClient]:
    """A front end's engine client, connected to the bench's engine core served over
    ZeroMQ by the engine process's own `EngineServer`, and ready."""
    addresses = EngineAddresses.in_directory(tmp_path)
    core = null_engine_core(SETTINGS, Metrics(), backlog_s)
    stop = asyncio.Event()
    serving = asyncio.create_task(EngineServer(core, addresses).serve(stop))
    client = ZmqEngineClient(addresses)
    await client.start()
    try:
        await client.wait_ready(60)
        yield client
    finally:
        stop.set()
        await serving
        await client.close()


def _submit(client: ZmqEngineClient, token_ids: list[list[int]]) -> Submit:
    model = SETTINGS.models[0].name
    return Submit(client.next_request_id(), model, time.monotonic() + 10, EmbedPayload(token_ids))


async def test_the_engine_answers_over_zeromq_with_a_null_models_zeros(
    client: ZmqEngineClient,
) -> None:
    status = client.status()  # heard on the status socket
    assert status is not None and status.state == "ready"
    assert status.models[SETTINGS.models[0].name].output_width == WIDTH
    outputs = [output async for output in client.stream(_submit(client, [[1, 5, 2], [1, 2]]))]
    [output] = outputs
    assert output.final
    assert isinstance(output.payload, EmbedOutput)
    assert (output.payload.rows, output.payload.width) == (2, WIDTH)
    vectors = np.frombuffer(output.payload.vectors, dtype=np.float32)
    assert vectors.shape == (2 * WIDTH,) and not vectors.any()


@pytest.mark.parametrize("backlog_s", [10.0])
async def test_a_fixed_backlog_is_published_and_refused_by_the_engine_too(
    client: ZmqEngineClient, backlog_s: float
) -> None:
    status = client.status()
    assert status is not None and status.backlog_s >= backlog_s  # front ends shed on it
    with pytest.raises(Rejected):
        async for _ in client.stream(_submit(client, [[1, 2]])):
            pass


def test_the_bench_serves_steadyserves_process_tree_with_the_null_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served: dict[str, Any] = {}

    def serve_processes(settings: Settings, make_core: Any = None) -> int:
        served.update(settings=settings, make_core=make_core)
        return 0

    monkeypatch.setattr("app.processes.serve_processes", serve_processes)
    monkeypatch.setattr(null_engine, "lift_open_file_limit", lambda: None)
    assert null_engine.main(["--port", "8123", "--backlog-ms", "250"]) == 0
    settings: Settings = served["settings"]
    assert (settings.engine, settings.frontend_workers, settings.port) == ("process", 1, 8123)
    # The engine process is spawned: its core factory travels pickled, by module name.
    factory = pickle.loads(pickle.dumps(served["make_core"]))
    assert isinstance(factory, functools.partial)
    assert factory.func is null_engine_core
    assert factory.keywords == {"backlog_s": 0.25}
