"""The front end's pipeline for `embed` models: check each text's size, tokenize (inline or
on the tokenizer pool), then the same admission, deadline and engine round trip as every
task (`Service.begin` and `Service.compute`), and the vectors back as numpy rows.

Torch-free; front end's event loop thread only (large inputs are tokenized on the
service's tokenizer pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import numpy.typing as npt

from app.engine.protocol import EmbedOutput, EmbedPayload, OutputPayload
from app.models.tokenizer import InputTooLong, TextTokenizer
from app.service import MAX_CHARS_PER_TOKEN, Service
from app.timing import PhaseTimer


class NonFiniteOutput(Exception):
    """The model gave a NaN or infinite value: a fault of the server's (answered 500), never
    rendered, since JSON has no NaN (orjson would write `null`)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"{model} produced a non-finite value (NaN or infinity)")


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
    before the request is counted as served."""
    if not isinstance(payload, EmbedOutput):
        raise TypeError(f"{model} answered an embedding with {type(payload)}")
    if not np.isfinite(_vectors(payload)).all():
        raise NonFiniteOutput(model)


async def _tokenize(
    service: Service,
    tokenizer: TextTokenizer,
    texts: Sequence[str],
    truncate: bool,
    timer: PhaseTimer,
) -> list[list[int]]:
    """Each text's token ids; a text over `MAX_CHARS_PER_TOKEN` characters per allowed token
    is refused (`InputTooLong`) or, with `truncate`, cut before it costs a tokenizer pass."""
    max_chars = tokenizer.max_input_tokens * MAX_CHARS_PER_TOKEN
    for index, text in enumerate(texts):
        if len(text) > max_chars and not truncate:
            raise InputTooLong(index, len(text), max_chars, "characters")
    if truncate:
        texts = [text[:max_chars] for text in texts]
    return await service.run_tokenizer(
        sum(len(t) for t in texts), timer, tokenizer.tokenize, texts, truncate
    )
