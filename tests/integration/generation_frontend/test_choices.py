"""`n` choices per prompt in front of the scripted engine (it echoes each prompt's tokens):
one engine request per (prompt, choice), each with a seed of its own; choices' indices and
usage; the charge counts every sequence; `n` over its cap and `best_of` other than 1 are 400s."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from app.engine.protocol import GeneratePayload
from app.generation.seeds import prompt_seed, sequence_seed
from app.main import create_app
from app.schemas_choices import MAX_CHOICES
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.generation_frontend import PROMPT, engine_of
from tests.support.scripted_generator import ScriptedGenerator

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_each_choice_of_each_prompt_is_its_own_seeded_engine_request(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    engine = engine_of(app)
    before = len(engine.submitted)
    body = {"model": "tiny", "prompt": ["Hi", PROMPT], "max_tokens": 3, "n": 3, "seed": 7}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    sent = [submit.payload for submit in engine.submitted[before:]]
    assert len(sent) == 6
    seeds = {p.sampling.seed for p in sent if isinstance(p, GeneratePayload)}
    want = {sequence_seed(7, prompt, choice) for prompt in range(2) for choice in range(3)}
    assert seeds == want and len(want) == 6
    assert sequence_seed(7, 1, 0) == prompt_seed(7, 1)  # n 1's seeds unchanged
    answer = response.json()
    assert [choice["index"] for choice in answer["choices"]] == list(range(6))
    # The echo engine repeats its prompt: choices 0-2 continue "Hi", 3-5 PROMPT.
    texts = [choice["text"] for choice in answer["choices"]]
    assert len(set(texts[:3])) == 1 and len(set(texts[3:])) == 1 and texts[0] != texts[3]
    one = await client.post("/v1/completions", json={**body, "n": 1})
    usage, usage_of_one = answer["usage"], one.json()["usage"]
    assert usage["prompt_tokens"] == usage_of_one["prompt_tokens"]  # each prompt once
    assert usage["completion_tokens"] == 3 * usage_of_one["completion_tokens"] == 18


async def test_chat_choices_are_indexed_from_0(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json={**body, "n": 2})
    assert response.status_code == 200, response.text
    assert [choice["index"] for choice in response.json()["choices"]] == [0, 1]


async def test_a_request_is_charged_every_sequence(settings: Settings) -> None:
    """The token bucket is charged n x (prompt + new tokens): what the engine holds."""
    small = settings.model_copy(update={"rate_limit_burst": 100})
    application = create_app(small, engine=ScriptedGenerator(small))
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 60}
    async with serving(application) as client:
        one = await client.post("/v1/completions", json=body)
        assert one.status_code == 200, one.text
        prompt_tokens = one.json()["usage"]["prompt_tokens"]
        assert prompt_tokens + 60 <= 100 < 2 * (prompt_tokens + 60)
        two = await client.post("/v1/completions", json={**body, "n": 2})
    assert two.status_code == 413, two.text
    assert f"needs {2 * (prompt_tokens + 60)} tokens (n=2 x (prompts" in two.text


async def test_more_sequences_than_a_generate_model_holds_are_413_naming_n(
    settings: Settings,
) -> None:
    """Each sequence is an engine request, all sent at once: past a model's slots and its
    waiting line the engine refused the rest, so such a request got 429 however idle the
    server was (and was charged); prompts x n counts against the per-request cap."""
    small = settings.model_copy(update={"generate_slots": 2, "generate_max_waiting": 3})
    application = create_app(small, engine=ScriptedGenerator(small))
    body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 1}
    async with serving(application) as client:
        fits = await client.post("/v1/completions", json={**body, "n": 2})
        over = await client.post("/v1/completions", json={**body, "n": 3})
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "n": 6}
        over_chat = await client.post("/v1/chat/completions", json=chat)
    assert fits.status_code == 200, fits.text
    for response in (over, over_chat):
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["param"] == "n" and "at most 5 per request" in error["message"]
    assert "6 sequences (2 prompts x n=3)" in over.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "fields", "words"),
    [
        ("/v1/completions", {"prompt": "Hi", "n": MAX_CHOICES + 1}, str(MAX_CHOICES)),
        ("/v1/chat/completions", {"n": MAX_CHOICES + 1}, str(MAX_CHOICES)),
        ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "Hi", "best_of": 2}, "best_of is not served"),
    ],
)
async def test_n_over_its_cap_and_best_of_are_refused(
    client: httpx.AsyncClient, path: str, fields: dict[str, object], words: str
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}
    if "prompt" in fields:
        del body["messages"]
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == ("best_of" if "best_of" in fields else "n")


async def test_each_prompt_is_echoed_once_for_all_its_choices(
    client: httpx.AsyncClient, app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`echo` with n 3 and two prompts: each prompt's text is decoded once (the choices
    share it), not once per choice; every choice still begins with its prompt's."""
    tokenizer = app.state.service.tokenizers["tiny"]
    # Longer than the detokenizer's context (5 tokens), which the generated text decodes.
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    decoded: list[list[int]] = []
    decode = tokenizer.decode

    def counting(ids: list[int]) -> str:
        decoded.append(list(ids))
        return str(decode(ids))

    monkeypatch.setattr(tokenizer, "decode", counting)
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 2, "n": 3, "echo": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    texts = [choice["text"] for choice in response.json()["choices"]]
    for index, text in enumerate(texts):
        assert text.startswith(decode(prompts[index // 3]))
    assert [ids for ids in decoded if ids in prompts] == prompts  # once each
