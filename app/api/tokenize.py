"""The tokenizer routes vLLM serves, so a client needs no local tokenizer (lm-eval-harness's
`local-completions` with `tokenizer_backend="auto"` probes them and then uses them):
`POST /tokenize` (a text, or chat messages rendered by the model's chat template),
`POST /detokenize` and `GET /tokenizer_info`.

Any model with a tokenizer is served, an embedding model's too (as vLLM serves any model's):
/tokenize gives the ids the server itself would feed the model. `model` left out names
STEADY_DEFAULT_MODEL where it is set, else the one generate model served, else (no generate
model) the one model with a tokenizer, else 400 (`default_tokenizer_model`).

No engine call and no admission: not shed, not charged to the token bucket, not counted in
flight (a client such as lm-eval tokenizes every request before sending it, and a refusal
here would fail the evaluation for capacity the engine still has). What bounds their cost is
the body limit, the character limit a prompt has on the generation routes (context x
MAX_CHARS_PER_TOKEN, refused before any tokenizer pass: 413 `input_too_long`), /detokenize's
MAX_DETOKENIZE_IDS (413 `too_many_inputs`, counted before its ids are validated), and the
tokenizer pool, which takes every large input's tokenizer work off the event loop: encoding,
`token_strs`, decoding. Parsing the body, rendering a chat template (its messages bounded
as chat completions' are) and rendering the answer stay on the loop, as on every route.

A generate model's `max_model_len` is what its engine reports (the KV-cache slot, the
model's positions): until then /tokenize and /tokenizer_info answer 503 `not_ready` rather
than the tokenizer's own, larger limit.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from app.admission import Rejected, RejectReason
from app.api.common import body_document, json_body, render, too_many_inputs, validated
from app.api.errors import texts_as_sent, token_prompts_as_sent
from app.api.errors_doc import CONNECTION_CAP, ERRORS
from app.api.generate import generation_of
from app.api.responses import service_of
from app.generation.chat import ChatTemplate, tokenizer_configuration
from app.generation.errors import ModelNotChosen, NoChatTemplate
from app.generation.pipeline import check_vocabulary
from app.generation.tokenizer import GenerationTokenizer
from app.models.tokenizer import FastTokenizer, InputTooLong
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
# The most ids one /detokenize decodes: a 128k-token sequence, the longest context common
# models serve. Counted in the raw body, before each id is validated on the event loop; more
# is 413 `too_many_inputs` naming it (the body limit alone let ~500k through, decoding to
# tens of MB).
MAX_DETOKENIZE_IDS = 131_072
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# tokenizer_config.json's keys /tokenizer_info leaves out. Paths where the tokenizer was
# saved (older transformers wrote the saving machine's absolute paths into `name_or_path`,
# `tokenizer_file`, `special_tokens_map_file`), `auto_map` (the model repository's own code
# to import, of no use to a client without its files) and `added_tokens_decoder` (every
# added token: not configuration).
_LEFT_OUT_KEYS = frozenset(
    {
        "name_or_path",
        "tokenizer_file",
        "special_tokens_map_file",
        "auto_map",
        "added_tokens_decoder",
    }
)
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


def tokenizer_models(service: Service) -> list[str]:
    """The served models with a tokenizer (an embed or generate model's; a tensor model has
    none), in the order they are served."""
    return [n for n in service.model_names() if service.model_task(n) in ("embed", "generate")]


def default_tokenizer_model(service: Service) -> str | None:
    """The model a tokenizer route serves when the request names none: STEADY_DEFAULT_MODEL
    where it is set, else the one generate model served, else (no generate model) the one
    model with a tokenizer; None where none of these picks one (then `model` is required,
    as the OpenAPI document says: `openapi_tokenize.py`)."""
    if service.settings.default_model:
        return service.settings.default_model
    generate = [n for n in service.model_names() if service.model_task(n) == "generate"]
    if generate:
        return generate[0] if len(generate) == 1 else None
    served = tokenizer_models(service)
    return served[0] if len(served) == 1 else None


def chosen_model(service: Service, name: str | None) -> str:
    """The model a tokenizer route serves: `name`, else `default_tokenizer_model`. Raises
    `UnknownModel` (404) or `ModelNotChosen` (400: none named and no default)."""
    if name:
        return service.resolve_model(name)
    default = default_tokenizer_model(service)
    if default is None:
        raise ModelNotChosen(tokenizer_models(service))
    return service.resolve_model(default)


def _tokenizer(service: Service, model: str) -> FastTokenizer:
    """The model's tokenizer; raises `WrongTask` (a model without one: 400) or `Rejected`
    (503 `not_ready`: start-up has not loaded it yet)."""
    task = service.model_task(model)
    if task not in ("embed", "generate"):
        raise WrongTask(model, task, "embed", "generate")
    tokenizer = service.tokenizers.get(model)
    if not isinstance(tokenizer, FastTokenizer):
        raise Rejected(RejectReason.NOT_READY, "the tokenizers are not loaded yet", 1.0)
    return tokenizer


def _max_model_len(request: Request, model: str, tokenizer: FastTokenizer) -> int:
    """What one sequence may hold: for a generate model what /v1/completions enforces,
    which its engine reports (raises `Rejected`, 503 `not_ready`, until it has: the
    tokenizer's own limit is larger than the KV-cache slot served)."""
    if not isinstance(tokenizer, GenerationTokenizer):
        return tokenizer.max_input_tokens
    if service_of(request).model_info(model) is None:
        raise Rejected(RejectReason.NOT_READY, "the engine has not reported the model yet", 1.0)
    return generation_of(request).context_limit(model)


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
    ids, strs = await service.run_tokenizer(
        len(text),
        request.state.server_timing,
        _encoded,
        tokenizer,
        text,
        body.add_special_tokens,
        body.return_token_strs,
    )
    answer = {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}
    return render(request, answer)


def _encoded(
    tokenizer: FastTokenizer, text: str, add_special_tokens: bool, with_strs: bool
) -> tuple[list[int], list[str] | None]:
    """The text's ids and, asked, their vocabulary entries: one call, so that the pool
    takes both off the event loop for a large text (an entry is one Python call an id)."""
    ids = tokenizer.encode(text, add_special_tokens)
    return ids, tokenizer.token_strs(ids) if with_strs else None


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses={**_REFUSALS, **CONNECTION_CAP},
    openapi_extra=body_document(DetokenizeRequest),
)
async def detokenize(request: Request) -> Response:
    raw = await json_body(request)
    if isinstance(raw, dict) and isinstance(ids_sent := raw.get("tokens"), list):
        too_many = too_many_inputs(
            request, len(ids_sent), "tokens", what="token ids", limit=MAX_DETOKENIZE_IDS
        )
        if too_many is not None:
            return too_many
    body = validated(request, DetokenizeRequest, raw)
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
def _config(directory: Path) -> dict[str, Any]:
    """The tokenizer's configuration with its special tokens map under it (as the chat
    template reads it), read once (the model's, unchanged while served)."""
    return tokenizer_configuration(directory)


def _token_text(value: object) -> object:
    """An AddedToken's dict as its text (transformers' `init_kwargs` hold the objects), a
    list's (`additional_special_tokens`) each."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, list):
        return [_token_text(item) for item in value]
    return value


def _info(tokenizer: FastTokenizer, max_model_len: int) -> dict[str, Any]:
    config = _config(tokenizer.directory)
    info: dict[str, Any] = {
        key: _token_text(value) for key, value in config.items() if key not in _LEFT_OUT_KEYS
    }
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key in _SPECIAL_TOKEN_KEYS:
        info.setdefault(key, None)
    template = _chat_template(tokenizer)
    info["chat_template"] = None if template is None else template.source
    info["model_max_length"] = max_model_len
    return info
