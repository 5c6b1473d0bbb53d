"""The log probabilities of generated tokens as the generation routes answer them:
/v1/completions' legacy object, /v1/chat/completions' `content` list, and /infer's list
(`schemas_generation.py` uses them; `api/openai_logprobs.py` builds them)."""

from __future__ import annotations

from pydantic import BaseModel


class InferAlternative(BaseModel):
    token: str
    token_id: int
    logprob: float


class InferTokenLogprob(InferAlternative):
    top_logprobs: list[InferAlternative]


class CompletionLogprobs(BaseModel):
    """Per token: its text, log probability, the most likely tokens' (the top `logprobs`,
    and the chosen token), and where its text begins in the choice's text. With `echo`, the
    prompt's tokens first, the first with null log probabilities."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatAlternative(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatAlternative):
    top_logprobs: list[ChatAlternative]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None
