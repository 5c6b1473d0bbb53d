"""Text generation over HTTP: /infer on a generate model (dispatched here by `embed.py`'s
/infer), and OpenAI's POST /v1/completions and POST /v1/chat/completions, whole or streamed
as server-sent events ending in `data: [DONE]`.

A streamed answer starts only once its first piece of text (or its end) is known, so every
refusal (size, admission, the engine's own 429) is still a plain JSON error with its status;
a failure after that is an `error` event, then `[DONE]`. A client that disconnects cancels
its sequences in the engine (`run_until_disconnect`, `EventStreamResponse`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Sequence

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.admission import Rejected, RejectReason
from app.api.cancellation import run_until_disconnect
from app.api.common import body_as, body_document, envoy_timeout_ms, render, too_many_inputs
from app.api.errors import (
    REJECTION_STATUS,
    described,
    log_batch_failed,
    texts_as_sent,
    token_prompts_as_sent,
)
from app.api.errors_doc import OPENAI_ERRORS
from app.api.openai_format import Reply, TextChunks, chunk, error_chunk, usage_chunk, whole
from app.api.openai_logprobs import LogprobRender, infer_logprobs
from app.api.responses import service_of
from app.api.sse import DONE, EventStreamResponse, event
from app.engine.client import EngineRefused, EngineUnavailable
from app.failures import DEVICE_LOST, BatchFailed, DeadlineExceeded, DeviceLost
from app.generation.events import GenerationEvent, SequenceEnd, TextPiece
from app.generation.logprobs import TokenLogprob
from app.generation.pipeline import PreparedGeneration, Sampling, TextGeneration
from app.schemas_generation import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerateInferRequest,
    OpenAISampling,
)
from app.schemas_stream import ChatCompletionChunk, CompletionChunk, streamed_answer
from app.timing import PhaseTimer

log = logging.getLogger(__name__)

router = APIRouter()

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def generation_of(request: Request) -> TextGeneration:
    generation: TextGeneration = request.app.state.generation
    return generation


async def _prepare(
    request: Request,
    model: str,
    prompts: Sequence[str | list[int]],
    sampling: Sampling,
    *,
    templated: bool,
    timeout_ms: float | None,
    n: int = 1,
) -> PreparedGeneration:
    timer: PhaseTimer = request.state.server_timing
    timer.latency_bound = False  # /infer on a generate model passes the slow-request timer
    work = generation_of(request).prepare(
        model,
        prompts,
        sampling,
        templated=templated,
        timeout_ms=timeout_ms,
        envoy_timeout_ms=envoy_timeout_ms(request),
        timer=timer,
        n=n,
    )
    return await run_until_disconnect(request, work)


def _events(
    request: Request, prepared: PreparedGeneration, *, incremental: bool
) -> AsyncGenerator[list[GenerationEvent]]:
    timer: PhaseTimer = request.state.server_timing
    return generation_of(request).stream(prepared, timer, incremental=incremental)


Collected = tuple[list[str], list[SequenceEnd], list[list[TokenLogprob]]]


async def _collect(events: AsyncGenerator[list[GenerationEvent]], count: int) -> Collected:
    """Each sequence's text, end and tokens' log probabilities (none unless asked)."""
    texts: list[list[str]] = [[] for _ in range(count)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(count)]
    ends: list[SequenceEnd | None] = [None] * count
    async with contextlib.aclosing(events) as stream:
        async for batch in stream:
            for item in batch:
                if isinstance(item, TextPiece):
                    texts[item.index].append(item.text)
                    logprobs[item.index].extend(item.logprobs)
                else:
                    ends[item.index] = item
    finished = [end for end in ends if end is not None]
    if len(finished) != count:  # a server fault: answered 500
        raise RuntimeError("a sequence ended without its SequenceEnd")
    return ["".join(parts) for parts in texts], finished, logprobs


async def _complete(request: Request, prepared: PreparedGeneration) -> Collected:
    count = prepared.sequences
    events = _events(request, prepared, incremental=False)
    return await run_until_disconnect(request, _collect(events, count))


def _too_many_sequences(request: Request, prompts: int, n: int, param: str) -> Response | None:
    """The 413 of a request of more sequences (prompts x n) than one may run: the input cap,
    or what a generate model runs and queues at once (STEADY_GENERATE_SLOTS +
    STEADY_GENERATE_MAX_WAITING): its sequences reach the engine together, which refuses
    those past its waiting line (429) however idle it is, so such a request never fits."""
    settings = service_of(request).settings
    held = settings.generate_slots + settings.generate_max_waiting
    what = "inputs" if n == 1 else f"sequences ({prompts} prompts x n={n})"
    limit = min(settings.max_inputs_per_request, held)
    return too_many_inputs(request, prompts * n, param, what=what, limit=limit)


async def infer_generate(request: Request, body: GenerateInferRequest) -> Response:
    """/infer on a generate model (its request already validated)."""
    prompts = texts_as_sent(request, "inputs", body.inputs)
    service = service_of(request)
    if (too_many := _too_many_sequences(request, len(prompts), 1, "inputs")) is not None:
        return too_many
    model = service.resolve_model(body.model)
    parameters = body.parameters
    sampling = Sampling(
        max_new_tokens=parameters.max_new_tokens,
        do_sample=parameters.do_sample,
        temperature=parameters.temperature,
        top_p=parameters.top_p,
        top_k=parameters.top_k,
        seed=parameters.seed,
        stops=tuple(parameters.stop),
        logprobs=parameters.logprobs,
    )
    prepared = await _prepare(
        request, model, prompts, sampling, templated=False, timeout_ms=body.timeout_ms
    )
    texts, ends, logprobs = await _complete(request, prepared)
    outputs: list[dict[str, object]] = [
        {
            "text": text,
            "finish_reason": end.finish_reason,
            "prompt_tokens": end.prompt_tokens,
            "completion_tokens": end.completion_tokens,
        }
        for text, end in zip(texts, ends, strict=True)
    ]
    if parameters.logprobs is not None:
        names = generation_of(request).tokenizer(model).token_texts
        for output, tokens in zip(outputs, logprobs, strict=True):
            output["logprobs"] = infer_logprobs(names, tokens)
    usage = {
        "input_tokens": sum(end.prompt_tokens for end in ends),
        "output_tokens": sum(end.completion_tokens for end in ends),
        "inputs": len(prompts),
    }
    return render(request, {"model": model, "outputs": outputs, "usage": usage})


def _prompts_as_sent(
    request: Request, prompt: str | list[str] | list[int] | list[list[int]]
) -> Sequence[str | list[int]]:
    """Completions' prompts, texts or token ids (one kind, as the schema takes them)."""
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        return texts_as_sent(request, "prompt", prompt)
    return token_prompts_as_sent(request, "prompt", prompt)


def _openai_sampling(body: OpenAISampling, max_new_tokens: int | None) -> Sampling:
    """OpenAI's conventions: temperature 0 is greedy; otherwise sample."""
    return Sampling(
        max_new_tokens=max_new_tokens,
        do_sample=body.temperature > 0,
        temperature=body.temperature if body.temperature > 0 else 1.0,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stops=tuple(body.stop_strings()),
        logprobs=body.logprobs_asked(),
    )


# The OpenAI routes read their own body (`common.body_as`), as /infer and /v1/embeddings do
# (so `api/direct.py` serves them too): UTF-8 only, where FastAPI's parsing also took UTF-16
# and UTF-32. The document names their schema as FastAPI did (the component: api/openapi.py).
@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**OPENAI_ERRORS, **streamed_answer(CompletionChunk, "The completion")},
    openapi_extra=body_document(CompletionRequest),
)
async def completions(request: Request) -> Response:
    body = await body_as(request, CompletionRequest)
    prompts = _prompts_as_sent(request, body.prompt)
    service = service_of(request)
    param = "prompt" if body.n == 1 else "n"
    if (too_many := _too_many_sequences(request, len(prompts), body.n, param)) is not None:
        return too_many
    model = service.resolve_model(body.model)
    generation_of(request).tokenizer(model)  # a model of another task: 400 before anything
    sampling = dataclasses.replace(
        _openai_sampling(body, body.max_tokens),
        echo=body.echo,
        prompt_logprobs=body.prompt_logprobs_asked(),
        logprobs_end=True,
    )
    prepared = await _prepare(
        request, model, prompts, sampling, templated=False, timeout_ms=None, n=body.n
    )
    return await _answer(request, _reply(request, model, body, chat=False), prepared, body)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**OPENAI_ERRORS, **streamed_answer(ChatCompletionChunk, "The chat completion")},
    openapi_extra=body_document(ChatCompletionRequest),
)
async def chat_completions(request: Request) -> Response:
    body = await body_as(request, ChatCompletionRequest)
    if (too_many := _too_many_sequences(request, 1, body.n, "n")) is not None:
        return too_many
    service = service_of(request)
    model = service.resolve_model(body.model)
    messages = [
        {**message.model_dump(exclude={"content"}), "content": message.text()}
        for message in body.messages
    ]
    # One prompt, rendered from the messages: an error about it names `messages`.
    prompt = texts_as_sent(request, "messages", generation_of(request).chat_prompt(model, messages))
    sampling = _openai_sampling(body, body.max_new_tokens())
    prepared = await _prepare(
        request, model, prompt, sampling, templated=True, timeout_ms=None, n=body.n
    )
    return await _answer(request, _reply(request, model, body, chat=True), prepared, body)


def _reply(request: Request, model: str, body: OpenAISampling, *, chat: bool) -> Reply:
    """The answer's shared parts, rendering its log probabilities when asked."""
    if body.logprobs_asked() is None:
        return Reply(model, chat=chat)
    names = generation_of(request).tokenizer(model).token_texts
    return Reply(model, chat=chat, logprobs=LogprobRender(names, chat))


async def _answer(
    request: Request, reply: Reply, prepared: PreparedGeneration, body: OpenAISampling
) -> Response:
    if not body.stream:
        texts, ends, logprobs = await _complete(request, prepared)
        return render(request, whole(reply, texts, ends, logprobs))
    events = _events(request, prepared, incremental=True)
    try:
        first = await run_until_disconnect(request, _first(events))
    except BaseException:
        await events.aclose()
        raise
    count = prepared.sequences
    return EventStreamResponse(_frames(request, reply, first, events, count, body))


async def _first(events: AsyncGenerator[list[GenerationEvent]]) -> list[GenerationEvent]:
    return await anext(events)


async def _frames(
    request: Request,
    reply: Reply,
    first: list[GenerationEvent],
    events: AsyncGenerator[list[GenerationEvent]],
    count: int,
    body: OpenAISampling,
) -> AsyncGenerator[bytes]:
    """The SSE frames of a stream whose first events are known: (chat: each choice's role),
    text chunks, each choice's final chunk with its finish_reason, the usage chunk when
    asked for, and `[DONE]`. The frames of events that became known together go out as one
    write, and a stream's last frames with its `[DONE]`. A 500 in the stream is logged naming
    `request` as every route's 500 is (`errors.described`: Envoy's x-request-id with it)."""
    with_usage = body.include_usage
    texts = TextChunks(reply, with_usage)
    ends: list[SequenceEnd] = []
    frames: list[bytes] = []
    if reply.chat:
        for index in range(count):
            frames.append(event(chunk(reply, index, text="", role=True, with_usage=with_usage)))
    try:
        async with contextlib.aclosing(events) as rest:
            batch: list[GenerationEvent] | None = first
            while batch is not None:
                for item in batch:
                    if isinstance(item, TextPiece):
                        frames.append(texts.frame(item.index, item.text, item.logprobs))
                    else:
                        ends.append(item)
                        finish = item.finish_reason
                        final = chunk(
                            reply, item.index, finish_reason=finish, with_usage=with_usage
                        )
                        frames.append(event(final))
                if len(ends) < count:  # else the last frames go out with [DONE]
                    yield b"".join(frames)
                    frames.clear()
                batch = await anext(rest, None)
    except (Rejected, DeadlineExceeded, EngineRefused, EngineUnavailable) as error:
        frames.append(event(error_chunk(*_status_and_reason(error), str(error))))
    except DeviceLost as error:  # as api/errors.py answers it before the stream began
        frames.append(event(error_chunk(500, DEVICE_LOST, str(error))))
    except BatchFailed as error:  # the engine logged the batch's traceback, once
        log_batch_failed(f"a stream of model {reply.model!r} on {described(request.scope)}", error)
        frames.append(event(error_chunk(500, "internal_error", "internal server error")))
    except Exception:
        log.exception("generation failed mid-stream on %s", described(request.scope))
        frames.append(event(error_chunk(500, "internal_error", "internal server error")))
    else:
        if with_usage:
            frames.append(event(usage_chunk(reply, sorted(ends, key=lambda end: end.index))))
    frames.append(DONE)
    yield b"".join(frames)


def _status_and_reason(error: Exception) -> tuple[int, str]:
    """The status and reason the error would have been answered with before the stream
    began (`api/errors.py`)."""
    if isinstance(error, Rejected):
        return REJECTION_STATUS[error.reason], error.reason.value
    if isinstance(error, DeadlineExceeded):
        return 504, "deadline"
    if isinstance(error, EngineUnavailable):  # the engine went silent or its stream broke
        return 503, RejectReason.NOT_READY.value
    return 400, "invalid_request"
