"""Completions' `echo` over real HTTP, with the tiny random-weight causal LM and the real
engine (in its own process, and in-process with multi-step decoding), as lm-eval-harness's
`local-completions` asks for loglikelihoods: token-id prompts (a list of id lists), greedy,
`max_tokens` 1, `logprobs` 1, `echo`; it reads `sum(token_logprobs[ctxlen:-1])` and
whether every `token_logprobs[i] == max(top_logprobs[i].values())`. Every prompt token's
log probability is the log-softmax of a reference forward over the prompt (and the
generated token) at the position before it, within 1e-4; the first prompt token's entries
are null. `max_tokens` 0 (older lm-eval, OpenAI's legacy API) echoes the prompt alone. Echo
was refused (400) before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import torch
from transformers import PreTrainedModel

from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation import sse_payloads
from tests.support.generation_api import ENGINE_MODES, served

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [CORPUS[0][:15], CORPUS[3][:40], CORPUS[5], CORPUS[8][:9]]
TOLERANCE = 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=ENGINE_MODES)
async def base_url(
    request: pytest.FixtureRequest, tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path
) -> AsyncIterator[str]:
    async with served(request.param, tiny_causal_lm, tiny_causal_lm_without_chat_template) as url:
        yield url


def reference_logprobs(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): row p the log-softmax before token p + 1 (the last: after all)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


async def completion(client: httpx.AsyncClient, **body: object) -> Any:
    response = await client.post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


def lm_eval_body(prompts: list[list[int]]) -> dict[str, object]:
    return {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # fmt: skip


def check_choice(
    reference: tuple[Any, PreTrainedModel], ids: list[int], choice: dict[str, Any]
) -> None:
    """One echoed choice against the reference forward, and read as lm-eval reads it."""
    tokenizer, model = reference
    logprobs = choice["logprobs"]
    generated = logprobs["tokens"][-1]
    expected = reference_logprobs(model, ids)
    greedy_next = int(expected[-1].argmax())
    assert len(logprobs["token_logprobs"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    served = logprobs["token_logprobs"][1:]
    wanted = [expected[p - 1, ids[p]].item() for p in range(1, len(ids))]
    wanted.append(expected[-1, greedy_next].item())  # the generated (greedy) token's
    assert served == pytest.approx(wanted, abs=TOLERANCE)
    for p, top in enumerate(logprobs["top_logprobs"][1:], start=1):
        assert max(top.values()) == pytest.approx(expected[p - 1].max().item(), abs=TOLERANCE)
    assert generated == next(iter(logprobs["top_logprobs"][-1]))  # greedy: the top one
    assert choice["text"].startswith(tokenizer.decode(ids, skip_special_tokens=True))
    # lm-eval's loglikelihood of a continuation (the second half of the prompt).
    ctxlen = len(ids) // 2
    tokens = logprobs["token_logprobs"][ctxlen:-1]
    tops = logprobs["top_logprobs"][ctxlen:-1]
    reference_sum = sum(expected[p - 1, ids[p]].item() for p in range(ctxlen, len(ids)))
    assert sum(tokens) == pytest.approx(reference_sum, abs=1e-3)
    is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens, tops, strict=True))
    reference_greedy = all(int(expected[p - 1].argmax()) == ids[p] for p in range(ctxlen, len(ids)))
    assert is_greedy == reference_greedy
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(choice["text"])


async def test_lm_eval_loglikelihood_requests_equal_a_reference_forward(
    client: httpx.AsyncClient, reference: tuple[Any, PreTrainedModel]
) -> None:
    """Several prompts of different lengths in one request, and the same one at once with
    single-prompt requests (concurrent prefills batched together)."""
    tokenizer, _ = reference
    prompts: list[list[int]] = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    answers = await asyncio.gather(
        completion(client, **lm_eval_body(prompts)),
        *(completion(client, **lm_eval_body([ids])) for ids in prompts),
    )
    together = answers[0]
    assert [c["index"] for c in together["choices"]] == list(range(len(prompts)))
    for ids, choice in zip(prompts, together["choices"], strict=True):
        check_choice(reference, ids, choice)
        assert choice["finish_reason"] in ("length", "stop")
    for ids, alone in zip(prompts, answers[1:], strict=True):
        check_choice(reference, ids, alone["choices"][0])
    usage = together["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == len(prompts)


async def test_max_tokens_0_echoes_the_prompt_alone_whole_and_streamed(
    client: httpx.AsyncClient, reference: tuple[Any, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    ids: list[int] = tokenizer(PROMPTS[1])["input_ids"]
    body = {**lm_eval_body([ids]), "max_tokens": 0, "n": 2}
    answer = await completion(client, **body)
    expected = reference_logprobs(model, ids)
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert len(answer["choices"]) == 2  # each choice echoes
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "length"
        assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids)
        assert logprobs["token_logprobs"][1:] == pytest.approx(
            [expected[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=TOLERANCE
        )
    response = await client.post(
        "/v1/completions", json={"model": "tiny", **body, "n": 1, "stream": True}
    )
    assert response.status_code == 200, response.text
    chunks = [c for c in sse_payloads(response.content) if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first == answer["choices"][0]["logprobs"]  # the first chunk carries the prompt
    refused = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 0}
    )
    assert refused.status_code == 400, refused.text
    assert "0 only with echo" in refused.json()["error"]["message"]


async def test_echo_with_a_text_prompt_prefixes_the_completion_and_shifts_its_offsets(
    client: httpx.AsyncClient,
) -> None:
    """Without logprobs: the text only; with them, the generated tokens' offsets begin after
    the prompt's text; streamed, the chunks concatenate to the whole answer."""
    prompt = PROMPTS[0]
    plain = await completion(client, prompt=prompt, max_tokens=6, temperature=0)
    text = plain["choices"][0]["text"]
    echoed = await completion(client, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed["choices"][0]["text"] == prompt + text
    assert echoed["choices"][0]["logprobs"] is None
    assert echoed["usage"] == plain["usage"]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2}
    asked = await completion(client, **body)
    choice = asked["choices"][0]
    assert choice["text"] == prompt + text
    logprobs = choice["logprobs"]
    prompt_tokens = asked["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == prompt_tokens + asked["usage"]["completion_tokens"]
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert offsets[prompt_tokens] == len(prompt)  # the first generated token's
    streamed = await client.post("/v1/completions", json={"model": "tiny", **body, "stream": True})
    chunks = [c["choices"][0] for c in sse_payloads(streamed.content) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert chunks[0]["text"] == prompt
    joined: dict[str, list[Any]] = {key: [] for key in logprobs}
    for c in chunks:
        for key, values in (c["logprobs"] or {}).items():
            joined[key] += values
    assert joined == logprobs
