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


async def test_each_prompt_of_a_seeded_request_draws_with_a_seed_of_its_own(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """One seed for every prompt made equal prompts (the only way to ask several samples of
    one request before `n`) come back as copies; the first prompt keeps the request's seed,
    and the same request gets the same seeds again."""
    engine = engine_of(app)

    async def seeds(path: str, body: dict[str, object], prompts: int) -> list[int | None]:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        sent = [submit.payload for submit in engine.submitted[-prompts:]]
        assert all(isinstance(payload, GeneratePayload) for payload in sent)
        return [payload.sampling.seed for payload in sent if isinstance(payload, GeneratePayload)]

    body = {"model": "tiny", "prompt": ["Hi"] * 3, "max_tokens": 2, "temperature": 1, "seed": 7}
    first = await seeds("/v1/completions", body, 3)
    assert first[0] == 7 and len(set(first)) == 3, first
    assert await seeds("/v1/completions", body, 3) == first
    inputs = {"model": "tiny", "inputs": ["Hi", "Hi"], "parameters": {"do_sample": True, "seed": 7}}
    assert await seeds("/infer", inputs, 2) == first[:2]
    # Extreme seeds stay within the protocol's int64.
    body["seed"] = 2**63 - 1
    assert all(-(2**63) <= seed < 2**63 for seed in await seeds("/v1/completions", body, 3) if seed)


async def test_temperature_and_top_p_of_0_are_served_as_transformers_serves_them(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """`temperature` 0 is ignored by greedy decoding (refused only with `do_sample`, where it
    would divide logits); `top_p` 0 keeps the top token. Both were refused."""
    engine = engine_of(app)
    greedy = {"inputs": "Hi", "model": "tiny", "parameters": {"temperature": 0, "top_p": 0}}
    response = await client.post("/infer", json=greedy)
    assert response.status_code == 200, response.text
    response = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "top_p": 0}
    )
    assert response.status_code == 200, response.text
    payload = engine.submitted[-1].payload
    assert isinstance(payload, GeneratePayload) and payload.sampling.top_p == 0
    sampled = {"inputs": "Hi", "model": "tiny", "parameters": {"do_sample": True, "temperature": 0}}
    response = await client.post("/infer", json=sampled)
    assert response.status_code == 422, response.text
    assert "temperature must be above 0" in response.text
