"""The tokenizer routes vLLM serves, so a client needs no local tokenizer (lm-eval-harness's
`local-completions` with `tokenizer_backend="auto"` probes them and then uses them):
`POST /tokenize` (a text, or chat messages rendered by the model's chat template),
`POST /detokenize` and `GET /tokenizer_info`.

Any model with a tokenizer is served, an embedding model's too (as vLLM serves any model's):
/tokenize gives the ids the server itself would feed the model. `model` left out names the
one generate model served (STEADY_DEFAULT_MODEL where it is set), else 400.

No engine call and no admission: not shed, not charged to the token bucket, not counted in
flight (a client such as lm-eval tokenizes every request before sending it, and a refusal
here would fail the evaluation for capacity the engine still has). What bounds their cost is
the body limit, the character limit a prompt has on the generation routes (context x
MAX_CHARS_PER_TOKEN, refused before any tokenizer pass: 413 `input_too_long`), and the
tokenizer pool, which takes every large text off the event loop.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from app.admission import Rejected, RejectReason
from app.api.common import body_document, json_body, render, validated
from app.api.errors import texts_as_sent, token_prompts_as_sent
from app.api.errors_doc import CONNECTION_CAP, ERRORS
from app.api.generate import generation_of
from app.api.responses import service_of
from app.generation.chat import TOKENIZER_CONFIG, ChatTemplate
from app.generation.errors import ModelNotChosen, NoChatTemplate
from app.generation.pipeline import check_vocabulary
from app.generation.tokenizer import GenerationTokenizer
from app.models.tokenizer import FastTokenizer, InputTooLong, read_json
from app.schemas_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from app.service import MAX_CHARS_PER_TOKEN, Service, WrongTask

router = APIRouter()

TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")
# An id decodes to a few characters: the pool takes a list of ids as a text this long.
_CHARS_PER_ID = 4
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
_REFUSALS: dict[int | str, dict[str, object]] = {
    code: ERRORS[code] for code in (400, 404, 413, 422, 503)
}
# Either form (their components: api/openapi.py); `messages` picks the chat form.
_TOKENIZE_BODY = body_document(TokenizeCompletionRequest)
_TOKENIZE_BODY["requestBody"]["content"]["application/json"]["schema"] = {
    "anyOf": [
        {"$ref": f"#/components/schemas/{schema.__name__}"}
        for schema in (TokenizeCompletionRequest, TokenizeChatRequest)
    ]
}


def chosen_model(service: Service, name: str | None) -> str:
    """The model a tokenizer route serves: `name`, else STEADY_DEFAULT_MODEL where it is set,
    else the one generate model served. Raises `UnknownModel` (404) or `ModelNotChosen`."""
    if name:
        return service.resolve_model(name)
    if service.settings.default_model:
        return service.resolve_model(service.settings.default_model)
    generate = [n for n in service.model_names() if service.model_task(n) == "generate"]
    if len(generate) != 1:
        raise ModelNotChosen(generate)
    return generate[0]


def _tokenizer(service: Service, model: str) -> FastTokenizer:
    """The model's tokenizer; raises `WrongTask` (a model without one: 400) or `Rejected`
    (503 `not_ready`: start-up has not loaded it yet)."""
    task = service.model_task(model)
    if task not in ("embed", "generate"):
        raise WrongTask(model, task, "embed' or 'generate")
    tokenizer = service.tokenizers.get(model)
    if not isinstance(tokenizer, FastTokenizer):
        raise Rejected(RejectReason.NOT_READY, "the tokenizers are not loaded yet", 1.0)
    return tokenizer


def _max_model_len(request: Request, model: str, tokenizer: FastTokenizer) -> int:
    """What one sequence may hold: for a generate model what /v1/completions enforces."""
    if isinstance(tokenizer, GenerationTokenizer):
        return generation_of(request).context_limit(model)
    return tokenizer.max_input_tokens


def _refuse_over_characters(text: str, max_model_len: int) -> None:
    """The generation routes' character limit, before any tokenizer pass."""
    max_chars = max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > max_chars:
        raise InputTooLong(0, len(text), max_chars, "characters")


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses={**_REFUSALS, **CONNECTION_CAP},
    openapi_extra=_TOKENIZE_BODY,
)
async def tokenize(request: Request) -> Response:
    raw = await json_body(request)
    body: TokenizeChatRequest | TokenizeCompletionRequest
    if isinstance(raw, dict) and "messages" in raw:  # the chat form
        body = validated(request, TokenizeChatRequest, raw)
    else:
        body = validated(request, TokenizeCompletionRequest, raw)
    service = service_of(request)
    model = chosen_model(service, body.model)
    tokenizer = _tokenizer(service, model)
    limit = _max_model_len(request, model, tokenizer)
    if isinstance(body, TokenizeChatRequest):
        template = _chat_template(tokenizer)
        if template is None:
            raise NoChatTemplate(model)
        messages = [
            {**message.model_dump(exclude={"content"}), "content": message.text()}
            for message in body.messages
        ]
        rendered = template.render(messages, body.add_generation_prompt)
        (text,) = texts_as_sent(request, "messages", rendered)
    else:
        (text,) = texts_as_sent(request, "prompt", body.prompt)
    _refuse_over_characters(text, limit)
    ids = await service.run_tokenizer(
        len(text), request.state.server_timing, tokenizer.encode, text, body.add_special_tokens
    )
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": limit, "tokens": ids}
    answer["token_strs"] = tokenizer.token_strs(ids) if body.return_token_strs else None
    return render(request, answer)


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses={**_REFUSALS, **CONNECTION_CAP},
    openapi_extra=body_document(DetokenizeRequest),
)
async def detokenize(request: Request) -> Response:
    body = validated(request, DetokenizeRequest, await json_body(request))
    service = service_of(request)
    model = chosen_model(service, body.model)
    tokenizer = _tokenizer(service, model)
    # A bad id is named as /v1/completions' token-id prompts name theirs (`tokens`).
    ids = token_prompts_as_sent(request, "tokens", body.tokens)[0] if body.tokens else []
    check_vocabulary(0, ids, tokenizer.vocabulary_size)
    # Special tokens kept, as vLLM's (transformers' `decode`) keeps them.
    text = await service.run_tokenizer(
        len(ids) * _CHARS_PER_ID, request.state.server_timing, tokenizer.decode, ids, False
    )
    return render(request, {"prompt": text})


@router.get("/tokenizer_info", responses={**_REFUSALS, **CONNECTION_CAP})
async def tokenizer_info(request: Request, model: str | None = Query(None)) -> Response:
    """The tokenizer's configuration as vLLM answers it (tokenizer_config.json, special
    tokens as their text), with `model_max_length` the context this server serves."""
    service = service_of(request)
    chosen = chosen_model(service, model)
    tokenizer = _tokenizer(service, chosen)
    return render(request, _info(tokenizer, _max_model_len(request, chosen, tokenizer)))


def _chat_template(tokenizer: FastTokenizer) -> ChatTemplate | None:
    return tokenizer.chat_template if isinstance(tokenizer, GenerationTokenizer) else None


@functools.lru_cache(maxsize=64)
def _config(path: Path) -> dict[str, Any]:
    """A tokenizer_config.json, read once (it is the model's, unchanged while served)."""
    return read_json(path)


def _token_text(value: object) -> object:
    """An AddedToken's dict as its text (transformers' `init_kwargs` hold the objects)."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return value


def _info(tokenizer: FastTokenizer, max_model_len: int) -> dict[str, Any]:
    config = _config(tokenizer.directory / TOKENIZER_CONFIG)
    info: dict[str, Any] = {
        key: _token_text(value)
        for key, value in config.items()
        if key != "added_tokens_decoder"  # every added token: not configuration
    }
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key in _SPECIAL_TOKEN_KEYS:
        info.setdefault(key, None)
    template = _chat_template(tokenizer)
    info["chat_template"] = None if template is None else template.source
    info["model_max_length"] = max_model_len
    return info
