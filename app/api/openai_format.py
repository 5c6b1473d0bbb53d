"""OpenAI's completion and chat-completion objects, whole and as stream chunks, built from
the generation pipeline's results (pure functions; the routes send them)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.api.openai_logprobs import LogprobRender
from app.api.sse import DATA, END
from app.generation.events import SequenceEnd
from app.generation.logprobs import TokenLogprob
from app.schemas import openai_error_object


@dataclass(frozen=True, slots=True)
class Reply:
    """What every object of one answer shares: its id, creation time, model, and kind, and
    with log probabilities asked, how its choices' are rendered."""

    model: str
    chat: bool
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: LogprobRender | None = None

    def render_logprobs(self, tokens: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        """A choice's `logprobs`: None unless asked, and for a chunk that carries no text."""
        return None if self.logprobs is None or tokens is None else self.logprobs(tokens)

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl-" if self.chat else "cmpl-"
            object.__setattr__(self, "id", prefix + uuid.uuid4().hex)

    def header(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(ends: list[SequenceEnd]) -> dict[str, int]:
    """OpenAI's: a prompt's tokens once (its choice 0's), every choice's completion tokens."""
    prompt = sum(end.prompt_tokens for end in ends if end.choice == 0)
    completion = sum(end.completion_tokens for end in ends)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def whole(
    reply: Reply,
    texts: list[str],
    ends: list[SequenceEnd],
    logprobs: list[list[TokenLogprob]] | None = None,
) -> dict[str, Any]:
    """The non-streamed answer: one choice per sequence, in sequence order (prompt i's
    choice j is choice i * n + j; `logprobs`: each sequence's tokens', when asked)."""
    choices: list[dict[str, Any]] = []
    for index, (text, end) in enumerate(zip(texts, ends, strict=True)):
        choice: dict[str, Any] = {"index": index, "finish_reason": end.finish_reason}
        if reply.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = reply.render_logprobs(logprobs[index] if logprobs else None)
        choices.append(choice)
    return {**reply.header(stream=False), "choices": choices, "usage": usage(ends)}


def chunk(
    reply: Reply,
    index: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    with_usage: bool = False,
    tokens: Sequence[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """One stream chunk of choice `index`: its text (a chat chunk's `delta`; the first one
    names the role) and the log probabilities of the `tokens` it carries, when asked, or,
    with `finish_reason`, its last. With `stream_options.include_usage` every chunk carries
    `usage: null` and the final usage chunk the figures."""
    choice: dict[str, Any] = {"index": index}
    if reply.chat:
        delta: dict[str, str] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = reply.render_logprobs(tokens)
    choice["finish_reason"] = finish_reason
    body: dict[str, Any] = {**reply.header(stream=True), "choices": [choice]}
    if with_usage:
        body["usage"] = None
    return body


def usage_chunk(reply: Reply, ends: list[SequenceEnd]) -> dict[str, Any]:
    """The chunk after the last choice's, with `stream_options.include_usage`."""
    return {**reply.header(stream=True), "choices": [], "usage": usage(ends)}


def error_chunk(status: int, reason: str, message: str) -> dict[str, Any]:
    """A failure after the stream began (the status line was sent): as vLLM does, an
    `error` object, which the openai client raises as an APIError; its `type` OpenAI's for
    the `status` it would have been answered with before, its `reason` the `code`."""
    return openai_error_object(status, reason, message)


class TextChunks:
    """The SSE frame of a text chunk (`chunk(reply, index, text=...)` as a `data:` event),
    built from bytes made once per choice: only the text is JSON-encoded per chunk, the
    rest of the object is the same for every chunk of an answer. Byte for byte the frame
    `sse.event(chunk(...))` gives. One instance per streamed answer; event loop thread.
    With log probabilities asked, each chunk is encoded whole (`chunk(..., tokens=...)`)."""

    def __init__(self, reply: Reply, with_usage: bool) -> None:
        self._reply = reply
        self._with_usage = with_usage
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def frame(self, index: int, text: str, tokens: Sequence[TokenLogprob] = ()) -> bytes:
        if self._reply.logprobs is not None:
            piece = chunk(self._reply, index, text=text, with_usage=self._with_usage, tokens=tokens)
            return DATA + orjson.dumps(piece) + END
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = self._template(index)
        head, tail = template
        return head + orjson.dumps(text) + tail

    def _template(self, index: int) -> tuple[bytes, bytes]:
        marker = "\x00text-" + uuid.uuid4().hex  # in no model name or id
        whole = orjson.dumps(chunk(self._reply, index, text=marker, with_usage=self._with_usage))
        head, tail = whole.split(orjson.dumps(marker))
        return DATA + head, tail + END
