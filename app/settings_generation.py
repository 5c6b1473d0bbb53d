"""The generation task's settings (models with task `generate`): a base of `Settings`
(app/settings.py), read from the environment with the same prefix, ``STEADY_``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GenerationSettings(BaseSettings):
    """The KV cache, its steps and its queue, for every generate model."""

    model_config = SettingsConfigDict(env_prefix="STEADY_", extra="ignore", frozen=True)

    generate_slots: int = Field(
        default=32,
        ge=1,
        description="Sequences one generate model runs at once: the rows of its KV cache, "
        "preallocated at start-up (half precision on CUDA) and reused, never allocated per "
        "request.",
    )
    generate_slot_tokens: int = Field(
        default=512,
        ge=2,
        description="Tokens one KV-cache slot holds: the cap on prompt + max_new_tokens of one "
        "sequence (also capped by the model's positions); a request over it is answered 400.",
    )
    generate_max_batch_tokens: int = Field(
        default=2048,
        ge=2,
        description="Prompt tokens prefilled in one step (prompt rows x their longest chunk); "
        "further joiners wait for the next step. At least one chunk.",
    )
    generate_prefill_chunk_tokens: int = Field(
        default=128,
        ge=1,
        description="The most prompt tokens one sequence prefills in one step (chunked "
        "prefill): a longer prompt takes a chunk a step beside the running decode rows, "
        "which keep getting tokens, and chooses its first token with its last chunk.",
    )
    generate_steps_per_dispatch: int = Field(
        default=16,
        ge=1,
        description="Decode steps one generate model runs per compute dispatch when no "
        "sequence joins (multi-step decoding; 1: off), the compute thread feeding each "
        "chosen token back while the event loop takes the last step's: a streamed sequence "
        "gets each token as its step ends, the others their run's tokens as it ends or as "
        "their row leaves it (EOS, a stop id). An "
        "arrival that can take a slot, a cancel, an expired streamed sequence or another "
        "model in line for the compute slots ends the run after its current step; no run "
        "goes past the deadline of a sequence that does not stream, by the measured step "
        "time (its deadline is checked as the run ends).",
    )
    generate_max_waiting: int = Field(
        default=64,
        ge=0,
        description="Sequences of one generate model waiting for a free slot; beyond it, 429 "
        "(reason `queue`); before the body too when every model the path may reach is at "
        "its cap or over its budget. The delay budget normally refuses first.",
    )
    generate_prefix_reuse: bool = Field(
        default=True,
        description="Prefix reuse: a joining sequence takes the free KV-cache slot whose "
        "resident tokens (those its last occupant computed) share the longest prefix of its "
        "prompt, and prefills only past them (at least 16 reused, never its last token, "
        "never with prompt_logprobs). Outputs equal a full prefill's up to floating-point "
        "rounding.",
    )
