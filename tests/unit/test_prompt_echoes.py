"""A request's echoed prompts (`generation/echo.py::PromptEchoes`): each prompt's text and
offsets are made once, whatever its `n` choices (they were decoded again for each, ~2
decode calls a token, on the event loop), a long prompt's on the tokenizer pool, and a
choice that stops waiting does not cancel its siblings' echo."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from app.generation.echo import ECHO_INLINE_MAX_TOKENS, PromptEchoes, echo_text
from app.timing import PhaseTimer
from app.tokenizer_pool import INLINE_TOKENIZE_MAX_CHARS, TokenizerPool


class _Tokenizer:
    special_token_ids = frozenset({1})

    def __init__(self) -> None:
        self.decodes = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.decodes += 1
        return "".join(f"<{i}>" for i in ids if i != 1)


class _Service:
    """`run_tokenizer` as the service's: inline at most INLINE_TOKENIZE_MAX_CHARS, else on a
    thread (recorded)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.timers: list[PhaseTimer | None] = []

    async def run_tokenizer(
        self, chars: int, timer: PhaseTimer | None, work: Callable[..., Any], *args: Any
    ) -> Any:
        self.sizes.append(chars)
        self.timers.append(timer)
        if chars <= INLINE_TOKENIZE_MAX_CHARS:
            return work(*args)
        return await asyncio.to_thread(work, *args)


async def test_each_prompt_is_echoed_once_for_all_its_choices() -> None:
    tokenizer, service = _Tokenizer(), _Service()
    short = [1, 5, 6, 7]
    long = list(range(2, ECHO_INLINE_MAX_TOKENS + 3))
    echoes = PromptEchoes(service, tokenizer, [short, long], True)  # type: ignore[arg-type]
    choices = await asyncio.gather(*(echoes.of(prompt) for prompt in (0, 0, 0, 1, 1, 1)))
    echoes.close()
    assert choices[0] is choices[1] is choices[2] and choices[3] is choices[5]
    assert choices[0] == echo_text(tokenizer.decode, {1}, short, True)
    assert choices[3] == echo_text(tokenizer.decode, {1}, long, True)
    # One echo each: the short one inline, the long one past the threshold, on the pool.
    assert service.sizes == [0, INLINE_TOKENIZE_MAX_CHARS + 1]
    # Not the request's tokenizing: its `tokenize` phase (on the loop) is not marked off it,
    # which the slow-request attribution would read as work the loop did not do.
    assert service.timers == [None, None]


async def test_a_choice_that_stops_waiting_leaves_its_siblings_echo() -> None:
    tokenizer, service = _Tokenizer(), _Service()
    long = list(range(2, ECHO_INLINE_MAX_TOKENS + 3))
    echoes = PromptEchoes(service, tokenizer, [long], True)  # type: ignore[arg-type]
    waiting = asyncio.ensure_future(echoes.of(0))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (await echoes.of(0)).text == echo_text(tokenizer.decode, {1}, long, False).text
    echoes.close()


async def test_no_echo_makes_nothing() -> None:
    service = _Service()
    PromptEchoes(service, _Tokenizer(), (), False).close()  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert service.sizes == []


async def test_work_on_the_pool_without_a_timer_marks_no_phase() -> None:
    """`TokenizerPool.run` marks the request's `tokenize` phase off the loop only for the
    request's own tokenizing (a timer given), not for an echo's decoding (None)."""
    pool, timer = TokenizerPool(1), PhaseTimer()
    big = INLINE_TOKENIZE_MAX_CHARS + 1
    assert await pool.run(big, None, len, "ab") == 2
    assert timer.off_loop == set()
    assert await pool.run(big, timer, len, "ab") == 2
    assert timer.off_loop == {"tokenize"}
    pool.shutdown()
