"""Request, response and error models: used at the HTTP edge only."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    field_validator,
)
from pydantic_core import PydanticCustomError

NonEmptyText = Annotated[str, StringConstraints(min_length=1)]


class StrictModel(BaseModel):
    """Unknown fields are refused (422; 400 on the OpenAI routes), and values are taken as
    the JSON type the field has: `"max_tokens": true` was 1 token and `"temperature": "0.5"`
    was 0.5, while `"stream": "true"` was refused (an integer is still a number for a float
    field, and a whole-number float an integer where a model applies `whole_number`)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def whole_number(value: object) -> object:
    """A `mode="before"` check of an integer field, or an integer literal such as `n`'s 1: a
    float with no fraction is that integer, as the OpenAPI document's JSON Schema counts it
    (and Python callers send OpenAI's number-typed penalties as 0.0); a boolean is refused,
    which a literal took for 0 or 1 (`True == 1`). Other values are left to the field."""
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def strings_only(value: object, field: str) -> object:
    """A `mode="before"` check for a text field that also takes a list: OpenAI's APIs accept
    token arrays there, which this server does not."""
    if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"{field} must be a string or a list of strings (token arrays are not supported)"
        )
    return value


class InferParameters(StrictModel):
    # Strict: JSON's 0/1 are not booleans (the OpenAPI document says boolean).
    normalize: StrictBool = Field(default=True, description="L2-normalise each output vector.")
    truncate: StrictBool = Field(
        default=False,
        description="Cut inputs to the model's token limit instead of answering 413.",
    )


class InferRequest(StrictModel):
    model: str | None = Field(default=None, description="Model name; the default model if absent.")
    inputs: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] = Field(
        description="One text or a non-empty list of texts."
    )
    parameters: InferParameters = Field(default_factory=InferParameters)
    timeout_ms: float | None = Field(default=None, gt=0, description="Deadline from admission.")


class Usage(BaseModel):
    input_tokens: int
    inputs: int


class InferResponse(BaseModel):
    model: str
    outputs: list[list[float]]
    usage: Usage


class EmbeddingsRequest(StrictModel):
    """OpenAI's embeddings request (text inputs)."""

    model: str | None = None
    input: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, gt=0)
    user: str | None = None

    _whole_numbers = field_validator("dimensions", mode="before")(whole_number)

    @field_validator("input", mode="before")
    @classmethod
    def _reject_token_arrays(cls, value: object) -> object:
        return strings_only(value, "input")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingsUsage


class ModelCard(BaseModel):
    """OpenAI's Model object (`id`, `object`, `created`, `owned_by`), plus the model's task."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(
        description="When the server started (Unix seconds; the same in every front end, "
        "since a model is served from its start): OpenAI's field is required, and the model "
        "files' own age is not known of every source."
    )
    owned_by: str = "steadyserve"
    task: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    type: str = Field(
        description="The reason, as `code`; on the OpenAI routes (`/v1/...`) OpenAI's class "
        "of the error instead: `invalid_request_error` (4xx), `rate_limit_exceeded` (429), "
        "`server_error` (5xx)."
    )
    message: str
    param: str | None = None
    code: str = Field(description="Why, by name (e.g. `queue`, `context_length_exceeded`).")


def error_object(error_type: str, message: str, param: str | None = None) -> dict[str, Any]:
    """Every error body (`ErrorBody`): OpenAI's envelope, where the openai client reads
    `code` (e.g. `context_length_exceeded`, `model_not_found`) and `type`; outside the
    OpenAI routes `type` is the reason too (`openai_error_object` for those routes)."""
    return {"error": {"type": error_type, "message": message, "param": param, "code": error_type}}


# OpenAI's error `type`s: its API and SDK class an error by these, and name the reason in
# `code`. OpenAI splits 429s by the quota hit ("requests", "tokens"); a server's refusals
# over its capacity are no client's quota, so every 429 gets the one name of what OpenAI
# puts in `code` for them.
OPENAI_CLIENT_ERROR = "invalid_request_error"
OPENAI_RATE_LIMITED = "rate_limit_exceeded"
OPENAI_SERVER_ERROR = "server_error"


def openai_error_type(status: int) -> str:
    """OpenAI's `type` of an error answered with `status`: 429 over a limit, any 5xx the
    server's, any other 4xx the request's."""
    if status == 429:
        return OPENAI_RATE_LIMITED
    if status >= 500:
        return OPENAI_SERVER_ERROR
    return OPENAI_CLIENT_ERROR


def openai_error_object(
    status: int, reason: str, message: str, param: str | None = None
) -> dict[str, Any]:
    """An error body of the OpenAI routes: OpenAI's `type` for `status`, the reason (what
    `error_object` makes the `type` elsewhere) in `code`."""
    error = error_object(reason, message, param)
    error["error"]["type"] = openai_error_type(status)
    return error


class ErrorBody(BaseModel):
    error: ErrorDetail
