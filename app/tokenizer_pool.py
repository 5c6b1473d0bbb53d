"""Where a front end's tokenizer work runs: a small request's on the event loop (tens of
microseconds: less than the hop to a thread), a large one's on a small thread pool, so it
cannot stall the loop; and how a served model's tokenizer is loaded.

`TokenizerPool.run` is called on the front end's event loop thread (`Service.run_tokenizer`);
the work it is given runs there or on one of the pool's threads. Torch-free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, TypeVarTuple

from app.generation.tokenizer import load_generation_tokenizer
from app.model_specs import ModelSpec
from app.models.tokenizer import TextTokenizer, load_tokenizer
from app.timing import PhaseTimer

# Tokenizing a few short texts takes tens of microseconds: less than the hop to a thread.
# Larger requests go to the tokenizer pool so they cannot stall the event loop.
INLINE_TOKENIZE_MAX_CHARS = 2048

TokenizerLoader = Callable[[ModelSpec, int], TextTokenizer]
Args = TypeVarTuple("Args")
Result = TypeVar("Result")


def load_model_tokenizer(spec: ModelSpec, largest_length_bucket: int) -> TextTokenizer:
    if spec.task == "generate":
        return load_generation_tokenizer(spec.source, spec.max_input_tokens)
    return load_tokenizer(spec.source, largest_length_bucket, spec.max_input_tokens)


class TokenizerPool:
    """`threads` threads for large inputs; created and called on the event loop thread."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="steadyserve-tokenize"
        )

    async def run(
        self,
        chars: int,
        timer: PhaseTimer | None,
        work: Callable[[*Args], Result],
        *args: *Args,
    ) -> Result:
        """`work(*args)` on the event loop when its input (`chars` characters) is small,
        else on the pool (then `timer` notes the request's `tokenize` phase as off the loop;
        None: `work` is not the request's tokenizing, e.g. an echo's decoding, and leaves
        its phases alone). Event loop thread."""
        if chars <= INLINE_TOKENIZE_MAX_CHARS:
            return work(*args)
        if timer is not None:
            timer.off_loop.add("tokenize")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, work, *args)

    def shutdown(self) -> None:
        """Queued work is dropped; running work ends on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
