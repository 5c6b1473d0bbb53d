"""The slot runner is not Qwen2-only: random Llama and Mistral (every layer a 6-token
sliding window) models give model.generate's greedy tokens, with rows of different lengths
prefilled together and decoded together past the window; Granite, HyperCLOVA X, Cohere and
Gemma 2 give their own forward's logits, scaling included (a model type whose use of
`logits_scaling` is not known is refused)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    CohereConfig,
    CohereForCausalLM,
    FalconConfig,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    HyperCLOVAXConfig,
    HyperCLOVAXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from app.engine.protocol import SamplingParams
from app.models.causal_lm import CausalLMRunner, StepRow
from app.models.sampling import new_generator
from tests.support.small_decoders import PROMPTS, SMALL_DECODER

COMMON = SMALL_DECODER
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


def granite_scaled() -> PreTrainedModel:
    return GraniteForCausalLM(GraniteConfig(**COMMON, logits_scaling=8.0))


def granitemoe_scaled() -> PreTrainedModel:
    return GraniteMoeForCausalLM(
        GraniteMoeConfig(**COMMON, logits_scaling=8.0, num_local_experts=2, num_experts_per_tok=1)
    )


def hyperclovax_scaled() -> PreTrainedModel:
    """HyperCLOVA X multiplies by its `logits_scaling` ("unlike GraniteConfig")."""
    return HyperCLOVAXForCausalLM(HyperCLOVAXConfig(**COMMON, logits_scaling=8.0))


def cohere_scaled() -> PreTrainedModel:
    return CohereForCausalLM(CohereConfig(**COMMON, logit_scale=0.0625))


def gemma2_soft_capped() -> PreTrainedModel:
    return Gemma2ForCausalLM(
        Gemma2Config(**COMMON, head_dim=16, sliding_window=6, final_logit_softcapping=2.0)
    )


@pytest.mark.parametrize(
    "build",
    [granite_scaled, granitemoe_scaled, hyperclovax_scaled, cohere_scaled, gemma2_soft_capped],
)
def test_logits_are_the_models_own_after_its_scaling(build: object, tmp_path: Path) -> None:
    """Sampling reads the logits' scale: Cohere multiplies the head's output, Granite
    divides it by its `logits_scaling`, HyperCLOVA X multiplies by its own (it was divided,
    64 times too small at 8: every sample drawn far too hot), Gemma 2 soft-caps it; without
    that, a sample is drawn many times too cold or too hot (greedy tokens alone would not
    show it)."""
    torch.manual_seed(0)
    model = build().eval()  # type: ignore[operator]
    model.save_pretrained(tmp_path)
    runner = CausalLMRunner("m", str(tmp_path), torch.device("cpu"), torch.float32, 2, 64)
    prompt = PROMPTS[0]
    row = StepRow(0, prompt, 0, SamplingParams(max_new_tokens=1), new_generator(0))
    ours = runner.logits([row])[0]
    with torch.inference_mode():
        theirs = model(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def llama_with_pad_outside_the_vocabulary() -> PreTrainedModel:
    """Old LLaMA conversions say pad_token_id -1: padded with it, every step of prompts of
    different lengths failed (the engine never got past warm-up). The generation config
    leaves it out: transformers before 5.2x refuses to save a negative one there, and the
    runner reads the model config's."""
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "pad_token_id": -1}))
    model.generation_config.pad_token_id = None
    return model


def test_a_pad_token_outside_the_vocabulary_is_not_used_to_pad(tmp_path: Path) -> None:
    test_greedy_equals_generate(llama_with_pad_outside_the_vocabulary, tmp_path)
    runner = CausalLMRunner("m", str(tmp_path), torch.device("cpu"), torch.float32, 4, 64)
    assert 0 <= runner.pad_token_id < runner.vocab_size


def test_longrope_sequences_are_capped_at_the_original_context(tmp_path: Path) -> None:
    """Past it, longrope rotates every row of a forward with the long factors once one row
    is long: a short sequence's tokens depended on its neighbours."""
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * (head_dim // 2),
        "long_factor": [4.0] * (head_dim // 2),
        "original_max_position_embeddings": 16,
    }
    config = Phi3Config(**COMMON, rope_scaling=rope, original_max_position_embeddings=16)
    Phi3ForCausalLM(config).save_pretrained(tmp_path)
    runner = CausalLMRunner("m", str(tmp_path), torch.device("cpu"), torch.float32, 4, 64)
    assert runner.max_sequence_tokens == 16


@pytest.mark.parametrize(
    "config,named",
    [
        (BloomConfig(vocab_size=300, hidden_size=64, n_layer=2, n_head=4), "ALiBi"),
        (
            FalconConfig(
                vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                multi_query=True, new_decoder_architecture=False,
            ),
            "multi-query",
        ),
    ],
)  # fmt: skip
def test_attention_the_slot_cache_cannot_serve_is_refused_by_name(
    config: PretrainedConfig, named: str, tmp_path: Path
) -> None:
    """They failed in warm-up with a bare IndexError or ValueError: "start-up failed"."""
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=named):
        CausalLMRunner("m", str(tmp_path), torch.device("cpu"), torch.float32, 4, 64)
