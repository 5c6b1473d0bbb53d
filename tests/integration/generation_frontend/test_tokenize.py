"""The tokenizer routes vLLM serves (`app/api/tokenize.py`), on the tiny causal LM's real
tokenizer, against transformers' own tokenizer of the same files: /tokenize, /detokenize,
/tokenizer_info, lm-eval-harness's `local-completions` probe, and their refusals (each a
4xx JSON error, never a 500). The module's app serves two generate models ("tiny", with a
chat template, and "plain", without) and an embedding model ("minilm")."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.api import tokenize
from app.main import create_app
from app.model_specs import ModelSpec
from app.service import MAX_CHARS_PER_TOKEN
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.openapi_document import documented_valid
from tests.support.scripted_generator import ScriptedGenerator

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = ["Hello world", "a  b\n\tc ", "héllo wörld 🙂 ünïcode", "", "<|eos|> inside"]
JSON = {"content-type": "application/json"}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
]


@pytest.fixture(scope="module")
def reference(tiny_causal_lm: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_causal_lm))


def _ids(encoded: Any) -> list[int]:
    """apply_chat_template's ids, whichever form this transformers gives them in."""
    ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    return list(ids)


async def _tokens(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/tokenize", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_tokenize_is_the_tokenizer_s_own_encode(
    client: httpx.AsyncClient, reference: PreTrainedTokenizerBase
) -> None:
    for text in TEXTS:
        for special in (True, False):
            answer = await _tokens(client, {"prompt": text, "add_special_tokens": special})
            expected = reference(text, add_special_tokens=special)["input_ids"]
            assert answer["tokens"] == expected, (text, special)
            assert answer["count"] == len(expected) and answer["token_strs"] is None
        default = await _tokens(client, {"prompt": text, "return_token_strs": True})
        assert default["tokens"] == reference(text)["input_ids"]  # special tokens by default
        assert default["token_strs"] == reference.convert_ids_to_tokens(default["tokens"])


async def test_the_chat_form_is_apply_chat_template_s_ids(
    client: httpx.AsyncClient, reference: PreTrainedTokenizerBase
) -> None:
    for opened in (True, False):
        answer = await _tokens(client, {"messages": MESSAGES, "add_generation_prompt": opened})
        expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=opened)
        assert answer["tokens"] == _ids(expected), opened
    assert (await _tokens(client, {"messages": MESSAGES}))["tokens"] == _ids(
        reference.apply_chat_template(MESSAGES, add_generation_prompt=True)
    )


async def test_detokenize_undoes_tokenize(
    client: httpx.AsyncClient, reference: PreTrainedTokenizerBase
) -> None:
    for text in TEXTS:
        ids = (await _tokens(client, {"prompt": text, "add_special_tokens": False}))["tokens"]
        back = await client.post("/detokenize", json={"model": "tiny", "tokens": ids})
        assert back.status_code == 200, back.text
        assert back.json() == {"prompt": text}
        with_bos = (await _tokens(client, {"prompt": text}))["tokens"]
        kept = await client.post("/detokenize", json={"model": "tiny", "tokens": with_bos})
        assert kept.json()["prompt"] == reference.decode(with_bos)  # special tokens kept


async def test_tokenizer_info_is_the_tokenizer_s_and_the_context_served(
    client: httpx.AsyncClient, reference: PreTrainedTokenizerBase
) -> None:
    response = await client.get("/tokenizer_info", params={"model": "tiny"})
    assert response.status_code == 200, response.text
    info = response.json()
    for key in ("eos_token", "bos_token", "pad_token", "chat_template"):
        assert info[key] == getattr(reference, key), key
    assert info["chat_template"] and info["tokenizer_class"]
    plain = (await client.get("/tokenizer_info", params={"model": "plain"})).json()
    assert plain["chat_template"] is None and plain["eos_token"] == reference.eos_token
    # The context /v1/completions enforces: a prompt and its new tokens fill it, no more.
    limit = info["model_max_length"]
    prompt = (await _tokens(client, {"prompt": "hello"}))["tokens"]
    assert (await _tokens(client, {"prompt": "hello"}))["max_model_len"] == limit
    body = {"model": "tiny", "prompt": "hello"}
    fits = await client.post("/v1/completions", json={**body, "max_tokens": limit - len(prompt)})
    over = await client.post(
        "/v1/completions", json={**body, "max_tokens": limit - len(prompt) + 1}
    )
    assert fits.status_code == 200, fits.text
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"


async def test_an_embedding_model_is_tokenized_as_the_server_feeds_it(
    app: FastAPI, client: httpx.AsyncClient
) -> None:
    answer = await client.post("/tokenize", json={"model": "minilm", "prompt": "Hello world"})
    assert answer.status_code == 200, answer.text
    ids = answer.json()["tokens"]
    assert len(ids) == 4  # [CLS] hello world [SEP]
    back = await client.post("/detokenize", json={"model": "minilm", "tokens": ids})
    assert back.json()["prompt"] == "[CLS] hello world [SEP]"
    info = (await client.get("/tokenizer_info", params={"model": "minilm"})).json()
    served = app.state.service.tokenizers["minilm"].max_input_tokens  # what /infer takes
    assert info["chat_template"] is None and info["model_max_length"] == served == 256


@pytest_asyncio.fixture(loop_scope="module")
async def one_generate_model(tiny_causal_lm: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A server of one generate model, as lm-eval-harness's probe is sent: without `model`."""
    settings = Settings(
        engine="inprocess",
        models=(ModelSpec(name="tiny", task="generate", source=str(tiny_causal_lm)),),
        spike_reports=False,
    )
    async with serving(create_app(settings, engine=ScriptedGenerator(settings))) as client:
        yield client


async def test_lm_eval_harness_s_remote_tokenizer_probe_and_use(
    one_generate_model: httpx.AsyncClient, reference: PreTrainedTokenizerBase
) -> None:
    client = one_generate_model
    info = await client.get("/tokenizer_info")
    assert info.status_code == 200, info.text
    assert isinstance(info.json(), dict) and "eos_token" in info.json()
    assert {"bos_token", "pad_token", "chat_template"} <= set(info.json())
    probe = await client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert probe.status_code == 200, probe.text
    assert probe.json()["tokens"] == reference("test", add_special_tokens=False)["input_ids"]
    text = "The quick brown fox"
    tokens = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    decoded = await client.post("/detokenize", json={"tokens": tokens.json()["tokens"]})
    assert decoded.json() == {"prompt": text}


async def _refused(response: httpx.Response, status: int, code: str, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    message: str = error["message"]
    return message


async def test_refusals_are_4xx_json_errors(client: httpx.AsyncClient) -> None:
    unknown = await client.post("/tokenize", json={"model": "gpt-17", "prompt": "a"})
    assert "gpt-17" in await _refused(unknown, 404, "model_not_found", "model")
    info = await client.get("/tokenizer_info", params={"model": "gpt-17"})
    await _refused(info, 404, "model_not_found", "model")
    for route, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        unnamed = await client.post(route, json=body)  # two generate models: which?
        message = await _refused(unnamed, 400, "invalid_request", "model")
        assert "tiny, plain" in message, message
    unnamed_info = await client.get("/tokenizer_info")
    await _refused(unnamed_info, 400, "invalid_request", "model")
    outside = await client.post("/detokenize", json={"model": "tiny", "tokens": [5, 10**9]})
    message = await _refused(outside, 400, "invalid_request", "tokens")
    assert "token id 1000000000" in message, message
    chat = await client.post("/tokenize", json={"model": "plain", "messages": MESSAGES})
    assert "no chat template" in await _refused(chat, 400, "invalid_request", "messages")
    limit = (await _tokens(client, {"prompt": "a"}))["max_model_len"]
    long = "a" * (limit * MAX_CHARS_PER_TOKEN + 1)
    oversized = await client.post("/tokenize", json={"model": "tiny", "prompt": long})
    assert "characters" in await _refused(oversized, 413, "input_too_long", "prompt")
    negative = await client.post("/detokenize", json={"model": "tiny", "tokens": [-1]})
    await _refused(negative, 422, "invalid_request", "tokens[0]")
    extra = await client.post("/tokenize", json={"model": "tiny", "prompt": "a", "n": 2})
    await _refused(extra, 422, "invalid_request", "n")


async def test_text_no_tokenizer_takes_is_a_4xx(client: httpx.AsyncClient) -> None:
    """JSON may escape a lone surrogate, which no tokenizer takes (a TypeError)."""

    async def sent(body: dict[str, Any]) -> httpx.Response:
        escaped = json.dumps({"model": "tiny", **body})  # "\\udc00", as a client may send
        return await client.post("/tokenize", content=escaped, headers=JSON)

    lone = await sent({"prompt": "a\udc00"})
    assert 400 <= lone.status_code < 500 and lone.json()["error"]["param"] == "prompt", lone.text
    rendered = await sent({"messages": [{"role": "user", "content": "a\udc00"}]})
    assert rendered.status_code == 400 and rendered.json()["error"]["param"] == "messages"


DOCUMENTED = [
    ("/tokenize", {"model": "tiny", "prompt": "a", "return_token_strs": True}, True),
    ("/tokenize", {"model": "tiny", "prompt": ""}, True),
    ("/tokenize", {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": False}, True),
    ("/detokenize", {"model": "tiny", "tokens": [1, 2]}, True),
    ("/tokenize", {"model": "tiny", "prompt": 5}, False),
    ("/tokenize", {"model": "tiny", "prompt": "a", "messages": MESSAGES}, False),
    ("/tokenize", {"model": "tiny", "messages": []}, False),
    ("/detokenize", {"model": "tiny", "tokens": [-1]}, False),
    ("/detokenize", {"model": "tiny", "tokens": "1 2"}, False),
]


async def test_the_routes_are_documented_as_they_answer(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    assert "get" in document["paths"]["/tokenizer_info"]
    for path, body, valid in DOCUMENTED:
        assert documented_valid(document, path, body) is valid, (path, body)
        response = await client.post(path, json=body)
        assert (response.status_code == 200) is valid, (path, body, response.text)


async def test_default_model_s_precedence_is_documented(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    model = document["components"]["schemas"]["TokenizeCompletionRequest"]["properties"]["model"]
    assert "STEADY_DEFAULT_MODEL" in model["description"]
    refused = document["paths"]["/tokenize"]["post"]["responses"]["400"]["description"]
    assert "`model` left out where no model is picked for it (STEADY_DEFAULT_MODEL unset" in refused


async def test_a_generate_model_s_length_waits_for_its_engine(
    app: FastAPI, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the engine reports, the tokenizer's limit is not what is served: 503."""
    served = (await _tokens(client, {"prompt": "a"}))["max_model_len"]
    monkeypatch.setattr(app.state.test_engine, "status", lambda: None)
    early = await client.post("/tokenize", json={"model": "tiny", "prompt": "a"})
    await _refused(early, 503, "not_ready", None)
    info = await client.get("/tokenizer_info", params={"model": "tiny"})
    await _refused(info, 503, "not_ready", None)
    # Nothing else waits: an embedding model's limit is its tokenizer's, decoding has none.
    assert (await client.get("/tokenizer_info", params={"model": "minilm"})).status_code == 200
    back = await client.post("/detokenize", json={"model": "tiny", "tokens": [5]})
    assert back.status_code == 200, back.text
    monkeypatch.undo()
    assert (await _tokens(client, {"prompt": "a"}))["max_model_len"] == served


async def test_detokenize_s_ids_are_capped(client: httpx.AsyncClient) -> None:
    cap = tokenize.MAX_DETOKENIZE_IDS
    over = await client.post("/detokenize", json={"model": "tiny", "tokens": [5] * (cap + 1)})
    assert over.status_code == 413, over.text[:200]
    message = await _refused(over, 413, "too_many_inputs", "tokens")
    assert message == f"{cap + 1} token ids; at most {cap} per request"
    full = await client.post("/detokenize", json={"model": "tiny", "tokens": [5] * cap})
    assert full.status_code == 200, full.text


async def test_a_large_text_s_token_strs_are_built_off_the_loop(
    app: FastAPI,
    client: httpx.AsyncClient,
    reference: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer = app.state.service.tokenizers["tiny"]
    threads: list[str] = []

    def recorded(ids: list[int]) -> list[str]:
        threads.append(threading.current_thread().name)
        return type(tokenizer).token_strs(tokenizer, ids)

    monkeypatch.setattr(tokenizer, "token_strs", recorded)
    text = "The quick brown fox jumps over the lazy dog. " * 100  # over the inline limit
    answer = await _tokens(client, {"prompt": text, "return_token_strs": True})
    assert answer["token_strs"] == reference.convert_ids_to_tokens(answer["tokens"])
    assert threads and threads[0] != threading.main_thread().name, threads
    small = await _tokens(client, {"prompt": "Hello world", "return_token_strs": True})
    assert small["token_strs"] == reference.convert_ids_to_tokens(small["tokens"])


@pytest.fixture(scope="module")
def legacy_layout(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's files with its special tokens moved from tokenizer_config.json to
    special_tokens_map.json alone, as older tokenizer directories keep them."""
    directory = tmp_path_factory.mktemp("legacy") / "tiny"
    shutil.copytree(tiny_causal_lm, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    special = {key: config.pop(key) for key in ("bos_token", "eos_token", "pad_token")}
    config_path.write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(json.dumps(special))
    return directory


async def test_special_tokens_kept_only_in_the_map_are_answered(legacy_layout: Path) -> None:
    reference = AutoTokenizer.from_pretrained(str(legacy_layout))
    assert reference.eos_token  # transformers reads the map
    settings = Settings(
        engine="inprocess",
        models=(ModelSpec(name="old", task="generate", source=str(legacy_layout)),),
        spike_reports=False,
    )
    async with serving(create_app(settings, engine=ScriptedGenerator(settings))) as client:
        info = (await client.get("/tokenizer_info")).json()
    for key in ("eos_token", "bos_token", "pad_token"):
        assert info[key] == getattr(reference, key), key
    assert info["chat_template"] and "name_or_path" not in info
