"""What the generation front end asks of the engine and reports of it, in front of a
scripted engine (tests/support/scripted_generator.py) that records what it is sent: only
what is read as it comes is streamed; only a request without a limit is fitted to its
deadline; Server-Timing's compute; no slow-request reports for generations."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from app.engine.protocol import GeneratePayload
from app.main import create_app
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.generation_frontend import PROMPT, engine_of
from tests.support.scripted_generator import ScriptedGenerator

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_the_engine_streams_only_what_is_read_as_it_comes(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    # A whole answer without stop strings needs only the engine's final output; a stream,
    # or a stop string to watch for, needs every step's tokens.
    engine = engine_of(app)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
    for extra, streams in (({}, False), ({"stop": ["zzz"]}, True), ({"stream": True}, True)):
        response = await client.post("/v1/completions", json={**body, **extra})
        assert response.status_code == 200, response.text
        payload = engine.submitted[-1].payload
        assert isinstance(payload, GeneratePayload)
        assert payload.stream is streams, extra


async def test_only_a_request_without_max_tokens_lets_the_engine_fit_it_to_its_deadline(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """No `max_tokens`: the engine is sent the prompt's room, to be fitted to the deadline
    (not refused for it); a client-set limit is kept as sent."""
    for extra, fit in (({}, True), ({"max_tokens": 3}, False)):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **extra}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        payload = engine_of(app).submitted[-1].payload
        assert isinstance(payload, GeneratePayload)
        assert payload.sampling.fit_to_deadline is fit
        assert (payload.sampling.max_new_tokens == 3) is not fit
    # Completions read an unset or null max_tokens as OpenAI's 16, a limit like any other.
    for extra in ({}, {"max_tokens": None}):
        body = {"model": "tiny", "prompt": "Hi", **extra}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        payload = engine_of(app).submitted[-1].payload
        assert isinstance(payload, GeneratePayload)
        assert (payload.sampling.max_new_tokens, payload.sampling.fit_to_deadline) == (16, False)


async def test_server_timing_counts_the_slowest_sequences_compute_once(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """A request's sequences run side by side: its compute is its slowest sequence's (each
    output's compute added once), not the sum over its sequences."""
    engine = engine_of(app)
    engine.compute_s_per_output = 0.010
    try:
        body = {"model": "tiny", "prompt": ["Hello there", "Good morning"], "max_tokens": 4}
        response = await client.post("/v1/completions", json=body)
    finally:
        engine.compute_s_per_output = 0.0
    assert response.status_code == 200, response.text
    phases = dict(entry.split(";dur=") for entry in response.headers["server-timing"].split(", "))
    assert float(phases["compute"]) == pytest.approx(4 * 10.0, abs=0.1), phases


async def test_generations_are_never_reported_as_slow_requests(settings: Settings) -> None:
    """A generation lasts as long as its client asked: with every request over the slow
    threshold, /infer on a generate model still leaves no slow-request report."""
    reporting = settings.model_copy(update={"spike_reports": True, "slow_request_ms": 1e-6})
    application = create_app(reporting, engine=ScriptedGenerator(reporting))
    async with serving(application) as client:
        response = await client.post(
            "/infer", json={"model": "tiny", "inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
        )
        missing = await client.post("/infer", json={"model": "nope", "inputs": PROMPT})
    assert response.status_code == 200 and missing.status_code == 404
    reports = application.state.recorder.recent()
    assert [report.path for report in reports] == ["/infer"]  # the 404 only
    assert reports[0].status == 404
