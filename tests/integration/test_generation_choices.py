"""`n` samples per prompt from the tiny random-weight causal LM and the real engine (in
process): seeded choices are reproducible and differ, greedy ones are equal; choices are
indexed prompt i's j-th at i * n + j; usage counts each prompt once; streamed choices
concatenate per index to the whole answer's; chat through the openai client; `n` 1's seeded
answers are those of before (prompt i drawn with `prompt_seed(seed, i)`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from app.generation.seeds import prompt_seed, sequence_seed
from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation import sse_payloads
from tests.support.generation_api import IN_PROCESS, served

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [CORPUS[0][:40], CORPUS[1][:60]]
SAMPLED = {"model": "tiny", "max_tokens": 12, "temperature": 1.8, "seed": 11}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base_url(
    tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path
) -> AsyncIterator[str]:
    async with served(IN_PROCESS, tiny_causal_lm, tiny_causal_lm_without_chat_template) as url:
        yield url


async def complete(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/completions", json={**SAMPLED, **fields})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def texts(answer: dict[str, Any]) -> list[str]:
    return [choice["text"] for choice in answer["choices"]]


async def test_seeded_samples_are_reproducible_and_differ(client: httpx.AsyncClient) -> None:
    answer = await complete(client, prompt=PROMPTS[0], n=3)
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    assert all(choice["finish_reason"] in ("stop", "length") for choice in answer["choices"])
    assert len(set(texts(answer))) > 1, texts(answer)
    assert texts(await complete(client, prompt=PROMPTS[0], n=3)) == texts(answer)
    # Choice j is drawn with its own derived seed: alone, with that seed, the same text.
    alone = await complete(client, prompt=PROMPTS[0], seed=sequence_seed(11, 0, 2))
    assert texts(alone) == [texts(answer)[2]]


async def test_two_prompts_choices_are_ordered_prompt_by_prompt(client: httpx.AsyncClient) -> None:
    answer = await complete(client, prompt=PROMPTS, n=3)
    assert [choice["index"] for choice in answer["choices"]] == list(range(6))
    first = await complete(client, prompt=PROMPTS[0], n=3)
    assert texts(answer)[:3] == texts(first)  # prompt 0's choices, then prompt 1's
    second = await complete(client, prompt=PROMPTS[1], seed=sequence_seed(11, 1, 1))
    assert texts(answer)[4] == texts(second)[0]


async def test_greedy_choices_are_equal_and_usage_counts_the_prompt_once(
    client: httpx.AsyncClient,
) -> None:
    one = await complete(client, prompt=PROMPTS[1], temperature=0)
    two = await complete(client, prompt=PROMPTS[1], temperature=0, n=2)
    assert texts(two) == texts(one) * 2
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert two["usage"]["completion_tokens"] == 2 * one["usage"]["completion_tokens"]
    total = two["usage"]["prompt_tokens"] + two["usage"]["completion_tokens"]
    assert two["usage"]["total_tokens"] == total


async def test_streamed_choices_concatenate_per_index(client: httpx.AsyncClient) -> None:
    whole = await complete(client, prompt=PROMPTS, n=2)
    body = {**SAMPLED, "prompt": PROMPTS, "n": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    payloads = sse_payloads(response.content)
    pieces: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for payload in payloads[:-1]:
        (choice,) = payload["choices"]
        pieces[choice["index"]] = pieces.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert [pieces[index] for index in range(4)] == texts(whole)
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert payloads[-1]["usage"] == whole["usage"]


async def test_chat_choices_through_the_openai_client(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "Tell me about tail latency."}]
    try:
        sampled = await client.chat.completions.create(
            model="tiny", messages=messages, n=2, max_tokens=12, temperature=1.8, seed=5
        )
        greedy = await client.chat.completions.create(
            model="tiny", messages=messages, n=2, max_tokens=12, temperature=0
        )
        with pytest.raises(openai.BadRequestError, match="16"):
            await client.chat.completions.create(model="tiny", messages=messages, n=17)
    finally:
        await client.close()
    assert [choice.index for choice in sampled.choices] == [0, 1]
    assert sampled.choices[0].message.content != sampled.choices[1].message.content
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert greedy.usage is not None and sampled.usage is not None


async def test_n_1_seeded_answers_are_those_of_before(client: httpx.AsyncClient) -> None:
    """Prompt i of a seeded request is drawn with `prompt_seed(seed, i)`, as before `n`."""
    both = await complete(client, prompt=PROMPTS)
    for index, prompt in enumerate(PROMPTS):
        alone = await complete(client, prompt=prompt, seed=prompt_seed(11, index))
        assert texts(alone) == [texts(both)[index]]
