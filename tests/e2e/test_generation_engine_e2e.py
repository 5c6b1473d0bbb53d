"""A generate model in the real engine process: streamed over ZeroMQ, and when the engine
is killed mid-sequence the open stream fails retryably (engine lost), the supervisor starts
a new engine, and it serves the model again. Real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from app.admission import Rejected, RejectReason
from app.engine.protocol import FinishReason, GeneratePayload, SamplingParams, Submit
from app.engine.zmq_client import ZmqEngineClient
from app.metrics import MULTIPROCESS_DIR_ENV
from app.model_specs import ModelSpec
from app.settings import Settings
from loadtest.generation_phases import supervised_engine

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


def request(client: ZmqEngineClient, max_new_tokens: int) -> Submit:
    return Submit(
        client.next_request_id(),
        "tiny",
        time.monotonic() + 60,
        GeneratePayload([1, 40, 41, 42], SamplingParams(max_new_tokens=max_new_tokens)),
    )


async def test_a_killed_generation_engine_is_replaced(
    tiny_causal_lm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    # The engine processes (spawned) write their metrics there, as under `serve`.
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, str(metrics_dir))
    settings = Settings(
        models=(ModelSpec(name="tiny", task="generate", source=str(tiny_causal_lm)),),
        generate_slots=4,
        generate_slot_tokens=512,
        generate_max_batch_tokens=512,
        length_buckets=(16, 64),
        torch_threads=1,
        engine_restart_backoff_s=(0.2, 1.0),
        max_queue_delay_ms=10_000,
    )
    async with supervised_engine(settings) as (client, supervisor):
        status = client.status()
        assert status is not None and status.models["tiny"].task == "generate"
        first_pid = status.pid

        tokens: list[int] = []
        killed = False
        with pytest.raises(Rejected) as lost:
            async for output in client.stream(request(client, 500)):
                tokens.extend(output.payload.token_ids)  # type: ignore[union-attr]
                if len(tokens) >= 3 and not killed:  # an output may carry several tokens
                    os.kill(first_pid, signal.SIGKILL)
                    killed = True
        assert lost.value.reason is RejectReason.ENGINE_LOST
        assert 3 <= len(tokens) < 500

        give_up_at = time.monotonic() + 120
        while (status := client.status()) is None or status.pid == first_pid:
            assert time.monotonic() < give_up_at, "no new engine"
            await asyncio.sleep(0.05)  # polling interval: the published status is checked
        await client.wait_ready(120)
        assert supervisor.restarts == 1
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(metrics_dir))  # type: ignore[no-untyped-call]
        assert registry.get_sample_value("steadyserve_engine_restarts_total") == 1

        outputs = [output async for output in client.stream(request(client, 6))]
        final = outputs[-1].payload
        assert final.finish_reason is FinishReason.LENGTH  # type: ignore[union-attr]
        assert sum(len(o.payload.token_ids) for o in outputs) == 6  # type: ignore[union-attr]
        assert (
            tokens[:3]
            == outputs[0].payload.token_ids
            + outputs[1].payload.token_ids
            + outputs[2].payload.token_ids
        )  # type: ignore[union-attr]
