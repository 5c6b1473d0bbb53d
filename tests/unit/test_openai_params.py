"""What the OpenAI routes refuse rather than serve differently than asked (422)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.schemas_generation import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("logprobs", [0, 1, 5, True])
def test_log_probabilities_are_refused_whatever_their_spelling(logprobs: object) -> None:
    """`logprobs: 0` on /v1/completions asks for the chosen tokens' log probabilities."""
    with pytest.raises(ValidationError, match="log probabilities are not served"):
        CompletionRequest.model_validate({"prompt": "Hi", "logprobs": logprobs})
    with pytest.raises(ValidationError, match="log probabilities are not served"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "logprobs": logprobs})


def test_false_or_null_log_probabilities_are_accepted() -> None:
    for logprobs in (False, None):
        assert CompletionRequest.model_validate({"prompt": "Hi", "logprobs": logprobs})


def test_stream_options_without_a_stream_are_refused() -> None:
    options = {"include_usage": True}
    with pytest.raises(ValidationError, match="only allowed when stream is true"):
        CompletionRequest.model_validate({"prompt": "Hi", "stream_options": options})
    streamed = {"prompt": "Hi", "stream": True, "stream_options": options}
    assert CompletionRequest.model_validate(streamed).include_usage
