"""Generation over real HTTP with the tiny random-weight causal LM and the real engine: greedy
results through /infer, /v1/completions and the `openai` client equal `model.generate` run
one prompt at a time, for 16 concurrent requests of different lengths; streamed chunks
concatenate to the whole text and end with [DONE]; stop strings and max_tokens give their
finish_reason; chat without a template is a 400; sampling parameters reach the engine;
what the routes refuse for a generate model. A client that disconnects mid-stream is in
test_generation_disconnect.py.

The server is uvicorn on 127.0.0.1 in the test's loop (tests/support/listening.py), with the
engine in its own process (as served) and in-process (as debugged)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from transformers import PreTrainedModel

from app.main import create_app
from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation import reference_greedy, sse_payloads
from tests.support.generation_api import SLOT_TOKENS, settings_for
from tests.support.listening import listening

pytestmark = pytest.mark.asyncio(loop_scope="module")


# 16 prompts of 3 to ~30 tokens, each with its own number of new tokens.
PROMPTS = [text[:cut] for text in CORPUS[:8] for cut in (9, 120)]
NEW_TOKENS = [5 + (7 * index) % 23 for index in range(len(PROMPTS))]


@dataclass(frozen=True)
class Expected:
    text: str
    completion_tokens: int
    finish_reason: str  # OpenAI's: "stop" at EOS, "length" at max_new_tokens


def expected_greedy(
    reference: tuple[Any, PreTrainedModel], prompt_ids: list[int], max_new_tokens: int
) -> Expected:
    """model.generate on one prompt, no padding, decoded as a client would."""
    tokenizer, model = reference
    result = reference_greedy(model, prompt_ids, max_new_tokens)
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return Expected(text, len(result.token_ids), "stop" if result.at_eos else "length")


@pytest.fixture(scope="module")
def expected(reference: tuple[Any, PreTrainedModel]) -> list[Expected]:
    tokenizer, _ = reference
    return [
        expected_greedy(reference, tokenizer(prompt)["input_ids"], new_tokens)
        for prompt, new_tokens in zip(PROMPTS, NEW_TOKENS, strict=True)
    ]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["process", "inprocess"])
async def base_url(
    request: pytest.FixtureRequest, tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path
) -> AsyncIterator[str]:
    settings = settings_for(tiny_causal_lm, tiny_causal_lm_without_chat_template, request.param)
    async with listening(create_app(settings)) as url:
        yield url


async def test_infer_greedy_equals_generate_for_16_concurrent_requests(
    client: httpx.AsyncClient, expected: list[Expected]
) -> None:
    async def one(prompt: str, new_tokens: int) -> Any:
        parameters = {"max_new_tokens": new_tokens}
        response = await client.post(
            "/infer", json={"model": "tiny", "inputs": prompt, "parameters": parameters}
        )
        assert response.status_code == 200, response.text
        return response.json()["outputs"][0]

    served = await asyncio.gather(*map(one, PROMPTS, NEW_TOKENS))
    for output, want in zip(served, expected, strict=True):
        assert output["text"] == want.text
        assert output["completion_tokens"] == want.completion_tokens
        assert output["finish_reason"] == want.finish_reason


async def test_completions_greedy_equals_generate_for_16_concurrent_requests(
    client: httpx.AsyncClient, expected: list[Expected]
) -> None:
    async def one(prompt: str, new_tokens: int) -> Any:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    served = await asyncio.gather(*map(one, PROMPTS, NEW_TOKENS))
    for answer, want in zip(served, expected, strict=True):
        assert answer["choices"][0]["text"] == want.text
        assert answer["choices"][0]["finish_reason"] == want.finish_reason
        assert answer["usage"]["completion_tokens"] == want.completion_tokens


async def test_server_timing_of_a_real_generation_holds_its_compute(
    client: httpx.AsyncClient, expected: list[Expected]
) -> None:
    # Counted once per step and once per request (the slowest sequence's): checked exactly
    # in generation_frontend/test_engine_requests.py; here, the real engine's figure is
    # within the total.
    longest = sorted(range(len(expected)), key=lambda i: expected[i].completion_tokens)[-2:]
    assert all(expected[i].completion_tokens >= 10 for i in longest)
    body = {
        "model": "tiny",
        "prompt": [PROMPTS[i] for i in longest],
        "max_tokens": max(NEW_TOKENS[i] for i in longest),
        "temperature": 0,
    }
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    phases = {
        name: float(duration.removeprefix("dur="))
        for name, duration in (
            entry.split(";") for entry in response.headers["server-timing"].split(", ")
        )
    }
    assert 0 < phases["compute"] <= phases["total"], phases


async def test_the_openai_client_gets_the_same_whole_and_streamed(
    base_url: str, expected: list[Expected]
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)

    async def whole(prompt: str, new_tokens: int) -> openai.types.Completion:
        return await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=new_tokens, temperature=0
        )

    async def streamed(prompt: str, new_tokens: int) -> tuple[str, list[str | None]]:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True
        )
        pieces = [chunk async for chunk in stream]
        text = "".join(piece.choices[0].text for piece in pieces)
        return text, [piece.choices[0].finish_reason for piece in pieces]

    try:
        wholes, streams = await asyncio.gather(
            asyncio.gather(*map(whole, PROMPTS, NEW_TOKENS)),
            asyncio.gather(*map(streamed, PROMPTS, NEW_TOKENS)),
        )
    finally:
        await client.close()
    for answer, (text, finishes), want in zip(wholes, streams, expected, strict=True):
        assert answer.choices[0].text == want.text == text
        assert answer.choices[0].finish_reason == want.finish_reason == finishes[-1]
        assert answer.usage is not None and answer.usage.completion_tokens == want.completion_tokens
        assert set(finishes[:-1]) <= {None}


async def test_chat_streams_what_generate_gives_the_templated_prompt(
    base_url: str, reference: tuple[Any, PreTrainedModel]
) -> None:
    tokenizer, _ = reference
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = list(prompt_ids["input_ids"])
    want = expected_greedy(reference, prompt_ids, 20)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    try:
        answer = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_completion_tokens=20,
            temperature=0,  # type: ignore[arg-type]
        )
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            await client.chat.completions.create(model="plain", messages=messages)  # type: ignore[arg-type]
    finally:
        await client.close()
    assert answer.choices[0].message.content == want.text
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want.text
    assert (
        chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens == want.completion_tokens
    )


async def test_raw_stream_ends_with_done_and_concatenates_to_the_whole_text(
    client: httpx.AsyncClient, expected: list[Expected]
) -> None:
    body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": NEW_TOKENS[3], "temperature": 0}
    response = await client.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(response.content)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected[3].text
    assert chunks[-1]["choices"][0]["finish_reason"] == expected[3].finish_reason


async def test_stop_strings_and_max_tokens_give_their_finish_reason(
    client: httpx.AsyncClient, expected: list[Expected]
) -> None:
    want = max(expected, key=lambda e: len(e.text))
    index = expected.index(want)
    assert len(want.text) >= 8, want
    stop = want.text[4:7]
    cut = want.text.index(stop)
    body = {"model": "tiny", "prompt": PROMPTS[index], "temperature": 0}
    stopped = await client.post(
        "/v1/completions", json={**body, "max_tokens": NEW_TOKENS[index], "stop": [stop]}
    )
    assert stopped.json()["choices"][0] == {
        "index": 0, "text": want.text[:cut], "finish_reason": "stop", "logprobs": None
    }  # fmt: skip
    streamed = await client.post(
        "/v1/completions",
        json={**body, "max_tokens": NEW_TOKENS[index], "stop": stop, "stream": True},
    )
    chunks = sse_payloads(streamed.content)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text[:cut]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    short = await client.post(
        "/infer",
        json={"model": "tiny", "inputs": PROMPTS[index], "parameters": {"max_new_tokens": 2}},
    )
    assert short.json()["outputs"][0]["finish_reason"] == "length"
    assert short.json()["outputs"][0]["completion_tokens"] == 2


async def test_a_request_over_the_sequence_limit_is_a_400_naming_it(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": SLOT_TOKENS}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
    assert f"at most {SLOT_TOKENS} tokens" in error["message"]
    fine = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3}
    )
    assert fine.status_code == 200


async def test_sampling_parameters_reach_the_engine(
    client: httpx.AsyncClient, expected: list[Expected]
) -> None:
    """A seed repeats a sample; top_k 1 samples the greedy text; /infer's do_sample and the
    OpenAI routes' temperature switch sampling on."""
    prompt, want = PROMPTS[5], expected[5]

    async def completion(**sampling: object) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS[5], **sampling}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        text: str = response.json()["choices"][0]["text"]
        return text

    seeded = [await completion(temperature=1.5, seed=seed) for seed in (7, 7, 8, 9)]
    assert seeded[0] == seeded[1]
    assert len(set(seeded)) > 1 and want.text not in seeded[2:]
    assert await completion(temperature=1.5, top_k=1, seed=3) == want.text
    assert await completion(temperature=1.5, top_p=1e-6, seed=3) == want.text
    infer = await client.post(
        "/infer",
        json={
            "model": "tiny",
            "inputs": prompt,
            "parameters": {"max_new_tokens": NEW_TOKENS[5], "do_sample": True, "seed": 7,
                           "temperature": 1.5},
        },
    )  # fmt: skip
    assert infer.json()["outputs"][0]["text"] == seeded[0]


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/completions", {"prompt": "Hello", "seed": 2**64}),
        ("/v1/completions", {"prompt": "Hello", "top_k": 2**64}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2**64}),
        ("/v1/chat/completions", {"messages": [], "max_completion_tokens": 2**64}),
        ("/infer", {"inputs": "Hello", "parameters": {"seed": 2**64, "do_sample": True}}),
        ("/infer", {"inputs": "Hello", "parameters": {"max_new_tokens": 2**64}}),
    ],
)
async def test_integers_beyond_int64_are_a_client_error_not_a_500(
    client: httpx.AsyncClient, route: str, body: dict[str, object]
) -> None:
    """msgpack and torch's generators take 64-bit integers: a larger one used to reach the
    protocol's encoder and fail there (500)."""
    response = await client.post(route, json={"model": "tiny", **body})
    assert response.status_code == (400 if route.startswith("/v1/") else 422), response.text
    error = response.json()["error"]  # the project's error body, naming the field
    assert error["code"] == "invalid_request" and error["param"], error
    assert error["type"] == (
        "invalid_request_error" if route.startswith("/v1/") else "invalid_request"
    )


async def test_the_v2_protocol_describes_a_generate_model_and_refuses_tensors_for_it(
    client: httpx.AsyncClient,
) -> None:
    """In the protocol's own error shape (`{"error": str}`), not /infer's."""
    metadata = await client.get("/v2/models/tiny")
    assert metadata.status_code == 200
    assert metadata.json()["platform"] == "steadyserve_generate"
    assert metadata.json()["inputs"] == []
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    response = await client.post("/v2/models/tiny/infer", json=body)
    assert response.status_code == 400
    assert response.json() == {"error": "model 'tiny' does 'generate', not 'tensor'"}


async def test_embeddings_of_a_generate_model_name_the_task_whatever_the_dimensions(
    client: httpx.AsyncClient,
) -> None:
    """Not "dimensions=8 is not supported; tiny gives <its vocabulary size>"."""
    for extra in ({}, {"dimensions": 8}):
        response = await client.post(
            "/v1/embeddings", json={"model": "tiny", "input": "Hi", **extra}
        )
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "model 'tiny' does 'generate', not 'embed'"
