"""The tokenizer routes' bodies and answers (`api/tokenize.py`), in vLLM's shapes: what
lm-eval-harness's `local-completions` (and other clients without a local tokenizer) send."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints

from app.schemas import StrictModel
from app.schemas_chat import ChatMessages
from app.schemas_prompts import TokenId

# Any text, the empty one too; constrained so that pydantic reads it as UTF-8: a lone
# surrogate (which JSON may escape) is refused here, where the tokenizer raised TypeError.
Text = Annotated[str, StringConstraints(min_length=0)]

ModelName = Annotated[
    str | None,
    Field(
        description="A served model with a tokenizer; left out, null or empty: "
        "STEADY_DEFAULT_MODEL where it is set, else the one generate model served, else (no "
        "generate model) the one model with a tokenizer (a 400 where none of these picks one)."
    ),
]


class TokenizeCompletionRequest(StrictModel):
    model: ModelName = None
    prompt: Text
    add_special_tokens: bool = Field(
        default=True, description="Add the special tokens the tokenizer puts around a text."
    )
    return_token_strs: bool = Field(
        default=False, description="Also answer each token's vocabulary entry (`token_strs`)."
    )


class TokenizeChatRequest(StrictModel):
    model: ModelName = None
    messages: ChatMessages
    add_generation_prompt: bool = Field(
        default=True, description="End the rendered prompt with the assistant's turn opened."
    )
    add_special_tokens: bool = Field(
        default=False,
        description="Add the tokenizer's special tokens around the rendered prompt (the "
        "chat template writes its own).",
    )
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(
        description="The most tokens a sequence of this model may hold (prompt + new tokens)."
    )
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: ModelName = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: Text
