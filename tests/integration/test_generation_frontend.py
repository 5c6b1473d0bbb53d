"""The generation front end (routes, pipeline, SSE) with the tiny model's real tokenizer in
front of a scripted engine that echoes each prompt's tokens (tests/support/
scripted_generator.py): the point here is the protocol (what is sent to the engine, what is
cancelled, what each route answers), so the expected text is known exactly. The real
engine's results are tested in tests/integration/test_generation_api.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from fastapi import FastAPI

from app.engine.protocol import GeneratePayload
from app.main import create_app
from app.model_specs import ModelSpec
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.generation import sse_payloads
from tests.support.scripted_generator import ScriptedGenerator

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def settings(tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path) -> Settings:
    return Settings(
        engine="inprocess",
        models=(
            ModelSpec(name="tiny", task="generate", source=str(tiny_causal_lm)),
            ModelSpec(
                name="plain", task="generate", source=str(tiny_causal_lm_without_chat_template)
            ),
            ModelSpec(name="minilm"),
        ),
        max_queue_delay_ms=10_000,
        spike_reports=False,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(settings: Settings) -> AsyncIterator[FastAPI]:
    engine = ScriptedGenerator(settings)
    application = create_app(settings, engine=engine)
    application.state.test_engine = engine
    yield application


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(app) as client:
        yield client


def engine_of(app: FastAPI) -> ScriptedGenerator:
    engine: ScriptedGenerator = app.state.test_engine
    return engine


def prompt_tokens(app: FastAPI, text: str) -> list[int]:
    ids: list[int] = app.state.service.tokenizers["tiny"].encode(text)
    return ids


async def test_infer_echoes_the_prompt_and_reports_length_and_usage(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    ids = prompt_tokens(app, PROMPT)
    response = await client.post(
        "/infer",
        json={
            "model": "tiny",
            "inputs": [PROMPT, "Hello"],
            "parameters": {"max_new_tokens": len(ids) - 1},
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    first = body["outputs"][0]
    assert first == {
        "text": PROMPT,
        "finish_reason": "length",
        "prompt_tokens": len(ids),
        "completion_tokens": len(ids) - 1,
    }
    assert body["usage"]["inputs"] == 2
    assert body["usage"]["output_tokens"] == 2 * (len(ids) - 1)
    sent = engine_of(app).submitted[-2:]
    assert sorted(
        len(s.payload.prompt_ids) for s in sent if isinstance(s.payload, GeneratePayload)
    ) == sorted([len(ids), len(prompt_tokens(app, "Hello"))])


async def test_a_stop_string_cuts_the_text_and_cancels_the_engine_request(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    engine = engine_of(app)
    response = await client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stop": [" over", "zzz"]},
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "The quick brown fox jumps"
    assert choice["finish_reason"] == "stop"
    request_id = engine.submitted[-1].request_id
    assert request_id in engine.cancelled
    assert engine.running == 0
    assert response.json()["usage"]["completion_tokens"] < 200


async def test_streamed_chunks_concatenate_to_the_whole_text_and_end_with_done(
    client: httpx.AsyncClient,
) -> None:
    request = {"model": "tiny", "prompt": [PROMPT, "Hello world! How are you"], "max_tokens": 9}
    whole = (await client.post("/v1/completions", json=request)).json()
    streamed = await client.post(
        "/v1/completions",
        json={**request, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert "server-timing" in streamed.headers
    chunks = sse_payloads(streamed.content)
    for index in (0, 1):
        text = "".join(
            c["choices"][0]["text"]
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == index
        )
        assert text == whole["choices"][index]["text"]
        finishes = [
            c["choices"][0]["finish_reason"]
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_chat_streams_role_then_content_deltas(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "Hello world"}]
    whole = await client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 6}
    )
    assert whole.status_code == 200, whole.text
    content = whole.json()["choices"][0]["message"]["content"]
    streamed = await client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 6, "stream": True},
    )
    chunks = sse_payloads(streamed.content)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert deltas == content
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_on_a_model_without_a_template_is_a_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert "no chat template" in response.json()["error"]["message"]


async def test_a_route_asked_of_a_model_of_another_task_is_a_400(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/completions", json={"model": "minilm", "prompt": "hi"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    embedding = await client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert embedding.status_code == 400 and "does 'generate'" in embedding.text
    embedded = await client.post(
        "/infer", json={"model": "minilm", "inputs": "hi", "parameters": {"max_new_tokens": 3}}
    )
    assert embedded.status_code == 422  # an embedding request, validated as before
    assert embedded.json()["error"]["param"] == "parameters.max_new_tokens"


async def test_a_union_field_is_refused_for_what_is_wrong_with_the_member_sent(
    client: httpx.AsyncClient,
) -> None:
    """`stop` is a string or a list: five strings are refused for the list's length, not as
    "not a valid string", and the param is the field, without pydantic's member tag."""
    stops = ["a", "b", "c", "d", "e"]
    response = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "stop": stops}
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == "stop"
    assert "at most 4 items" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    ],
)
async def test_the_param_of_a_wrong_union_member_is_where_it_is_wrong(
    client: httpx.AsyncClient, body: dict[str, object], param: str
) -> None:
    """pydantic's member tag `str` passed for a field (`messages[0].content.str`), and the
    list's index was lost (`prompt` for `prompt[1]`)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = await client.post(path, json={"model": "tiny", **body})
    assert response.status_code == 422
    assert response.json()["error"]["param"] == param


async def test_a_prompt_and_new_tokens_over_the_sequence_limit_is_a_400_naming_it(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 300}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    # OpenAI's type, the reason in `code`; the field as sent (one string: not `prompt[0]`).
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    assert "at most 256 tokens" in error["message"]


async def test_a_failure_mid_stream_is_an_error_event_then_done(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    engine = engine_of(app)
    engine.fail_after_tokens = 3
    try:
        response = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True},
        )
    finally:
        engine.fail_after_tokens = None
    chunks = sse_payloads(response.content)
    assert chunks[-1] == {
        "error": {
            "type": "server_error",
            "message": "internal server error",
            "param": None,
            "code": "internal_error",
        }
    }


async def test_a_client_that_disconnects_mid_stream_cancels_its_engine_request(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    engine = engine_of(app)
    body = orjson.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True})
    statuses: list[int] = []
    first_text = asyncio.Event()
    sent: list[bytes] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await first_text.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        if message["type"] == "http.response.body" and b'"text":"' in message.get("body", b""):
            sent.append(message["body"])
            first_text.set()

    path = "/v1/completions"
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("127.0.0.1", 1),
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 10)
    request_id = engine.submitted[-1].request_id
    assert statuses == [200] and sent, "the stream had started"
    assert request_id in engine.cancelled
    assert engine.running == 0


async def test_the_openai_client_parses_every_answer_unchanged(app: FastAPI) -> None:
    import openai

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
        models = await client.models.list()
        assert {m.id for m in models.data} == {"tiny", "plain", "minilm"}
        completion = await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0
        )
        tokenizer = app.state.service.tokenizers["tiny"]
        expected = tokenizer.decode(tokenizer.encode(PROMPT)[1:5])
        assert completion.choices[0].text == expected and PROMPT.startswith(expected)
        assert completion.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello world"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = [chunk async for chunk in stream]
        assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 5
        assert pieces[-2].choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="plain", messages=[{"role": "user", "content": "hi"}]
            )


async def test_what_the_openai_client_sends_for_parameters_passed_as_none_is_served(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """The client sends null for a parameter its caller passed as None, and OpenAI reads it
    as the default; each was a 422. A negative seed is within OpenAI's range, and
    `include_obfuscation: false` asks for nothing this server adds."""
    import openai

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
        openai_client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="none", http_client=http
        )
        nulls = {
            "temperature": None,
            "top_p": None,
            "n": None,
            "presence_penalty": None,
            "frequency_penalty": None,
        }
        chat = await openai_client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=3,
            stream=None,
            seed=-5,
            **nulls,
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
        completion = await openai_client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=3,
            echo=None,
            **nulls,
        )
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        stream = await openai_client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
        assert [chunk async for chunk in stream][-1].usage is not None
    sent = engine_of(app).submitted[-3].payload
    assert isinstance(sent, GeneratePayload) and sent.sampling.seed == -5


async def test_eos_is_finish_reason_stop_on_every_path(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    engine = engine_of(app)
    engine.eos_after_tokens = 3
    try:
        infer = await client.post(
            "/infer", json={"model": "tiny", "inputs": PROMPT, "parameters": {"max_new_tokens": 9}}
        )
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 9}
        whole = await client.post("/v1/completions", json=body)
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        messages = [{"role": "user", "content": "Hello world"}]
        chat = await client.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 9}
        )
    finally:
        engine.eos_after_tokens = None
    assert infer.json()["outputs"][0]["finish_reason"] == "stop"
    assert infer.json()["outputs"][0]["completion_tokens"] == 3
    assert whole.json()["choices"][0]["finish_reason"] == "stop"
    assert sse_payloads(streamed.content)[-1]["choices"][0]["finish_reason"] == "stop"
    assert chat.json()["choices"][0]["finish_reason"] == "stop"
    assert chat.json()["usage"]["completion_tokens"] == 3


async def test_the_openapi_document_states_generation_for_the_generate_models(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    assert {"/v1/completions", "/v1/chat/completions", "/infer"} <= set(document["paths"])
    infer_body = document["paths"]["/infer"]["post"]["requestBody"]["content"]
    variants = infer_body["application/json"]["schema"]["anyOf"]
    assert {v["$ref"].rsplit("/", 1)[1] for v in variants} == {
        "InferRequest",
        "GenerateInferRequest",
    }
    schemas = document["components"]["schemas"]
    for name, models in [
        ("CompletionRequest", ["tiny", "plain"]),
        ("GenerateInferRequest", ["tiny", "plain"]),
        ("ChatCompletionRequest", ["tiny"]),  # "plain" has no chat template
    ]:
        model = schemas[name]["properties"]["model"]  # the default model generates: optional
        assert model["anyOf"] == [{"type": "string", "enum": models}, {"type": "null"}]
    assert schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["maxItems"] == 64
    # `dimensions` names the embedding model's width only, not a vocabulary size.
    dimensions = schemas["EmbeddingsRequest"]["properties"]["dimensions"]["anyOf"][0]
    assert dimensions["enum"] == [384]


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


@pytest.mark.parametrize("stream", [False, True])
async def test_outputs_that_arrive_together_are_one_piece_with_the_same_text_and_counts(
    client: httpx.AsyncClient, app: FastAPI, stream: bool
) -> None:
    """A reader behind the engine finds several outputs queued: they become one text chunk
    (fewer writes), and the text, the stop and the token count stay what one output at a
    time gives."""
    engine = engine_of(app)
    body: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "stream": stream}
    if stream:  # else a stream has no usage to compare
        body["stream_options"] = {"include_usage": True}
    stopped = {**body, "max_tokens": 200, "stop": [" over"]}
    answers = []
    for per_turn in (1, 4):
        engine.outputs_per_turn = per_turn
        try:
            answers.append(
                [(await client.post("/v1/completions", json=b)).content for b in (body, stopped)]
            )
        finally:
            engine.outputs_per_turn = 1

    def texts_and_usage(content: bytes) -> tuple[list[str], dict[str, Any]]:
        if not stream:
            whole = orjson.loads(content)
            return [whole["choices"][0]["text"]], whole["usage"]
        chunks = sse_payloads(content)
        *texts, usage = chunks  # the usage chunk comes last, with no choice
        assert usage["choices"] == [] and usage["usage"] is not None, usage
        return [c["choices"][0]["text"] for c in texts if c["choices"][0]["text"]], usage["usage"]

    for one, together in zip(answers[0], answers[1], strict=True):
        texts_one, usage_one = texts_and_usage(one)
        texts_together, usage_together = texts_and_usage(together)
        assert "".join(texts_together) == "".join(texts_one)
        assert usage_together == usage_one
        if stream:
            assert len(texts_together) < len(texts_one)
    _, stopped_usage = texts_and_usage(answers[1][1])
    # The stop is at the same output: the same tokens counted, streamed or not.
    assert stopped_usage["completion_tokens"] < 200


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


async def test_a_stop_reached_inside_a_multi_token_output_counts_only_the_tokens_before_it(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """With multi-step decoding an output carries several tokens: a stop reached by the
    first counted the rest in `completion_tokens`, though their text was never sent."""
    engine = engine_of(app)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stop": [" over"]}
    usages = []
    for per_output in (1, 3):  # the stop comes with token 16: inside an output of three
        engine.tokens_per_output = per_output
        try:
            response = await client.post("/v1/completions", json=body)
        finally:
            engine.tokens_per_output = 1
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["text"] == "The quick brown fox jumps"
        usages.append(answer["usage"]["completion_tokens"])
    assert usages[0] == usages[1], usages
