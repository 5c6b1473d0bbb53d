"""What each generation route answers (/infer, /v1/completions, /v1/chat/completions),
with the tiny model's real tokenizer in front of a scripted engine that echoes each
prompt's tokens (tests/support/scripted_generator.py), so the expected text is known
exactly: text, finish reasons and usage, whole or streamed as SSE; stop strings, also
inside an output of several tokens; EOS. The real engine's results are tested in
tests/integration/test_generation_api.py."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from app.engine.protocol import GeneratePayload
from tests.support.generation import sse_payloads
from tests.support.generation_frontend import PROMPT, engine_of

pytestmark = pytest.mark.asyncio(loop_scope="module")


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


async def test_a_stop_reached_inside_a_multi_token_output_counts_only_the_tokens_before_it(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """An output may carry several tokens (a run's, handed over at once): a stop reached by
    the first counted the rest in `completion_tokens`, though their text was never sent."""
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
