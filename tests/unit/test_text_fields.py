"""OpenAI's text fields that also take a list: token arrays are refused (400 on the
OpenAI routes) with a message naming the field, on the embeddings and the completions routes
alike."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.schemas import EmbeddingsRequest
from app.schemas_generation import CompletionRequest


@pytest.mark.parametrize(
    ("model", "field"), [(EmbeddingsRequest, "input"), (CompletionRequest, "prompt")]
)
def test_token_arrays_are_refused_naming_the_field(
    model: type[EmbeddingsRequest] | type[CompletionRequest], field: str
) -> None:
    with pytest.raises(ValidationError, match=f"{field} must be a string or a list of strings"):
        model.model_validate({field: [[1, 2, 3]]})
    accepted = model.model_validate({field: ["one", "two"]})
    assert getattr(accepted, field) == ["one", "two"]
