"""The generated tokens' log probabilities as each generation route answers them, from a
sequence's `TokenLogprob`s (`generation/logprobs.py`) and its tokenizer's token names
(`generation/token_texts.py`): /v1/completions' legacy object (`tokens`, `token_logprobs`,
`top_logprobs` as {token: logprob} holding the top `logprobs` and the chosen token, as
OpenAI's "up to logprobs+1 elements", and `text_offset`), /v1/chat/completions' `content`
list (each token with its `bytes` and its `top_logprobs`), and /infer's list (with ids).
A log probability of -inf (a token the model rules out) is -9999.0, as OpenAI and vLLM
write it: JSON has no infinity. Pure functions of their inputs; event loop thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.engine.protocol_logprobs import TokenLogprobs
from app.generation.logprobs import TokenLogprob
from app.generation.token_texts import TokenTexts

LOWEST_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def _generated(token: TokenLogprob) -> TokenLogprobs:
    """A generated token's log probabilities (only an echoed prompt's first has none, and
    only completions echo)."""
    if token.logprobs is None:
        raise TypeError("a token without log probabilities outside an echoed prompt")
    return token.logprobs


class LogprobRender:
    """One answer's log probabilities objects, for the chat route or completions."""

    def __init__(self, texts: TokenTexts, chat: bool) -> None:
        self._texts = texts
        self._chat = chat

    def __call__(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
        """A choice's `logprobs` (of the tokens a whole choice or a chunk carries)."""
        return self.chat(tokens) if self._chat else self.completion(tokens)

    def completion(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
        """With `echo`, the prompt's tokens come first, the first with null log
        probabilities (`generation/echo.py`), as OpenAI's legacy API and vLLM write it."""
        name = self._texts.named
        names: list[str] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for token in tokens:
            chosen = name(token.token_id)[0]
            if token.logprobs is None:
                names.append(chosen)
                logprobs.append(None)
                tops.append(None)
                continue
            own = _finite(token.logprobs.logprob)
            top: dict[str, float] = {}
            pairs = zip(token.logprobs.top_ids, token.logprobs.top_logprobs, strict=True)
            for token_id, logprob in pairs:
                # Two ids may share a name (Llama's "▁" and "<0x20>"): the likelier keeps it.
                top.setdefault(name(token_id)[0], _finite(logprob))
            top.setdefault(chosen, own)
            names.append(chosen)
            logprobs.append(own)
            tops.append(top)
        return {
            "tokens": names,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": [token.text_offset for token in tokens],
        }

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._texts.named(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}

    def chat(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
        content = []
        for token in tokens:
            own = _generated(token)
            entry = self._alternative(token.token_id, own.logprob)
            entry["top_logprobs"] = [
                self._alternative(token_id, logprob)
                for token_id, logprob in zip(own.top_ids, own.top_logprobs, strict=True)
            ]
            content.append(entry)
        return {"content": content, "refusal": None}


def infer_logprobs(texts: TokenTexts, tokens: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """/infer's: per generated token its text, id and log probability, and its top ones."""

    def named(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": texts.named(token_id)[0],
            "token_id": token_id,
            "logprob": _finite(logprob),
        }

    return [
        {
            **named(token.token_id, _generated(token).logprob),
            "top_logprobs": [
                named(token_id, logprob)
                for token_id, logprob in zip(
                    _generated(token).top_ids, _generated(token).top_logprobs, strict=True
                )
            ],
        }
        for token in tokens
    ]
