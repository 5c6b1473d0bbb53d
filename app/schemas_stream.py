"""The events of a streamed completion (`stream: true`), as the OpenAPI document states
them (`api/openai_format.py` builds them; `api/openapi.py` adds these components): each
`data:` line of the text/event-stream is one chunk object, or an error object on a failure
after the stream began, and the stream ends with `data: [DONE]`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema

from app.schemas_generation import CompletionChoice, CompletionUsage, _Choice
from app.schemas_logprobs import ChatLogprobs


def _left_out(schema: dict[str, Any]) -> None:
    """A field left out of the object when it has nothing to say, never null."""
    schema.pop("default", None)


class ChatDelta(BaseModel):
    """What a chat chunk adds: the first chunk of a choice names the role, the last (with
    its `finish_reason`) adds nothing."""

    role: Literal["assistant"] | SkipJsonSchema[None] = Field(
        default=None, json_schema_extra=_left_out
    )
    content: str | SkipJsonSchema[None] = Field(default=None, json_schema_extra=_left_out)


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None  # the log probabilities of this chunk's tokens


class _Chunk(BaseModel):
    id: str
    created: int
    model: str
    usage: CompletionUsage | None = Field(
        default=None,
        description="With `stream_options.include_usage` only: null on every chunk but a "
        "last one with no choices, which has the figures.",
    )


class CompletionChunk(_Chunk):
    """A piece of one choice's text; its last chunk has the `finish_reason`."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletionChunk(_Chunk):
    """A piece of one choice's message; its last chunk has the `finish_reason`."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


STREAM_DESCRIPTION = (
    "With `stream: true`: server-sent events, each a `data:` line of JSON, `x-events` its "
    "schema: the chunks of every choice (in the order their text became known), with "
    "`stream_options.include_usage` a last chunk with the usage, then `data: [DONE]`. A "
    'failure after the stream began (its status already sent) is an `{"error": ...}` event '
    "(the error object it would have been answered with), then `data: [DONE]`."
)


def streamed_answer(chunk: type[_Chunk], whole: str) -> dict[int | str, dict[str, object]]:
    """A generation route's 200, whole (`whole`: what the JSON answer is) or streamed."""
    events = [{"$ref": f"#/components/schemas/{name}"} for name in (chunk.__name__, "ErrorBody")]
    return {
        200: {
            "description": f"{whole}; with `stream: true`, the same as server-sent events.",
            "content": {
                "text/event-stream": {
                    "schema": {"type": "string", "description": STREAM_DESCRIPTION},
                    "x-events": {"anyOf": events},
                }
            },
        }
    }
