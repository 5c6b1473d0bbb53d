"""The front end's pipeline for `embed` models: check each text's size, tokenize (inline or
on the tokenizer pool), then the same admission, deadline and engine round trip as every
task (`Service.begin` and `Service.compute`), and the vectors back as numpy rows.

Torch-free; front end's event loop thread only (large inputs are tokenized on the
service's tokenizer pool).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import numpy.typing as npt

from app.engine.protocol import EmbedOutput, EmbedPayload, OutputPayload
from app.failures import NonFiniteOutput
from app.models.tokenizer import InputTooLong, TextTokenizer
from app.service import MAX_CHARS_PER_TOKEN, Service
from app.timing import PhaseTimer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EmbedResult:
    model: str
    vectors: npt.NDArray[np.float32]
    input_tokens: int


def _normalize_rows(vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    normalized: npt.NDArray[np.float32] = vectors / np.maximum(norms, np.float32(1e-12))
    return normalized


def _vectors(output: EmbedOutput) -> npt.NDArray[np.float32]:
    flat = np.frombuffer(output.vectors, dtype=np.float32)
    return flat.reshape(output.rows, output.width)


async def embed_texts(
    service: Service,
    model: str,
    texts: Sequence[str],
    *,
    normalize: bool,
    truncate: bool,
    timeout_ms: float | None,
    envoy_timeout_ms: float | None,
    timer: PhaseTimer,
) -> EmbedResult:
    """Tokenize, admit, compute in the engine and return one vector per text.

    Raises `Rejected` (429/503/504), `InputTooLong`, `DeadlineExceeded`, `EngineRefused`,
    `BatchFailed` or `NonFiniteOutput`. Cancelling the caller's task (client gone) cancels
    the request in the engine, dropping its queued inputs.
    """
    service.require_task(model, "embed")
    now, deadline = service.begin(model, timeout_ms, envoy_timeout_ms)
    token_ids = await _tokenize(service, service.tokenizers[model], texts, truncate, timer)
    tokenized_at = service.clock()
    timer.add("tokenize", tokenized_at - now)
    payload = await service.compute(
        model,
        "embed",
        EmbedPayload(token_ids),
        cost=sum(len(ids) for ids in token_ids),
        deadline=deadline,
        arrived_at=now,
        timer=timer,
        check=partial(_check_vectors, model),
    )
    assert isinstance(payload, EmbedOutput)  # `_check_vectors` passed it
    vectors = _vectors(payload)
    return EmbedResult(
        model=model,
        vectors=_normalize_rows(vectors) if normalize else vectors.copy(),
        input_tokens=payload.input_tokens,
    )


def _check_vectors(model: str, payload: OutputPayload) -> None:
    """Raises for an answer that is not finite vectors (both server faults, answered 500),
    before the request is counted as served. A guard only: the engine fails a row with a
    NaN or an infinity itself (`ModelBatcher.rows_failed`: logged, and counted toward its
    ill health), so one reaching here passed an engine that did not check."""
    if not isinstance(payload, EmbedOutput):
        raise TypeError(f"{model} answered an embedding with {type(payload)}")
    if not np.isfinite(_vectors(payload)).all():
        log.error("%s: the engine answered a non-finite vector (NaN or inf)", model)
        raise NonFiniteOutput.of(model)


async def _tokenize(
    service: Service,
    tokenizer: TextTokenizer,
    texts: Sequence[str],
    truncate: bool,
    timer: PhaseTimer,
) -> list[list[int]]:
    """Each text's token ids; without `truncate`, a text over `MAX_CHARS_PER_TOKEN`
    characters per allowed token is refused (`InputTooLong`) before it costs a tokenizer
    pass; with it, each text keeps its first tokens (`truncated_token_ids`)."""
    max_chars = tokenizer.max_input_tokens * MAX_CHARS_PER_TOKEN
    chars = sum(len(text) for text in texts)
    if truncate:
        return await service.run_tokenizer(
            chars, timer, truncated_token_ids, tokenizer, texts, max_chars
        )
    for index, text in enumerate(texts):
        if len(text) > max_chars:
            raise InputTooLong(index, len(text), max_chars, "characters")
    return await service.run_tokenizer(chars, timer, tokenizer.tokenize, texts, False)


# The end of a word: a character other than whitespace, then a space. Every tokenizer splits
# words at a space (BERT's whitespace split, byte-level BPE's pattern, which puts a space
# before the word it starts, SentencePiece's `▁`), so a text cut there tokenizes into the
# first tokens of the whole text; cut within a word or a run of whitespace, it may not. Where
# no space falls within the reach, any whitespace, then punctuation before a letter or digit
# (BERT's and byte-level BPE's splits too: Chinese and Japanese text has punctuation, not
# spaces).
_WORD_ENDS = (
    re.compile(r"(?s:.*)\S(?= )"),
    re.compile(r"(?s:.*)\S(?=\s)"),
    re.compile(r"(?s:.*)[^\w\s](?=\w)"),
)


def _word_end(text: str, at_most: int) -> int:
    """The length of `text`'s longest prefix of at most `at_most` characters that ends a
    word (one match from the start, backtracking from `at_most`); `at_most` where none does:
    a script written without spaces (Chinese, Japanese, Thai) is dense in tokens, so the cut
    lies far past the limit's tokens, and a text of none would otherwise be read whole."""
    for word_end in _WORD_ENDS:
        if (found := word_end.match(text, 0, at_most + 1)) is not None:
            return found.end()
    return at_most


def truncated_token_ids(
    tokenizer: TextTokenizer, texts: Sequence[str], max_chars: int
) -> list[list[int]]:
    """Each text's first `max_input_tokens` tokens (closing special tokens kept), the ones
    tokenizing the whole text and cutting its tokens gives, reading no more of a long text
    than that takes: a text over `max_chars` characters is cut where a word ends at most
    `max_chars` in, and when its part holds fewer tokens than the limit (runs of whitespace,
    words a tokenizer reads as one unknown token: over `MAX_CHARS_PER_TOKEN` characters a
    token) a part 4 times as long is read, up to the whole text. So a text costs a pass over
    at most `max_chars` characters unless its tokens are that sparse, then passes over under
    7/3 of its length (the request's body bounds it). Thread-safe, as `tokenize` is."""
    limit = tokenizer.max_input_tokens
    cuts = [len(text) if len(text) <= max_chars else _word_end(text, max_chars) for text in texts]
    ids = tokenizer.tokenize([text[:cut] for text, cut in zip(texts, cuts, strict=True)], True)
    for index, text in enumerate(texts):
        reach = max_chars
        # Fewer tokens than the limit from a part: the rest of the text may hold more.
        while len(ids[index]) < limit and cuts[index] < len(text):
            reach *= 4
            cut = len(text) if reach >= len(text) else _word_end(text, reach)
            if cut > cuts[index]:
                cuts[index] = cut
                ids[index] = tokenizer.tokenize([text[:cut]], True)[0]
    return ids
