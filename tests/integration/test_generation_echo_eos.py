"""Completions whose greedy next token is EOS, over real HTTP (the real engine in its own
process, and in-process with multi-step decoding), as lm-eval-harness's loglikelihood asks:
`token_logprobs` must hold every prompt token and then the token that ended the choice, so
that `sum(token_logprobs[ctxlen:-1])` sums the whole continuation. The engine keeps no EOS
as generated text; its log probabilities were never sent, so the list was one short and
lm-eval's `[:-1]` cut the continuation's last token (a wrong score, 200).

The model is the tiny one with its EOS row of the head set to twice the row of the greedy
next token of `PROMPT` (a positive logit, the largest there): EOS is then that prompt's
greedy next token, deterministically. The reference forward runs the same patched weights.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation import load_reference, sse_payloads
from tests.support.generation_api import ENGINE_MODES, served

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = CORPUS[3][:40]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def eos_model(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model whose greedy next token after `PROMPT` is EOS."""
    directory = tmp_path_factory.mktemp("tiny-eos") / "model"
    shutil.copytree(tiny_causal_lm, directory)
    tokenizer, model = load_reference(directory)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
    greedy = int(logits.argmax())
    assert logits[greedy] > 0
    weights_path = directory / "model.safetensors"
    weights = load_file(weights_path)
    head = weights["lm_head.weight"]
    head[model.config.eos_token_id] = head[greedy] * 2
    save_file(weights, weights_path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def reference(eos_model: Path) -> tuple[Any, PreTrainedModel]:
    return load_reference(eos_model)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=ENGINE_MODES)
async def base_url(
    request: pytest.FixtureRequest, eos_model: Path, tiny_causal_lm_without_chat_template: Path
) -> AsyncIterator[str]:
    async with served(request.param, eos_model, tiny_causal_lm_without_chat_template) as url:
        yield url


def expected_logprobs(reference: tuple[Any, PreTrainedModel]) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids, and (len, vocab) log-softmax rows, the last after the whole prompt;
    checks that EOS is its greedy next token."""
    tokenizer, model = reference
    ids: list[int] = tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1).cpu()
    assert int(expected[-1].argmax()) == model.config.eos_token_id
    return ids, expected


def lm_eval_body(ids: list[int], **more: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "echo": True, **more}  # fmt: skip


async def test_echo_ending_at_eos_lists_eos_last(
    client: httpx.AsyncClient, reference: tuple[Any, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    ids, expected = expected_logprobs(reference)
    eos = model.config.eos_token_id
    response = await client.post("/v1/completions", json=lm_eval_body(ids))
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 0  # EOS is not counted (as before)
    assert len(logprobs["token_logprobs"]) == len(ids) + 1
    assert logprobs["tokens"][-1] == tokenizer.convert_ids_to_tokens(eos)
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)  # EOS not in it
    assert logprobs["text_offset"][-1] == len(choice["text"])
    assert logprobs["token_logprobs"][-1] == pytest.approx(expected[-1, eos].item(), abs=TOLERANCE)
    assert next(iter(logprobs["top_logprobs"][-1])) == logprobs["tokens"][-1]
    # lm-eval's loglikelihood of the prompt's second half: its last token is summed too.
    ctxlen = len(ids) // 2
    wanted = sum(expected[p - 1, ids[p]].item() for p in range(ctxlen, len(ids)))
    assert sum(logprobs["token_logprobs"][ctxlen:-1]) == pytest.approx(wanted, abs=1e-3)


async def test_streamed_and_unechoed_answers_list_eos_with_the_last_chunk(
    client: httpx.AsyncClient, reference: tuple[Any, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    ids, expected = expected_logprobs(reference)
    eos_name = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    whole = (await client.post("/v1/completions", json=lm_eval_body(ids))).json()
    streamed = await client.post("/v1/completions", json=lm_eval_body(ids, stream=True))
    assert streamed.status_code == 200, streamed.text
    chunks = [c["choices"][0] for c in sse_payloads(streamed.content) if c["choices"]]
    listed = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    assert listed[-1]["tokens"][-1] == eos_name
    assert chunks[-1]["finish_reason"] == "stop"
    joined = [lp for part in listed for lp in part["token_logprobs"]]
    assert joined == whole["choices"][0]["logprobs"]["token_logprobs"]
    # Without echo: the choice's only logprob is EOS's, its text empty.
    plain = (await client.post("/v1/completions", json=lm_eval_body(ids, echo=False))).json()
    choice = plain["choices"][0]
    assert choice["text"] == ""
    assert choice["logprobs"]["tokens"] == [eos_name]
    assert choice["logprobs"]["text_offset"] == [0]
    eos_logprob = expected[-1, model.config.eos_token_id].item()
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([eos_logprob], abs=TOLERANCE)


async def test_infer_does_not_list_eos(
    client: httpx.AsyncClient, reference: tuple[Any, PreTrainedModel]
) -> None:
    """/infer lists the tokens of its text alone, as chat does (OpenAI's chat lists no end
    token): ending at EOS, its logprobs are empty, as before."""
    ids, _ = expected_logprobs(reference)
    tokenizer, _ = reference
    assert tokenizer(PROMPT)["input_ids"] == ids  # /infer tokenizes the text the same way
    parameters = {"max_new_tokens": 1, "logprobs": 1}
    body = {"model": "tiny", "inputs": PROMPT, "parameters": parameters}
    response = await client.post("/infer", json=body)
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    assert output["finish_reason"] == "stop" and output["text"] == ""
    assert output["logprobs"] == [] and output["completion_tokens"] == 0
