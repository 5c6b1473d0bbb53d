"""An inference answer's body under /v2: its outputs made JSON numbers (`tensors.to_json`)
or binary data, encoded by `v2_codec.encode_response`; on the event loop when small, else
on the front end's render thread, so a large answer does not hold the loop.

The threshold is not the engine's `STACK_ON_LOOP_MAX_BYTES` (1 MiB, `engine/tensor_host.py`,
numpy copies): writing numbers as JSON costs far more per byte than copying them (1 MiB of
FP32 took 7.5 ms on a test machine, 64 KiB 0.5 ms; a thread hop about 0.03 ms).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from app.api.v2_codec import OutputTensor, encode_response
from app.tensors import to_json
from app.timing import PhaseTimer

# Answers holding more bytes of tensors than this are rendered off the event loop.
RENDER_ON_LOOP_MAX_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class JsonTensor:
    """A `tensor` model's output asked for as JSON: its bytes, made numbers only when the
    body is rendered."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes


Answer = OutputTensor | JsonTensor


def answer_bytes(outputs: Sequence[Answer]) -> int:
    """The bytes of tensors an answer holds (binary, or to be written as JSON)."""
    total = 0
    for output in outputs:
        if isinstance(output, JsonTensor):
            total += len(output.data)
        elif output.raw is not None:
            total += len(output.raw)
        else:  # an embedding's vectors as an array, or JSON values already
            total += getattr(output.data, "nbytes", 0)
    return total


def render_body(
    model: str, request_id: str | None, outputs: Sequence[Answer]
) -> tuple[bytes, int | None]:
    """`encode_response`'s body and header length, each `JsonTensor` made numbers first.
    Raises `NotJsonNumbers` for one with NaN or infinity. Pure: any thread."""
    ready = [
        OutputTensor(o.name, o.datatype, o.shape, data=to_json(o.datatype, o.shape, o.data))
        if isinstance(o, JsonTensor)
        else o
        for o in outputs
    ]
    return encode_response(model, request_id, ready)


class AnswerRenderer:
    """The front end's one render thread (`steadyserve-render`, started by its first large
    answer, stopped by `close`). Bounded: renders of large answers wait for each other,
    never for the tokenizer thread nor asyncio's default executor."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steadyserve-render")

    async def render(
        self, timer: PhaseTimer, model: str, request_id: str | None, outputs: Sequence[Answer]
    ) -> tuple[bytes, int | None]:
        """`render_body` on the loop when the answer is small, else on the render thread
        (then `timer` notes the `serialise` phase as off the loop). Event loop thread."""
        if answer_bytes(outputs) <= RENDER_ON_LOOP_MAX_BYTES:
            return render_body(model, request_id, outputs)
        timer.off_loop.add("serialise")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, render_body, model, request_id, outputs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
