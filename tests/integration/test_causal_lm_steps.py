"""One runner step's bookkeeping with a real (random Llama) model: a row padded past the
cache's end writes at the slot's last position, never into the next head's or slot's."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.engine.protocol import SamplingParams
from app.models.causal_lm import CausalLMRunner, StepRow
from app.models.sampling import new_generator

SLOT_TOKENS = 16


def test_padding_past_the_slot_end_stays_in_the_row_slot(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    runner = CausalLMRunner("m", str(tmp_path), torch.device("cpu"), torch.float32, 3, SLOT_TOKENS)
    greedy = SamplingParams(max_new_tokens=1)
    last = SLOT_TOKENS - 1
    # Slot 0 holds a sequence of 15 tokens (positions 0-14); slot 1's neighbour is empty.
    runner.step([StepRow(0, list(range(3, 3 + last)), 0, greedy, new_generator(0))])
    keys = runner.cache.layers[0].keys
    assert keys is not None
    before = keys.clone()
    # Slot 0 feeds its token at the last position in the same forward as a 3-token prompt
    # in slot 2: its row is padded to positions 15, 16, 17, which must clamp to 15.
    runner.step(
        [
            StepRow(0, [7], last, greedy, new_generator(0)),
            StepRow(2, [4, 5, 6], 0, greedy, new_generator(0)),
        ]
    )
    assert torch.equal(keys[0, :, :last], before[0, :, :last])  # slot 0's earlier positions
    assert not torch.equal(keys[0, :, last], before[0, :, last])  # its new key was written
    assert torch.equal(keys[1], before[1])  # the slot between is untouched
