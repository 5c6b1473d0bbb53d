"""Request and response models of the generation routes (HTTP edge only): /infer on a
generate model, and OpenAI's /v1/completions and /v1/chat/completions.

OpenAI's sampling conventions hold on the OpenAI routes (temperature 0 is greedy, the
default 1.0 samples); /infer follows transformers' `generate` (greedy unless `do_sample`).
Log probabilities are those of the generated tokens (`logprobs`), and with completions'
`echo` the prompt's too, of the model's raw logits (`protocol_logprobs.py`).
Fields OpenAI defines that steadyserve does not implement are modelled at the value that asks
for nothing (a request asking for more is refused: 400 on the OpenAI routes, 422 on /infer),
and any other field is refused: a request is never silently served differently than asked.
Fields that change nothing about the answer (an end-user id, chat's `store: false`,
`metadata`, `service_tier`) are taken and ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.engine.protocol_logprobs import MAX_TOP_LOGPROBS
from app.schemas import StrictModel, whole_number
from app.schemas_chat import ChatMessages
from app.schemas_choices import MAX_CHOICES, best_of_one
from app.schemas_logprobs import ChatLogprobs, CompletionLogprobs, InferTokenLogprob
from app.schemas_prompts import INT64_MAX, INT64_MIN, CompletionPrompts, Prompts

# The longest stop string taken. Text that may begin one is held back from the stream until
# the next token shows whether it does, and matching such a beginning costs up to its length
# squared per token, on the front end's event loop: a megabyte-long stop stalled it.
STOP_MAX_CHARACTERS = 256
StopText = Annotated[str, StringConstraints(min_length=1, max_length=STOP_MAX_CHARACTERS)]
# OpenAI allows 4 stop sequences, vLLM any number; lm-eval-harness sends every `until`
# string of a task. 16: each is matched on the front end's event loop at every token (its
# held-back beginnings too, each bounded by STOP_MAX_CHARACTERS), so the cap bounds that
# work per token, at 4x OpenAI's.
MAX_STOP_STRINGS = 16
StopList = Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)]
StopStrings = StopText | StopList | None
Finish = Literal["stop", "length"]

OPENAI_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default `max_tokens` for /v1/completions
# The most alternatives per token: OpenAI's legacy completions take 5, chat and /infer 20.
MAX_COMPLETION_LOGPROBS = 5


class GenerateParameters(StrictModel):
    max_new_tokens: int = Field(
        default=20, ge=1, le=INT64_MAX, description="Most tokens to generate."
    )
    do_sample: StrictBool = Field(default=False, description="Sample; greedy (argmax) when false.")
    temperature: float = Field(
        default=1.0, ge=0, le=100, description="With do_sample (then above 0); else ignored."
    )
    top_p: float = Field(
        default=1.0, ge=0, le=1, description="Nucleus filter, with do_sample (0: the top token)."
    )
    top_k: int = Field(
        default=0, ge=0, le=INT64_MAX, description="Top-k filter (0: off), with do_sample."
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        le=INT64_MAX,
        description="Makes sampling reproducible (the draws; a batched forward's "
        "logits may differ in their last bits with the batch a sequence shares, on a GPU above "
        "all).",
    )
    stop: StopList = Field(
        default_factory=list, description="Stop strings: the text ends before one."
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Each generated token's log probability and this many alternatives'.",
    )

    _whole_numbers = field_validator("max_new_tokens", "top_k", "seed", "logprobs", mode="before")(
        whole_number
    )

    @field_validator("temperature")
    @classmethod
    def _positive_when_sampling(cls, temperature: float, info: ValidationInfo) -> float:
        # As transformers: a temperature of 0 is refused only where it would divide logits
        # (greedy decoding ignores it, so clients sending 0 for "deterministic" are served).
        if temperature == 0 and info.data.get("do_sample"):
            raise ValueError("temperature must be above 0 when do_sample is true")
        return temperature


class GenerateInferRequest(StrictModel):
    """/infer on a generate model: one prompt or a list, each continued independently."""

    model: str | None = Field(default=None, description="Model name; the default model if absent.")
    inputs: Prompts
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    timeout_ms: float | None = Field(default=None, gt=0, description="Deadline from admission.")


class GeneratedText(BaseModel):
    text: str
    finish_reason: Finish
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[InferTokenLogprob] | None = None  # with `parameters.logprobs`


class GenerateUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    inputs: int


class GenerateInferResponse(BaseModel):
    model: str
    outputs: list[GeneratedText]
    usage: GenerateUsage


class StreamOptions(StrictModel):
    include_usage: StrictBool = False
    # OpenAI pads streamed chunks with random text unless this is false; none is added here.
    include_obfuscation: StrictBool = False


# OpenAI reads null as the default for these (the openai client sends null for a parameter
# its caller passed as None): completions' `max_tokens` is 16 then, not "no limit". The
# OpenAPI document says they take null (`api/openapi.py`).
NULL_MEANS_DEFAULT = frozenset(
    {"temperature", "top_p", "top_k", "stream", "n", "presence_penalty", "frequency_penalty",
     "echo", "best_of", "max_tokens"}
)  # fmt: skip


class OpenAISampling(StrictModel):
    model: str | None = None
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, ge=0, le=1)
    top_k: int = Field(
        default=0, ge=0, le=INT64_MAX, description="Not OpenAI's: top-k filter, 0 is off."
    )
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopStrings = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="Samples per prompt.")
    user: str | None = None
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = Field(
        default=None, description="Not served: null or {} only."
    )

    _whole_numbers = field_validator(
        "top_k", "seed", "n", "presence_penalty", "frequency_penalty", mode="before"
    )(whole_number)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: object) -> object:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in NULL_MEANS_DEFAULT}
        return data

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def logprobs_asked(self) -> int | None:
        """The alternatives asked per generated token; None: no log probabilities."""
        return None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAISampling):
    prompt: CompletionPrompts = Field(
        description="A string, a list of strings, a list of token ids (one prompt) or a list "
        "of lists of token ids (one prompt each)."
    )
    # Before max_tokens, whose validator reads it.
    echo: StrictBool = Field(
        default=False, description="The text (and log probabilities) begin with the prompt's."
    )
    max_tokens: int = Field(
        default=OPENAI_DEFAULT_COMPLETION_TOKENS,
        ge=0,
        le=INT64_MAX,
        description="Most tokens to generate; 0 only with echo (the prompt alone).",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_COMPLETION_LOGPROBS,
        description="Each token's log probability and this many alternatives' (with echo, "
        "the prompt's tokens first).",
    )
    best_of: Literal[1] | None = Field(default=None, description="1 or null only.")
    suffix: None = None

    @field_validator("max_tokens")
    @classmethod
    def _no_tokens_only_with_echo(cls, max_tokens: int, info: ValidationInfo) -> int:
        # OpenAI's legacy API and older lm-eval-harness ask for a prompt's log probabilities
        # with max_tokens 0 and echo; without echo it would ask for nothing.
        if max_tokens == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1 (0 only with echo: true)")
        return max_tokens

    def logprobs_asked(self) -> int | None:
        """The alternatives asked per token; None: no log probabilities."""
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """The alternatives asked per prompt token (echo with logprobs); None: none."""
        return self.logprobs if self.echo else None

    # Named apart from OpenAISampling's, which a validator of the same name would replace.
    _whole_counts = field_validator("max_tokens", "logprobs", mode="before")(whole_number)
    _best_of = field_validator("best_of", mode="before")(best_of_one)


class TextResponseFormat(StrictModel):
    type: Literal["text"]


class ChatCompletionRequest(OpenAISampling):
    messages: ChatMessages
    # Not served, and accepted at the value that asks for nothing (clients and wrappers
    # send them so): no tools, plain text.
    tools: Annotated[list[object], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None
    # Change nothing about the answer (the openai client sends them where its caller does):
    # nothing is stored, metadata only annotates a stored answer, one tier serves all,
    # and identifiers only name the end user or a cache hint.
    store: Literal[False] | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: TextResponseFormat | None = None
    # The generated tokens' log probabilities, and up to 20 alternatives' (`logprobs_asked`).
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="Deprecated by OpenAI."
    )
    max_completion_tokens: int | None = Field(
        default=None,
        ge=1,
        le=INT64_MAX,
        description="Most tokens to generate; the model's room if unset.",
    )

    _whole_counts = field_validator(
        "max_tokens", "max_completion_tokens", "top_logprobs", mode="before"
    )(whole_number)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        # As OpenAI; 0 asks for nothing, and is taken (as before log probabilities were served).
        if top and info.data.get("logprobs") is not True:
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def logprobs_asked(self) -> int | None:
        """The alternatives asked per generated token; None: no log probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    index: int
    finish_reason: Finish | None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class _CompletionObject(BaseModel):
    """What a whole completion and a whole chat completion share (their `object` and
    `choices` differ)."""

    id: str
    created: int
    model: str
    usage: CompletionUsage


class CompletionResponse(_CompletionObject):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_CompletionObject):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
