"""A prefill row right-padded beside a longer prompt computes as it does alone, whatever its
padding computes: with a model whose activations overflow on its pad token (here its
embedding made NaN), the padding's keys and values went into the row's slot, where its
own queries read them (masked: NaN + mask stays NaN), and the healthy row got non-finite
logits ("logits were not finite", 500), as would its decode steps beside a longer sequence.
The tiny model's runner itself, in fp32."""

from __future__ import annotations

from pathlib import Path

import torch

from app.engine.protocol import SamplingParams
from app.models.causal_lm import CausalLMRunner, StepRow
from app.models.sampling import NO_TOKEN, new_generator

SHORT = [1, 44, 45]
LONG = [1, *range(100, 112)]
GREEDY = SamplingParams(max_new_tokens=4)


def row(slot: int, tokens: list[int], start: int = 0) -> StepRow:
    return StepRow(slot, tokens, start, GREEDY, new_generator(0))


def test_a_padded_row_neither_reads_nor_keeps_its_padding(tiny_causal_lm: Path) -> None:
    runner = CausalLMRunner("tiny", str(tiny_causal_lm), torch.device("cpu"), torch.float32, 4, 64)
    pad = runner.pad_token_id
    assert pad not in SHORT and pad not in LONG
    # Alone, in slot 2: no padding. Its first token, then its next beside nothing.
    [alone] = runner.step([row(2, SHORT)])
    [alone_next] = runner.step([row(2, [alone], len(SHORT))])

    def overflowing(module: torch.nn.Module, inputs: tuple[torch.Tensor], out: torch.Tensor):  # type: ignore[no-untyped-def]
        return out.masked_fill((inputs[0] == pad).unsqueeze(-1), float("nan"))

    runner.model.get_input_embeddings().register_forward_hook(overflowing)
    short_token, long_token = runner.step([row(0, SHORT), row(1, LONG)])
    assert short_token == alone != NO_TOKEN
    assert long_token != NO_TOKEN
    for layer in runner.cache.layers:  # nothing of the padding in the short row's slot
        assert layer.keys is not None and layer.values is not None
        assert torch.all(layer.keys[0, :, len(SHORT) :] == 0)
        assert torch.all(layer.values[0, :, len(SHORT) :] == 0)
    # Its next token beside the longer one, whose keys it reads past its own end (masked).
    beside = [row(0, [short_token], len(SHORT)), row(1, [long_token], len(LONG))]
    short_next, _ = runner.step(beside)
    assert short_next == alone_next
