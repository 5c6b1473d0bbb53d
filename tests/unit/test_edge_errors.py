"""The errors the real routes answer, a front end in front of an engine double (tokenizers
made on the spot, no model): which field an error names, OpenAI's error types on the /v1
routes, an input the model fails on, and one refusal counted per request however many
prompts it has."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import httpx
import orjson
import pytest
from fastapi import FastAPI
from tokenizers import Tokenizer, models, pre_tokenizers

from app.batcher import RERUN_DEADLINE_PASSED
from app.engine.core import EngineCore
from app.engine.protocol import (
    EmbedPayload,
    Failure,
    FailureKind,
    FromEngine,
    ModelInfo,
    Output,
    Submit,
    ToEngine,
    TokensOutput,
)
from app.generation.tokenizer import GenerationTokenizer
from app.main import create_app
from app.model_specs import ModelSpec
from app.models.tokenizer import InputTooLong, TextTokenizer
from app.service import INLINE_TOKENIZE_MAX_CHARS
from app.settings import Settings
from app.timing import PhaseTimer
from loadtest.null_engine import AlwaysReadyEngine
from tests.support.asgi import serving

# The generate model's sequence: a prompt plus its new tokens hold at most this many.
CONTEXT = 16
WORDS = ["<unk>", "<s>", "hello", "world", "again"]
SETTINGS = Settings(
    models=(
        ModelSpec(name="tiny", task="generate", source="unused"),
        ModelSpec(name="minilm", task="embed", source="unused"),
    ),
    max_inputs_per_request=4,
)

# The contents of a conversation's messages, one after another (written into the model's
# directory by the tests that chat).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"

Answer = Callable[[Submit], FromEngine | list[FromEngine]]


class WordTokenizer:
    """An embedding model's tokenizer: one id per word, at most 4 words."""

    max_input_tokens = 4
    pad_token_id = 0

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        ids = [[2 + len(word) for word in text.split()] for text in texts]
        for index, row in enumerate(ids):
            if len(row) > self.max_input_tokens:
                raise InputTooLong(index, len(row), self.max_input_tokens)
        return ids


def word_level_tokenizer(directory: Path) -> GenerationTokenizer:
    """A generate model's tokenizer from a word-level `tokenizer.json` (no chat template)."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    return GenerationTokenizer(directory, CONTEXT)


class AnsweringEngine(AlwaysReadyEngine):
    """Answers each Submit at once with `answer(submit)` (a message, or several sent
    together); the engine's own refusal counting happens only where `answer` is a real
    `EngineCore`'s."""

    engine_id = "answering"

    def __init__(self, settings: Settings, answer: Answer) -> None:
        super().__init__(settings)
        self.answer = answer
        self.submitted: list[Submit] = []

    def model_info(self, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(spec.task, 4, CONTEXT - 1)

    def _send(self, message: ToEngine) -> None:
        if isinstance(message, Submit):
            self.submitted.append(message)
            answer = self.answer(message)
            for answered in answer if isinstance(answer, list) else [answer]:
                self._deliver(answered)


@contextlib.asynccontextmanager
async def front_end(
    tmp_path: Path, answer: Answer | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI, AnsweringEngine]]:
    generation = word_level_tokenizer(tmp_path)

    def tokenizers(spec: ModelSpec, largest: int) -> TextTokenizer:
        return generation if spec.task == "generate" else WordTokenizer()

    def refused(submit: Submit) -> FromEngine:
        return Failure(submit.request_id, FailureKind.FAILED, "not expected in this test")

    engine = AnsweringEngine(SETTINGS, answer or refused)
    app = create_app(SETTINGS, tokenizer_loader=tokenizers, engine=engine)
    async with serving(app) as client:
        yield client, app, engine


@pytest.mark.parametrize(
    ("path", "body", "param", "named"),
    [
        (
            "/v1/completions",
            {"prompt": "hello world", "max_tokens": CONTEXT},
            "prompt",
            "the prompt",
        ),
        (
            "/v1/completions",
            {"prompt": ["hello", "hello world"], "max_tokens": 15},
            "prompt[1]",
            "prompt 1",
        ),
        ("/v1/completions", {"prompt": ["hello world"], "max_tokens": 15}, "prompt[0]", "prompt 0"),
        (
            "/infer",
            {"inputs": "hello", "parameters": {"max_new_tokens": CONTEXT}},
            "inputs",
            "the prompt",
        ),
        (
            "/infer",
            {"inputs": ["hello"], "parameters": {"max_new_tokens": CONTEXT}},
            "inputs[0]",
            "prompt 0",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": CONTEXT},
            "messages",
            "the prompt rendered from the messages",
        ),
    ],
)
async def test_an_error_about_one_text_names_it_as_the_client_sent_it(
    tmp_path: Path, path: str, body: dict[str, object], param: str, named: str
) -> None:
    """`prompt[0]` named an index into a field the client sent as one string, and so did
    the message ("prompt 0 has 2 tokens ..."), on every generation route; a list's prompt
    is still named by its index."""
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    async with front_end(tmp_path) as (client, _, _):
        response = await client.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert error["message"].startswith(f"{named} has "), error
    assert f"at most {CONTEXT} tokens" in error["message"], error


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        (
            "/infer",
            b'{"model": "tiny", "inputs": "hello", "parameters": {"max_new_tokens": 16}}',
            400,
        ),
        ("/infer", b'{"model": "minilm", "inputs": 5}', 422),
        ("/v1/embeddings", b'{"model": "minilm", "input": ', 400),
        ("/v1/completions", b'{"model": "tiny", "prompt": "hello", "max_tokens": 16}', 400),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": "hello"}', 422),
        ("/v2/models/minilm/infer", b'{"inputs": "not a list"}', 400),
    ],
)
async def test_every_inference_route_times_its_bodys_parse_whether_it_parses_or_not(
    tmp_path: Path, path: str, body: bytes, status: int
) -> None:
    """Decoding and validating a body ran on the event loop untimed: a large body's parse
    read as the loop blocked by other work, or as time outside every phase (docs/SPIKES.md,
    `parse_body`)."""
    async with front_end(tmp_path) as (client, _, _):
        response = await client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == status, response.text
    timing = dict(entry.split(";dur=") for entry in response.headers["server-timing"].split(", "))
    # A small body parses in microseconds: the header's 10 us resolution may show 0.00.
    assert 0 <= float(timing["parse_body"]) <= float(timing["total"]), timing


async def test_a_large_input_is_tokenized_off_the_loop_and_its_phase_says_so(
    tmp_path: Path,
) -> None:
    """A slow-request report takes the request's own `tokenize` time off its loop's
    lateness only when it ran on the loop (docs/SPIKES.md)."""
    async with front_end(tmp_path) as (_, app, _):
        service = app.state.service
        small, large = PhaseTimer(), PhaseTimer()
        loop_thread = threading.get_ident()
        assert await service.run_tokenizer(10, small, threading.get_ident) == loop_thread
        chars = INLINE_TOKENIZE_MAX_CHARS + 1
        assert await service.run_tokenizer(chars, large, threading.get_ident) != loop_thread
    assert small.off_loop == set()
    assert large.off_loop == {"tokenize"}


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"input": "a b c d e"}, "input", "the input"),
        ({"input": ["a", "a b c d e"]}, "input[1]", "input 1"),
    ],
)
async def test_an_embedding_input_over_the_limit_is_named_as_sent(
    tmp_path: Path, body: dict[str, object], param: str, named: str
) -> None:
    """The message said "input 0 has ..." of an input sent as one string, as `param` once
    said `input[0]`."""
    async with front_end(tmp_path) as (client, _, _):
        response = await client.post("/v1/embeddings", json={"model": "minilm", **body})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{named} has "), error


async def test_the_openai_routes_answer_openai_s_type_with_the_reason_in_code(
    tmp_path: Path,
) -> None:
    """Answered by an exception handler, by the route itself (too many inputs, dimensions)
    and by the middleware (a wrong method): the same vocabulary; /infer keeps its own."""
    async with front_end(tmp_path) as (client, _, _):
        too_long = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": CONTEXT}
        )
        too_many = await client.post("/v1/embeddings", json={"model": "minilm", "input": ["a"] * 5})
        dimensions = await client.post(
            "/v1/embeddings", json={"model": "minilm", "input": "a", "dimensions": 3}
        )
        unknown = await client.post("/v1/completions", json={"model": "gpt-17", "prompt": "a"})
        invalid = await client.post("/v1/completions", json={"model": "tiny", "prompt": 5})
        method = await client.get("/v1/completions")
        native = await client.post("/infer", json={"model": "minilm", "inputs": ["a"] * 5})
    answers = {
        (r.status_code, r.json()["error"]["type"], r.json()["error"]["code"])
        for r in (too_long, too_many, dimensions, unknown, invalid, method)
    }
    assert answers == {
        (400, "invalid_request_error", "context_length_exceeded"),
        (413, "invalid_request_error", "too_many_inputs"),
        (400, "invalid_request_error", "invalid_request"),
        (404, "invalid_request_error", "model_not_found"),
        (422, "invalid_request_error", "invalid_request"),
        (405, "invalid_request_error", "method_not_allowed"),
    }
    assert native.status_code == 413
    assert native.json()["error"]["type"] == native.json()["error"]["code"] == "too_many_inputs"


async def test_a_refusal_by_the_engine_is_of_openai_s_type(tmp_path: Path) -> None:
    def queue_full(submit: Submit) -> FromEngine:
        return Failure(submit.request_id, FailureKind.REJECTED, "full", "queue", 1.0)

    async with front_end(tmp_path, queue_full) as (client, _, _):
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2}
        )
    assert response.status_code == 429
    assert response.json()["error"] == {
        "type": "rate_limit_exceeded",
        "message": "full",
        "param": None,
        "code": "queue",
    }


async def test_a_failure_mid_stream_is_an_event_of_openai_s_type(tmp_path: Path) -> None:
    def one_token_then_late(submit: Submit) -> list[FromEngine]:
        token = Output(submit.request_id, False, TokensOutput([2], 1), 0.0, 0.0)
        late = Failure(submit.request_id, FailureKind.DEADLINE, "deadline passed after 1 token")
        return [token, late]

    async with front_end(tmp_path, one_token_then_late) as (client, _, _):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    events = [
        orjson.loads(line[len(b"data: ") :])
        for line in response.content.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert events[-1] == {
        "error": {
            "type": "server_error",  # a 504 had it come before the stream began
            "message": "deadline passed after 1 token",
            "param": None,
            "code": "deadline",
        }
    }


LONE = "a\udc00"  # JSON may escape a lone surrogate; no tokenizer takes it (TypeError)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": LONE}, 422, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": ["hello", LONE]}, 422, "prompt[1]"),
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "stop": [LONE]}, 422, "stop[0]"),
        ("/infer", {"model": "tiny", "inputs": LONE}, 422, "inputs"),
        ("/infer", {"model": "minilm", "inputs": [LONE]}, 422, "inputs[0]"),
        ("/v1/embeddings", {"model": "minilm", "input": LONE}, 422, "input"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": LONE}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}],
            },
            400,
            "messages",
        ),
    ],
)
async def test_a_lone_surrogate_in_any_text_is_refused_before_the_tokenizer(
    tmp_path: Path, path: str, body: dict[str, object], status: int, param: str
) -> None:
    """A guard, not a fix: the tokenizer raises TypeError on such a text (a 500). Every text
    field typed `NonEmptyText` is refused by pydantic's constrained-string check, which
    reads the text as UTF-8 (a plain `str` field is not); chat content, a plain `str`, is
    caught in the rendered prompt (`ChatTemplate.render`)."""
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    async with front_end(tmp_path) as (client, _, engine):
        response = await client.post(
            path,
            content=json.dumps(body).encode(),  # "\udc00" as JSON escapes it
            headers={"content-type": "application/json"},
        )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param), error
    assert engine.submitted == []


async def test_an_engine_gone_silent_mid_stream_is_a_503_event_not_a_server_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine silent past the request's deadline + `ANSWER_GRACE_S` is `EngineUnavailable`:
    503 `not_ready` before a stream starts, but mid-stream it was logged with a stack trace
    as a fault of the front end's and sent as a 500 `internal_error` event."""

    def one_token_then_silence(submit: Submit) -> FromEngine:
        return Output(submit.request_id, False, TokensOutput([2], 1), 0.0, 0.0)

    async with front_end(tmp_path, one_token_then_silence) as (client, _, engine):
        # Silent "past the deadline" at once: the token is read first, then the silence.
        engine.answer_grace_s = -1e6
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    events = [
        orjson.loads(line[len(b"data: ") :])
        for line in response.content.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert events[0]["choices"][0]["text"].strip() == "hello"  # the stream had begun
    error = events[-1]["error"]
    assert (error["type"], error["code"]) == ("server_error", "not_ready"), error
    assert "did not answer by the request's deadline" in error["message"]
    assert "generation failed mid-stream" not in caplog.text


@pytest.mark.parametrize(
    ("body", "param"), [({"input": "a"}, "input"), ({"input": ["a", "b"]}, "input[1]")]
)
async def test_an_input_the_model_fails_on_is_a_400_naming_it(
    tmp_path: Path, body: dict[str, object], param: str
) -> None:
    index = 0 if param == "input" else 1

    def fails_on_one(submit: Submit) -> FromEngine:
        assert isinstance(submit.payload, EmbedPayload)
        message = f"the model could not process input {index} (IndexError)"
        return Failure(submit.request_id, FailureKind.BAD_REQUEST, message, input_index=index)

    async with front_end(tmp_path, fails_on_one) as (client, _, _):
        response = await client.post("/v1/embeddings", json={"model": "minilm", **body})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": f"the model could not process input {index} (IndexError)",
        "param": param,
        "code": "invalid_request",
    }


def refused_total(app: FastAPI, model: str, reason: str) -> float:
    labels = {"model": model, "reason": reason}
    value = app.state.service.metrics.registry.get_sample_value(
        "steadyserve_rejected_total", labels
    )
    return value or 0.0


@pytest.mark.parametrize("prompts", [["hello"], ["hello", "world", "hello again"]])
async def test_a_refused_request_counts_one_refusal_however_many_prompts(
    tmp_path: Path, prompts: list[str]
) -> None:
    """Each prompt goes to the engine as a Submit of its own, and the engine counted each
    one refused: `steadyserve_rejected_total` counts requests. (The engine here is a real
    `EngineCore` not started, which refuses everything as not ready.)"""
    core: list[EngineCore] = []

    def to_the_engine(submit: Submit) -> FromEngine:
        answers: list[FromEngine] = []
        core[0].submit(b"front-end", submit, answers.append)
        [answer] = answers
        return answer

    async with front_end(tmp_path, to_the_engine) as (client, app, engine):
        core.append(EngineCore(SETTINGS, app.state.service.metrics))  # one registry for both
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 2}
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "not_ready"
        assert len(engine.submitted) == len(prompts)  # the engine refused each
        assert refused_total(app, "tiny", "not_ready") == 1


async def test_a_request_whose_prompts_expire_in_the_engine_counts_one_deadline(
    tmp_path: Path,
) -> None:
    """The engine counts no expiry of a Submit its front end counts for (as for its
    refusals): the front end counts the request's one."""

    def expired(submit: Submit) -> FromEngine:
        assert submit.refusal_counted_by_sender  # the engine leaves the counting to us
        message = "deadline passed after 0 generated tokens"
        return Failure(submit.request_id, FailureKind.DEADLINE, message)

    async with front_end(tmp_path, expired) as (client, app, _):
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": ["hello", "world"], "max_tokens": 2}
        )
        assert response.status_code == 504
        assert refused_total(app, "tiny", "deadline") == 1


@pytest.mark.parametrize("path", ["/v2/models/minilm/infer", "/infer"])
async def test_a_deadline_answer_says_where_the_engine_found_it_passed(
    tmp_path: Path, path: str
) -> None:
    """The v2 route answered every 504 "deadline passed before the request was computed",
    whatever the engine said (a row too late for its run alone after its batch failed had
    left the queue: `batcher.RERUN_DEADLINE_PASSED`)."""

    def late(submit: Submit) -> FromEngine:
        return Failure(submit.request_id, FailureKind.DEADLINE, RERUN_DEADLINE_PASSED)

    v2_text = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}
    body = {"inputs": [v2_text]} if path.startswith("/v2") else {"model": "minilm", "inputs": "hi"}
    async with front_end(tmp_path, late) as (client, _, _):
        response = await client.post(path, json=body)
    assert response.status_code == 504, response.text
    assert RERUN_DEADLINE_PASSED in response.text
