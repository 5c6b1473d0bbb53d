"""Token-id prompts on /v1/completions (OpenAI's and vLLM's; lm-eval-harness's
local-completions sends them by default), served by the tiny causal LM and the real engine:
a prompt's ids answer as its text does (greedy text, usage, finish), streamed, with `n`,
log probabilities and stop strings alike; a list of id lists is several prompts; an id past
the vocabulary, an empty list and a mixed list are 400s; the context limit applies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from app.generation.tokenizer import GenerationTokenizer, load_generation_tokenizer
from tests.support.generation import sse_payloads
from tests.support.generation_api import IN_PROCESS, SLOT_TOKENS, served

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = ["The quick brown fox jumps", "Tail latency is the"]
GREEDY = {"model": "tiny", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def tokenizer(tiny_causal_lm: Path) -> GenerationTokenizer:
    return load_generation_tokenizer(str(tiny_causal_lm), None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base_url(
    tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path
) -> AsyncIterator[str]:
    async with served(IN_PROCESS, tiny_causal_lm, tiny_causal_lm_without_chat_template) as url:
        yield url


async def complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/completions", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def choices(answer: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["text"], c["finish_reason"]) for c in answer["choices"]]


async def test_a_prompts_ids_answer_as_its_text(
    client: httpx.AsyncClient, tokenizer: GenerationTokenizer
) -> None:
    for text in TEXTS:
        by_text = await complete(client, prompt=text)
        by_ids = await complete(client, prompt=tokenizer.encode(text))
        assert choices(by_ids) == choices(by_text)
        assert by_ids["usage"] == by_text["usage"]
        assert by_ids["usage"]["prompt_tokens"] == len(tokenizer.encode(text))
        assert by_ids["choices"][0]["text"]  # not vacuous


async def test_a_list_of_id_lists_is_several_prompts(
    client: httpx.AsyncClient, tokenizer: GenerationTokenizer
) -> None:
    by_text = await complete(client, prompt=TEXTS)
    by_ids = await complete(client, prompt=[tokenizer.encode(text) for text in TEXTS])
    assert len(by_ids["choices"]) == 2
    assert [c["index"] for c in by_ids["choices"]] == [0, 1]
    assert choices(by_ids) == choices(by_text)
    assert by_ids["usage"] == by_text["usage"]


async def test_n_logprobs_stops_and_streams_work_on_ids(
    client: httpx.AsyncClient, tokenizer: GenerationTokenizer
) -> None:
    body = {"n": 2, "logprobs": 2, "stop": [" the"], "max_tokens": 8}
    ids = [tokenizer.encode(text) for text in TEXTS]
    by_text = await complete(client, prompt=TEXTS, **body)
    by_ids = await complete(client, prompt=ids, **body)
    assert len(by_ids["choices"]) == 4
    assert by_ids["choices"] == by_text["choices"]
    streamed = {**GREEDY, **body, "prompt": ids, "stream": True}
    streamed["stream_options"] = {"include_usage": True}
    response = await client.post("/v1/completions", json=streamed)
    assert response.status_code == 200, response.text
    events = sse_payloads(response.content)
    texts = [""] * 4
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in by_text["choices"]]
    assert events[-1]["usage"] == by_text["usage"]


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


async def test_an_id_past_the_vocabulary_is_a_400_naming_it(
    client: httpx.AsyncClient, tokenizer: GenerationTokenizer
) -> None:
    size = tokenizer.vocabulary_size
    last = await complete(client, prompt=[1, size - 1], max_tokens=1)  # the last id is served
    assert last["usage"]["prompt_tokens"] == 2
    for prompt, named, param in [
        ([1, size], "the prompt", "prompt"),
        ([[1, 2], [3, size + 5, size]], "prompt 1", "prompt[1]"),
    ]:
        response = await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})
        error = error_of(response)
        assert error["code"] == "invalid_request"
        bad = size if param == "prompt" else size + 5
        assert f"{named} holds token id {bad}" in error["message"], error
        assert str(size) in error["message"]
        assert error["param"] == param


@pytest.mark.parametrize(
    "prompt",
    [[], [[]], [[1, 2], []], ["hi", 1], [1, "hi"], [[1, 2], "hi"], [[1, "hi"]], [-1], [True]],
)
async def test_empty_and_mixed_lists_are_400s(client: httpx.AsyncClient, prompt: Any) -> None:
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})
    assert error_of(response)["param"].startswith("prompt"), response.text


async def test_the_context_limit_applies_to_ids(client: httpx.AsyncClient) -> None:
    prompt = [5] * (SLOT_TOKENS - 4)
    response = await client.post(
        "/v1/completions", json={**GREEDY, "prompt": [[1, 2], prompt], "max_tokens": 8}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt[1]"
    assert f"prompt 1 has {SLOT_TOKENS - 4} tokens and asks for 8 more" in error["message"]
    fits = await complete(client, prompt=prompt, max_tokens=4)
    assert fits["usage"]["prompt_tokens"] == SLOT_TOKENS - 4


async def test_each_id_list_counts_as_one_input(client: httpx.AsyncClient) -> None:
    """STEADY_MAX_INPUTS_PER_REQUEST (64 here) counts prompts: 65 id lists are a 413, one
    list of 100 ids one prompt."""
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": [[1, 2]] * 65})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["param"] == "prompt"
    assert len((await complete(client, prompt=[5] * 100, max_tokens=1))["choices"]) == 1
