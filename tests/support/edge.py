"""A front end (the real routes, `create_app`) in front of an engine double that answers
each Submit at once as the test says, with tokenizers made on the spot (no model): the
harness of tests/unit/test_edge_errors.py, test_edge_openai_errors.py and
test_edge_accounting.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import httpx
from fastapi import FastAPI
from tokenizers import Tokenizer, models, pre_tokenizers

from app.engine.protocol import Failure, FailureKind, FromEngine, ModelInfo, Submit, ToEngine
from app.generation.tokenizer import GenerationTokenizer
from app.main import create_app
from app.model_specs import ModelSpec
from app.models.tokenizer import InputTooLong, TextTokenizer
from app.settings import Settings
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


def word_level_tokenizer(
    directory: Path, special_tokens: Sequence[str] = ()
) -> GenerationTokenizer:
    """A generate model's tokenizer from a word-level `tokenizer.json` (no chat template),
    with `special_tokens` (of `WORDS`) marked special."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(special_tokens))
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
    tmp_path: Path,
    answer: Answer | None = None,
    created: int | None = None,
    embedder: TextTokenizer | None = None,
    special_tokens: Sequence[str] = (),
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI, AnsweringEngine]]:
    """`embedder`: the embedding model's tokenizer (`WordTokenizer` unless given)."""
    generation = word_level_tokenizer(tmp_path, special_tokens)

    def tokenizers(spec: ModelSpec, largest: int) -> TextTokenizer:
        if spec.task == "generate":
            return generation
        return embedder or WordTokenizer()

    def refused(submit: Submit) -> FromEngine:
        return Failure(submit.request_id, FailureKind.FAILED, "not expected in this test")

    engine = AnsweringEngine(SETTINGS, answer or refused)
    app = create_app(SETTINGS, tokenizer_loader=tokenizers, engine=engine, created=created)
    async with serving(app) as client:
        yield client, app, engine
