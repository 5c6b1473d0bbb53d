"""Log probabilities travel with the text that shows their tokens: the tiny model's real
tokenizer in front of the scripted engine, which echoes a prompt's tokens with made-up log
probabilities that name them (-id/1000: tests/support/scripted_generator.py). Its byte-level
tokens split "é" in two: a stream's chunk carries a token once its text is all sent (the
first half of a character goes with the second), and a stop string's held-back text holds
its tokens back too; streamed or whole, the tokens are those `completion_tokens` counts,
the one that completed the stop string included."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.generation.tokenizer import GenerationTokenizer
from tests.support.generation import sse_payloads
from tests.support.generation_frontend import engine_of

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Its "é"s and "ü" are two byte tokens each; "fox" and "café" words of their own.
PROMPT = "Un café crème über fox, café! Done."


def tokenizer_of(app: FastAPI) -> GenerationTokenizer:
    tokenizer: GenerationTokenizer = app.state.service.tokenizers["tiny"]
    return tokenizer


def ids_of(logprobs: dict[str, Any]) -> list[int]:
    """The token ids the scripted log probabilities name."""
    return [round(-logprob * 1000) for logprob in logprobs["token_logprobs"]]


async def stream(client: httpx.AsyncClient, **body: object) -> list[dict[str, Any]]:
    request = {"model": "tiny", "prompt": PROMPT, "logprobs": 1, "stream": True, **body}
    response = await client.post("/v1/completions", json=request)
    assert response.status_code == 200, response.text
    return [chunk["choices"][0] for chunk in sse_payloads(response.content)]


@pytest.mark.parametrize("per_output", [1, 3])
async def test_each_chunk_carries_the_tokens_whose_text_it_completes(
    client: httpx.AsyncClient, app: FastAPI, per_output: int
) -> None:
    tokenizer = tokenizer_of(app)
    echo = tokenizer.encode(PROMPT)[1:]  # the scripted engine leaves BOS out
    names = tokenizer.token_texts
    assert any(names.named(t)[0].startswith("bytes:") for t in echo), "no split character"
    engine_of(app).tokens_per_output = per_output
    try:
        chunks = await stream(client, max_tokens=len(echo))
    finally:
        engine_of(app).tokens_per_output = 1
    text, carried = "", b""
    tokens: list[int] = []
    for chunk in chunks:
        text += chunk["text"]
        if chunk["logprobs"] is None:
            continue
        ids = ids_of(chunk["logprobs"])
        tokens += ids
        carried += b"".join(names.named(t)[1] for t in ids)
        assert carried.decode() == text  # no token ahead of its text, none behind
        assert chunk["logprobs"]["text_offset"] == sorted(chunk["logprobs"]["text_offset"])
        for token_id, offset in zip(ids, chunk["logprobs"]["text_offset"], strict=True):
            own = names.named(token_id)[1]
            if not names.named(token_id)[0].startswith("bytes:"):
                assert text[offset : offset + len(own.decode())] == own.decode()
    assert tokens == echo and text == PROMPT


async def test_a_stop_string_holds_its_tokens_back_and_keeps_the_counted_ones(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """The stop string "fé!" begins inside the last word (its tokens' text is held back
    while it may be one) and ends inside it: the text stops before it; the tokens run to
    the one that completed it, whole and streamed alike."""
    echo = tokenizer_of(app).encode(PROMPT)[1:]
    body = {"max_tokens": len(echo), "stop": "fé!"}
    chunks = await stream(client, **body)
    whole = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "logprobs": 1, **body}
    )
    answer = whole.json()
    choice = answer["choices"][0]
    cut = PROMPT.index("fé!")
    assert choice["text"] == PROMPT[:cut] == "".join(c["text"] for c in chunks)
    counted = answer["usage"]["completion_tokens"]
    assert ids_of(choice["logprobs"]) == echo[:counted] and counted < len(echo)
    streamed: dict[str, list[Any]] = {}
    for chunk in chunks:
        for key, values in (chunk["logprobs"] or {}).items():
            streamed.setdefault(key, []).extend(values)
    assert streamed == choice["logprobs"]
    assert max(choice["logprobs"]["text_offset"]) <= len(choice["text"])
    # " fox": the "f" of " f" might begin the stop string, so " " goes out alone, and the
    # token " f" with "o", which shows its text whole.
    held = next(
        i for i, c in enumerate(chunks) if c["text"] == " " and c["logprobs"]["tokens"] == []
    )
    assert chunks[held + 1]["text"] == "fo"
    assert chunks[held + 1]["logprobs"]["tokens"] == [" f", "o"]
    # The stop's tokens (cut away with it) go with the last piece: no text, offsets at its end.
    assert chunks[-2]["text"] == "" and chunks[-2]["finish_reason"] is None
    last = chunks[-2]["logprobs"]
    assert last["tokens"] == ["f", "bytes:\\xc3", "bytes:\\xa9", "!"]
    assert last["text_offset"] == [cut] * 4
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["logprobs"] is None


async def test_chat_and_infer_name_the_tokens_and_their_alternatives(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    names = tokenizer_of(app).token_texts
    infer = await client.post(
        "/infer",
        json={
            "model": "tiny",
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": 4, "logprobs": 2},
        },
    )
    assert infer.status_code == 200, infer.text
    echo = tokenizer_of(app).encode(PROMPT)[1:5]
    assert infer.json()["outputs"][0]["logprobs"] == [
        {
            "token": names.named(t)[0], "token_id": t, "logprob": -t / 1000,
            "top_logprobs": [
                {"token": names.named(i)[0], "token_id": i, "logprob": -i / 1000}
                for i in (t, t + 1)
            ],
        }
        for t in echo
    ]  # fmt: skip
    chat = await client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny", "messages": [{"role": "user", "content": "é"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 1,
        },
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        token_id = round(-entry["logprob"] * 1000)
        text, raw = names.named(token_id)
        assert entry["token"] == text and entry["bytes"] == list(raw)
        assert entry["top_logprobs"] == [
            {"token": text, "logprob": entry["logprob"], "bytes": list(raw)}
        ]


async def test_echo_without_the_prompt_logprobs_asked_is_a_500(client: httpx.AsyncClient) -> None:
    """The scripted engine, like an engine older than `SamplingParams.prompt_logprobs` (msgspec
    drops a field it does not know), sends no prompt log probabilities: an echo asking for
    them fails (500) rather than answer a 200 whose prompt entries are missing (lm-eval would
    sum nothing). Echo without `logprobs` asks for none, and is answered."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "echo": True}
    asked = await client.post("/v1/completions", json={**body, "logprobs": 1})
    assert asked.status_code == 500, asked.text
    plain = await client.post("/v1/completions", json=body)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"].startswith(PROMPT)


async def test_an_eos_end_without_its_token_is_a_500(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """The scripted engine, like an engine older than `TokensOutput.end`, ends a sequence at
    EOS without the ending token: completions' logprobs would be one entry short (lm-eval's
    `[:-1]` then cuts the last prompt token), so it fails (500) rather than answer a 200.
    Without `logprobs` nothing is listed, and the answer stands."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5}
    engine_of(app).eos_after_tokens = 2
    try:
        asked = await client.post("/v1/completions", json={**body, "logprobs": 1})
        plain = await client.post("/v1/completions", json=body)
    finally:
        engine_of(app).eos_after_tokens = None
    assert asked.status_code == 500, asked.text
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "stop"
