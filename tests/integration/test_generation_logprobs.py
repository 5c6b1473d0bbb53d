"""Log probabilities of the generated tokens over real HTTP, with the tiny random-weight
causal LM and the real engine (in its own process, and in-process with multi-step
decoding, where a dispatch's later steps carry them too): each token's log probability is
the log-softmax of the raw logits of a reference forward (`model(prompt + generated)`,
in-process, no cache) within 1e-4, also for a sampled request (before its temperature);
the alternatives are the reference's top-N, in order, and under greedy the chosen token is
the first; the token names and bytes are the tokenizer's; streamed chunks' log
probabilities concatenate to the whole answer's (a stop string included); the `openai`
client parses both; out-of-range values are refused at the edge."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import torch
from transformers import PreTrainedModel
from transformers.convert_slow_tokenizer import bytes_to_unicode

from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation import reference_greedy, sse_payloads
from tests.support.generation_api import ENGINE_MODES, served

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [CORPUS[0][:15], CORPUS[3][:40], CORPUS[5], CORPUS[8][:9]]
NEW_TOKENS = [12, 7, 16, 10]
TOLERANCE = 1e-4
BYTES = {character: byte for byte, character in bytes_to_unicode().items()}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=ENGINE_MODES)
async def base_url(
    request: pytest.FixtureRequest, tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path
) -> AsyncIterator[str]:
    async with served(request.param, tiny_causal_lm, tiny_causal_lm_without_chat_template) as url:
        yield url


def reference_logprobs(
    model: PreTrainedModel, prompt_ids: list[int], generated: list[int]
) -> torch.Tensor:
    """(generated, vocab): the log-softmax of the raw logits before each generated token."""
    ids = torch.tensor([prompt_ids + generated], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's bytes, as the byte-level BPE spells them (an added token: its text)."""
    added = tokenizer.added_tokens_decoder.get(token_id)
    if added is not None:
        return str(added.content).encode()
    return bytes(BYTES[c] for c in tokenizer.convert_ids_to_tokens(token_id))


def token_name(tokenizer: Any, token_id: int) -> str:
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def check_against(
    reference: tuple[Any, PreTrainedModel],
    prompt_ids: list[int],
    generated: list[int],
    served: list[tuple[float, list[int], list[float]]],
    greedy: bool = True,
) -> None:
    """Each served (logprob, top ids, top logprobs) against the reference forward."""
    _, model = reference
    assert len(served) == len(generated) > 0
    expected = reference_logprobs(model, prompt_ids, generated)
    for step, (token, (logprob, top_ids, top_logprobs)) in enumerate(
        zip(generated, served, strict=True)
    ):
        assert logprob == pytest.approx(expected[step, token].item(), abs=TOLERANCE)
        best = torch.topk(expected[step], len(top_ids))
        assert top_ids == best.indices.tolist(), step
        assert top_logprobs == pytest.approx(best.values.tolist(), abs=TOLERANCE)
        if greedy:
            assert top_ids[:1] == [token] and top_logprobs[0] == logprob


async def test_infer_logprobs_equal_a_reference_forward_greedy_and_sampled(
    client: httpx.AsyncClient, reference: tuple[Any, PreTrainedModel]
) -> None:
    """Raw logprobs: a sampled request (temperature 1.7, top_k 5) reports the model's own
    distribution, as a greedy one does."""
    tokenizer, model = reference

    async def infer(prompt: str, new_tokens: int, **sampling: object) -> Any:
        parameters = {"max_new_tokens": new_tokens, "logprobs": 4, **sampling}
        body = {"model": "tiny", "inputs": prompt, "parameters": parameters}
        response = await client.post("/infer", json=body)
        assert response.status_code == 200, response.text
        return response.json()["outputs"][0]

    sampled = {"do_sample": True, "temperature": 1.7, "top_k": 5, "seed": 11}
    greedy, drawn = await asyncio.gather(
        asyncio.gather(*map(infer, PROMPTS, NEW_TOKENS)),
        asyncio.gather(*(infer(p, n, **sampled) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True))),
    )
    for prompt, new_tokens, output, draw in zip(PROMPTS, NEW_TOKENS, greedy, drawn, strict=True):
        prompt_ids = tokenizer(prompt)["input_ids"]
        want = reference_greedy(model, prompt_ids, new_tokens).token_ids
        for answer, is_greedy in ((output, True), (draw, False)):
            tokens = answer["logprobs"]
            assert len(tokens) == answer["completion_tokens"]
            ids = [token["token_id"] for token in tokens]
            if is_greedy:
                assert ids == want
            served = [
                (
                    token["logprob"],
                    [top["token_id"] for top in token["top_logprobs"]],
                    [top["logprob"] for top in token["top_logprobs"]],
                )
                for token in tokens
            ]
            check_against(reference, prompt_ids, ids, served, greedy=is_greedy)
            assert [token["token"] for token in tokens] == [token_name(tokenizer, i) for i in ids]
    assert any(
        [t["token_id"] for t in d["logprobs"]] != [t["token_id"] for t in g["logprobs"]]
        for d, g in zip(drawn, greedy, strict=True)
    ), "the sampled requests drew the greedy tokens"


async def completion(client: httpx.AsyncClient, **body: object) -> Any:
    response = await client.post(
        "/v1/completions", json={"model": "tiny", "temperature": 0, **body}
    )
    assert response.status_code == 200, response.text
    return response


async def test_completions_logprobs_equal_a_reference_forward_and_stream_alike(
    client: httpx.AsyncClient, reference: tuple[Any, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    for prompt, new_tokens in zip(PROMPTS, NEW_TOKENS, strict=True):
        body = {"prompt": prompt, "max_tokens": new_tokens, "logprobs": 5}
        answer = (await completion(client, **body)).json()
        choice = answer["choices"][0]
        choice_logprobs = choice["logprobs"]
        prompt_ids = tokenizer(prompt)["input_ids"]
        generated = reference_greedy(model, prompt_ids, new_tokens).token_ids
        names = choice_logprobs["tokens"]
        assert names == [token_name(tokenizer, token) for token in generated]
        assert len(names) == answer["usage"]["completion_tokens"]
        expected = reference_logprobs(model, prompt_ids, generated)
        for step, top in enumerate(choice_logprobs["top_logprobs"]):
            best = torch.topk(expected[step], 5)
            # In order, the chosen (greedy: the first) among them.
            assert list(top) == [token_name(tokenizer, i) for i in best.indices.tolist()]
            assert list(top.values()) == pytest.approx(best.values.tolist(), abs=TOLERANCE)
            assert next(iter(top)) == names[step]
        token_logprobs = choice_logprobs["token_logprobs"]
        assert token_logprobs == pytest.approx(
            [expected[step, token].item() for step, token in enumerate(generated)], abs=TOLERANCE
        )
        offsets = choice_logprobs["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert offsets[-1] <= len(choice["text"])
        streamed = (await completion(client, **body, stream=True)).content
        chunks = [c["choices"][0] for c in sse_payloads(streamed)]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert concatenated(chunks) == choice_logprobs
        # Not asked: the same text, and none.
        unasked = (await completion(client, prompt=prompt, max_tokens=new_tokens)).json()
        assert unasked["choices"][0]["text"] == choice["text"]
        assert unasked["choices"][0]["logprobs"] is None


def concatenated(chunks: list[Any]) -> dict[str, list[Any]]:
    """The streamed completion chunks' logprobs, joined."""
    joined: dict[str, list[Any]] = {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
    }  # fmt: skip
    for chunk in chunks:
        if chunk["logprobs"] is None:
            assert chunk["text"] == "" and chunk["finish_reason"] is not None
            continue
        for key, values in chunk["logprobs"].items():
            joined[key] += values
    return joined


async def test_a_stop_string_keeps_the_logprobs_of_every_counted_token(
    client: httpx.AsyncClient,
) -> None:
    """Through the token that completed the stop string (`completion_tokens`), whole and
    streamed alike, offsets within the text that was cut."""
    body = {"prompt": PROMPTS[2], "max_tokens": NEW_TOKENS[2], "logprobs": 2}
    full = (await completion(client, **body)).json()["choices"][0]
    names = full["logprobs"]["tokens"]
    # A stop string that begins inside a token's text, past the first token.
    stop_at = next(i for i, name in enumerate(names[1:], 1) if len(name) > 1 and "\\x" not in name)
    start = full["logprobs"]["text_offset"][stop_at]
    stop = full["text"][start + 1 : start + 3]
    stopped = (await completion(client, **body, stop=stop)).json()
    choice = stopped["choices"][0]
    cut = full["text"].index(stop)
    assert choice["text"] == full["text"][:cut] and choice["finish_reason"] == "stop"
    counted = stopped["usage"]["completion_tokens"]
    assert choice["logprobs"]["tokens"] == names[:counted]
    assert choice["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][:counted]
    assert max(choice["logprobs"]["text_offset"]) <= len(choice["text"])
    streamed = (await completion(client, **body, stop=stop, stream=True)).content
    chunks = [c["choices"][0] for c in sse_payloads(streamed)]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert concatenated(chunks) == choice["logprobs"]


async def test_chat_logprobs_through_the_openai_client_whole_and_streamed(
    base_url: str, reference: tuple[Any, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = list(prompt_ids["input_ids"])
    generated = reference_greedy(model, prompt_ids, 14).token_ids
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    asked: dict[str, Any] = {
        "model": "tiny", "messages": messages, "max_completion_tokens": 14, "temperature": 0,
        "logprobs": True, "top_logprobs": 3,
    }  # fmt: skip
    try:
        answer = await client.chat.completions.create(**asked)
        stream = await client.chat.completions.create(**asked, stream=True)
        chunks = [chunk async for chunk in stream]
        plain = await client.chat.completions.create(**{**asked, "top_logprobs": 0})
    finally:
        await client.close()
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert [entry.bytes for entry in content] == [
        list(token_bytes(tokenizer, t)) for t in generated
    ]
    assert [entry.token for entry in content] == [token_name(tokenizer, t) for t in generated]
    served = [
        (
            entry.logprob,
            [
                tokenizer.convert_tokens_to_ids(top_id(tokenizer, top.bytes))
                for top in entry.top_logprobs
            ],
            [top.logprob for top in entry.top_logprobs],
        )
        for entry in content
    ]
    check_against(reference, prompt_ids, generated, served)
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or []
    ]
    # Equal up to rounding: the later requests reuse the first's prompt in its KV-cache slot
    # (prefix reuse), keys and values another forward computed.
    assert_same_logprobs(streamed, content)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        answer.choices[0].message.content
    )
    plain_logprobs = plain.choices[0].logprobs
    assert plain_logprobs is not None and plain_logprobs.content is not None
    assert [e.top_logprobs for e in plain_logprobs.content] == [[] for _ in generated]
    assert [e.logprob for e in plain_logprobs.content] == pytest.approx(
        [e.logprob for e in content], abs=TOLERANCE
    )


def assert_same_logprobs(left: list[Any], right: list[Any]) -> None:
    """The same tokens and top tokens, their log probabilities equal up to rounding."""
    assert [(e.token, e.bytes, [t.bytes for t in e.top_logprobs]) for e in left] == [
        (e.token, e.bytes, [t.bytes for t in e.top_logprobs]) for e in right
    ]
    for one, other in zip(left, right, strict=True):
        assert one.logprob == pytest.approx(other.logprob, abs=TOLERANCE)
        tops = [t.logprob for t in one.top_logprobs]
        assert tops == pytest.approx([t.logprob for t in other.top_logprobs], abs=TOLERANCE)


def top_id(tokenizer: Any, raw: list[int] | None) -> str:
    """The vocabulary entry of a token given by its bytes (an added token: its text)."""
    assert raw is not None
    text = bytes(raw)
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if str(added.content).encode() == text:
            return str(tokenizer.convert_ids_to_tokens(token_id))
    spell = {byte: character for character, byte in BYTES.items()}
    return "".join(spell[byte] for byte in text)


async def test_the_openai_client_parses_completion_logprobs(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    try:
        answer = await client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2
        )
        stream = await client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, stream=True
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 6
    assert logprobs.top_logprobs is not None and all(len(t) <= 3 for t in logprobs.top_logprobs)
    streamed = [
        t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []
    ]
    assert streamed == logprobs.tokens


@pytest.mark.parametrize(
    ("route", "body", "names"),
    [
        ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 6}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 1}, "needs logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/infer", {"inputs": "Hi", "parameters": {"logprobs": 21}}, "logprobs"),
    ],
)
async def test_out_of_range_logprobs_are_refused_at_the_edge(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], names: str
) -> None:
    if route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    response = await client.post(route, json={"model": "tiny", **body})
    assert response.status_code == (422 if route == "/infer" else 400), response.text
    error = response.json()["error"]
    assert names in f"{error['message']} {error.get('param')}", error
