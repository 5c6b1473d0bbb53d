"""Chat messages as /v1/chat/completions and /tokenize's chat form take them: a role and a
text content (a string or text parts), bounded in number before they are validated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from app.schemas import NonEmptyText, StrictModel

# Far above any conversation a model's context holds, and checked before the messages are
# validated: a 1 MiB body of ~34,000 empty messages held the front end's event loop for a
# quarter of a second of validation and templating before its prompt was found too long.
MAX_CHAT_MESSAGES = 2048
MAX_CONTENT_PARTS = 2048


def _at_most(limit: int, what: str) -> Callable[[object], object]:
    def check(value: object) -> object:
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} {what} (got {len(value)})")
        return value

    return check


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read fields such as `name`

    role: NonEmptyText
    # Null or left out only on an assistant's message (one that called tools), as OpenAI
    # allows: another's was rendered as an empty turn, served as if the client sent one.
    content: (
        str
        | Annotated[
            list[TextPart],
            Field(max_length=MAX_CONTENT_PARTS),  # for the schema; checked before
            BeforeValidator(_at_most(MAX_CONTENT_PARTS, "content parts")),
        ]
        | None
    ) = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _only_the_assistant_s_may_be_null(
        cls, content: str | list[TextPart] | None, info: ValidationInfo
    ) -> str | list[TextPart] | None:
        role = info.data.get("role")  # absent when the role itself was refused
        if content is None and role is not None and role != "assistant":
            raise ValueError(
                f"a {role} message needs content (a string or a list of text parts); only "
                "an assistant's may be null or left out"
            )
        return content

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


ChatMessages = Annotated[
    list[ChatMessage],
    Field(min_length=1, max_length=MAX_CHAT_MESSAGES),  # for the schema; checked before
    BeforeValidator(_at_most(MAX_CHAT_MESSAGES, "messages")),
]
