"""The slot runner is not Qwen2-only: random Llama and Mistral (every layer a 6-token
sliding window) models give model.generate's greedy tokens, with rows of different lengths
prefilled together and decoded together past the window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)

from app.engine.protocol import SamplingParams
from app.models.causal_lm import CausalLMRunner, StepRow
from app.models.sampling import new_generator

COMMON = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.3,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 20, 21], [1, 30, 31, 32, 33, 34]]
NEW_TOKENS = 16


def llama() -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**COMMON))


def mistral_with_window() -> PreTrainedModel:
    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=6))


@pytest.mark.parametrize("build", [llama, mistral_with_window])
def test_greedy_equals_generate(build: object, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build().eval()  # type: ignore[operator]
    model.save_pretrained(tmp_path)
    runner = CausalLMRunner("m", str(tmp_path), torch.device("cpu"), torch.float32, 4, 64)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS)
    generator = new_generator(0)
    # Slots 3, 1, 2: out of order, so the cache is read by index, not as a view.
    slots = [3, 1, 2]
    rows = [
        StepRow(slot, prompt, 0, greedy, generator)
        for slot, prompt in zip(slots, PROMPTS, strict=True)
    ]
    produced = [[token] for token in runner.step(rows)]
    while len(produced[0]) < NEW_TOKENS:
        rows = [
            StepRow(slot, [tokens[-1]], len(prompt) + len(tokens) - 1, greedy, generator)
            for slot, prompt, tokens in zip(slots, PROMPTS, produced, strict=True)
        ]
        for tokens, token in zip(produced, runner.step(rows), strict=True):
            tokens.append(token)
    for prompt, tokens in zip(PROMPTS, produced, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            output = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
            )
        assert tokens == output[0, len(prompt) :].tolist()
