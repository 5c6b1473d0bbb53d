"""The prompts the generation routes take: texts, and on /v1/completions token ids too."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

from app.schemas import NonEmptyText, whole_number

# The largest integer the engine protocol (msgpack) and torch's generators take: beyond it a
# request would fail in the front end's encoder, a 500 for a client's mistake.
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

# One prompt, or several, each continued independently.
Prompts = NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)]


def _one_kind_of_prompt(value: object) -> object:
    """A `mode="before"` check of completions' `prompt`: a list holds strings, token ids or
    lists of token ids, one kind alone, and is not empty (refused with these messages, not
    the union's four)."""
    if not isinstance(value, list):
        return value
    if not value or any(v == [] for v in value):
        raise ValueError("prompt must not be an empty list, nor hold one")
    kinds = {
        "text" if isinstance(v, str) else "ids" if isinstance(v, list) else
        "id" if isinstance(v, int | float) and not isinstance(v, bool) else "other"
        for v in value
    }  # fmt: skip
    if len(kinds) > 1 or "other" in kinds:
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids (integers) or a "
            "list of lists of token ids, one kind alone"
        )
    return value


# OpenAI's and vLLM's token-id prompts on /v1/completions: one list of ids is one prompt, a
# list of such lists several (lm-eval-harness's local-completions sends them so). Each id is
# checked against the model's vocabulary once the model is known (`pipeline.prepare`).
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX), BeforeValidator(whole_number)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
CompletionPrompts = Annotated[
    Prompts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)],
    BeforeValidator(_one_kind_of_prompt),
]
