"""OpenAI's text fields that also take a list: token arrays are refused on the embeddings
route (400) with a message naming the field, and taken as prompts on /v1/completions (one
list of ids, or a list of such lists; a mixture or an empty list is refused)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.schemas import EmbeddingsRequest
from app.schemas_generation import CompletionRequest


def test_token_arrays_are_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="input must be a string or a list of strings"):
        EmbeddingsRequest.model_validate({"input": [[1, 2, 3]]})
    accepted = EmbeddingsRequest.model_validate({"input": ["one", "two"]})
    assert accepted.input == ["one", "two"]


@pytest.mark.parametrize(
    "prompt", ["one", ["one", "two"], [1, 2, 3], [[1, 2, 3]], [[1], [2, 3]], [0, 2.0]]
)
def test_completions_take_texts_and_token_ids(prompt: object) -> None:
    taken = CompletionRequest.model_validate({"prompt": prompt}).prompt
    assert taken == prompt
    if isinstance(prompt, list) and not isinstance(prompt[0], str):
        flat = [i for ids in taken for i in ids] if isinstance(taken[0], list) else taken
        assert all(type(i) is int for i in flat)  # 2.0 is the integer 2


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "must not be an empty list"),
        ([[]], "must not be an empty list"),
        ([[1], []], "must not be an empty list"),
        (["one", 1], "one kind alone"),
        ([[1], "one"], "one kind alone"),
        ([1, [2]], "one kind alone"),
        ([True, 1], "one kind alone"),
        ([-1], "greater than or equal to 0"),
        ([[1, -2]], "greater than or equal to 0"),
        ([1.5], "integer"),
        ([[1, "a"]], "integer"),
        ([2**63], "less than or equal to"),
    ],
)
def test_completions_refuse_empty_mixed_and_negative_prompts(prompt: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CompletionRequest.model_validate({"prompt": prompt})
