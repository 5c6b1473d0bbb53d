"""What the generation integration tests share: the engine settings they run the tiny
causal LM with (fp32: exact equality with `model.generate` needs it; in bf16/fp16 a padded
or batched row's rounding differs from a lone one's, and near-tied logits can flip), the
reference model and its greedy continuation of one prompt, and the SSE frames of a
streamed answer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from app.model_specs import ModelSpec
from app.models.base import resolve_device, resolve_dtype
from app.settings import Settings

DTYPE = "float32"


def generate_settings(
    models: dict[str, Path], *, slots: int, slot_tokens: int, **overrides: object
) -> Settings:
    """Settings serving `models` (name -> directory) as generate models in fp32, with
    `slots` KV-cache slots of `slot_tokens` tokens."""
    values: dict[str, object] = {
        "models": tuple(
            ModelSpec(name=name, task="generate", source=str(source), dtype=DTYPE)
            for name, source in models.items()
        ),
        "generate_slots": slots,
        "generate_slot_tokens": slot_tokens,
        "generate_max_batch_tokens": slot_tokens,
        "length_buckets": (16, 64),
        "torch_threads": 1,
        "spike_reports": False,
        # The point here is the results: a busy shared machine must not refuse these.
        "max_queue_delay_ms": 60_000,
        **overrides,
    }
    return Settings(**values)  # type: ignore[arg-type]


def load_reference(directory: Path) -> tuple[Any, PreTrainedModel]:
    """The model's tokenizer and the model itself in fp32, in-process."""
    device = resolve_device("auto")
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=resolve_dtype(DTYPE, device, directory)
    )
    return AutoTokenizer.from_pretrained(directory), model.to(device).eval()


@dataclass(frozen=True)
class ReferenceGreedy:
    token_ids: list[int]  # the new tokens before EOS (EOS itself is not part of the result)
    at_eos: bool  # it ended at EOS rather than at max_new_tokens


def reference_greedy(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int
) -> ReferenceGreedy:
    """model.generate on one prompt, no padding."""
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt_ids], device=model.device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    new = output[0, len(prompt_ids) :].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    for index, token in enumerate(new):
        if token in eos_ids:
            return ReferenceGreedy(new[:index], True)
    return ReferenceGreedy(new, False)


def sse_payloads(body: bytes) -> list[Any]:
    """The JSON payloads of a streamed answer, checked to be complete `data:` frames ending
    with `data: [DONE]`."""
    frames = body.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""], body[-200:]
    assert all(frame.startswith(b"data: ") for frame in frames[:-2])
    return [orjson.loads(frame[len(b"data: ") :]) for frame in frames[:-2]]
