"""What one served model is: its name, its task, where its weights come from and, for a
`tensor` model, its declared inputs and outputs (`ModelSpec`, `TensorSpec`), each checked
on construction.

Pure pydantic models, no I/O: `settings.py` reads them from `STEADY_MODELS` (once, in the
process that builds `Settings`); any thread of either process may then read them.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, model_validator

BUNDLED_DEFAULT_SOURCE = "bundled:all-MiniLM-L6-v2"

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
TensorDatatype = Literal["FP16", "BF16", "FP32", "INT64", "BOOL"]
# Bytes of one element as binary data (`tensors.NUMPY_DTYPES`' item sizes).
DATATYPE_BYTES: dict[str, int] = {"FP16": 2, "BF16": 2, "FP32": 4, "INT64": 8, "BOOL": 1}


class TensorSpec(BaseModel):
    """One input or output of a `tensor` model, as the Open Inference Protocol names it.

    `shape` starts with -1, the batch dimension (the scheduler batches along it); any other
    -1 is a dynamic dimension, padded with zeros up to the length bucket of the row's
    longest dynamic dimension (as token lengths are) and, in outputs, sliced back to it.
    """

    model_config = {"frozen": True, "extra": "forbid"}

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_.:-]*$")
    datatype: TensorDatatype = Field(description="Element type, as the protocol names it.")
    shape: tuple[int, ...] = Field(
        min_length=1, description="-1 first (the batch), then sizes or -1 (dynamic)."
    )

    @model_validator(mode="after")
    def _check_shape(self) -> TensorSpec:
        if self.shape[0] != -1:
            raise ValueError(f"{self.name}: the first dimension must be -1 (the batch)")
        if any(size == 0 or size < -1 for size in self.shape[1:]):
            raise ValueError(f"{self.name}: dimensions are -1 (dynamic) or positive")
        return self

    @property
    def dynamic(self) -> bool:
        """Whether a dimension besides the batch is dynamic."""
        return -1 in self.shape[1:]

    def smallest_row_bytes(self) -> int:
        """The fewest body bytes that can carry one row of this tensor, its dynamic
        dimensions at 1: its raw bytes (binary data), or as JSON one digit and a comma an
        element, whichever is fewer (token ids in JSON take fewer than their INT64 bytes)."""
        elements = math.prod(max(size, 1) for size in self.shape[1:])
        return min(elements * DATATYPE_BYTES[self.datatype], 2 * elements - 1)


class ModelSpec(BaseModel):
    """One model to serve: its public name, its task and where its weights come from."""

    model_config = {"frozen": True, "extra": "forbid"}

    # A path segment of /v2/models/{name}/...: no '/' (`source` may be a Hugging Face id,
    # `org/model`; the name may not), and not empty (a request naming "" got the default).
    name: str = Field(
        default="all-MiniLM-L6-v2",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$",
        description="Public name, used in the `model` field of requests, in /v1/models and "
        "in /v2/models/{name}: letters, digits and `_.:-`.",
    )
    task: Literal["embed", "tensor", "generate"] = Field(
        default="embed",
        description="What the model does: `embed` (texts to vectors), `tensor` (a "
        "torch.export `.pt2` or TorchScript file with declared `inputs` and `outputs`) or "
        "`generate` (a causal LM, continuous batching over a preallocated KV cache).",
    )
    source: str = Field(
        default=BUNDLED_DEFAULT_SOURCE,
        description=(
            "A local directory, a Hugging Face id (resolved from the local cache only when "
            "HF_HUB_OFFLINE=1), or `bundled:all-MiniLM-L6-v2` for the packaged default."
        ),
    )
    dtype: Dtype = Field(
        default="auto",
        description="Weights dtype; `auto` means, on CUDA, bf16 where the GPU has it natively "
        "unless the checkpoint's config.json declares fp16 (then fp16); on GPUs without bf16, "
        "fp32 for a checkpoint declaring bf16 (it would overflow fp16), else fp16; on a CPU, "
        "bf16 where native, else fp32.",
    )
    max_input_tokens: int | None = Field(
        default=None,
        ge=2,
        description="Token limit per input; defaults to the model's, capped by the largest "
        "length bucket.",
    )
    forward: Literal["auto", "transformers"] = Field(
        default="auto",
        description="`generate` task: `auto` runs Llama, Mistral, Qwen2 and Qwen3 (SDPA, "
        "plain linears) through steadyserve's written-out decoder forward (the model's "
        "arithmetic, fewer Python calls a step; the log says which ran) and any other model "
        "through its own; `transformers` always runs the model's own forward.",
    )
    inputs: tuple[TensorSpec, ...] = Field(
        default=(), description="`tensor` task: the model's inputs, in call order."
    )
    outputs: tuple[TensorSpec, ...] = Field(
        default=(), description="`tensor` task: the model's outputs, in return order."
    )

    @model_validator(mode="after")
    def _check_task(self) -> ModelSpec:
        if self.task == "tensor":
            if not self.inputs or not self.outputs:
                raise ValueError(f"{self.name}: a tensor model declares inputs and outputs")
            names = [t.name for t in (*self.inputs, *self.outputs)]
            if len(set(names)) != len(names):
                raise ValueError(f"{self.name}: input and output names must be unique")
            # A dynamic output dimension is sliced to the row's longest dynamic input
            # dimension: with none, its buffer holds 1 and any other length fails every batch.
            unsized = [t.name for t in self.outputs if t.dynamic]
            if unsized and not any(t.dynamic for t in self.inputs):
                raise ValueError(
                    f"{self.name}: output {unsized[0]!r} has a dynamic dimension (-1 past the "
                    "batch) but no input has one to give its length"
                )
        elif self.inputs or self.outputs:
            raise ValueError(f"{self.name}: only a tensor model declares inputs and outputs")
        if self.forward != "auto" and self.task != "generate":
            raise ValueError(f"{self.name}: only a generate model chooses its forward")
        return self


def _at_least_one(models: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
    if not models:
        raise ValueError("at least one model is needed")
    return models


# The models to serve, at least one. Not `min_length=1`: pydantic checks that on what is
# left once a model has failed, and added a false "at least 1 item" to the real error.
ModelSpecs = Annotated[tuple[ModelSpec, ...], AfterValidator(_at_least_one)]
