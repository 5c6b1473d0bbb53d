"""The decoder forward written out (`app/models/direct_decoder.py`) computes what the model's
own forward computes: over prefill with right-padded rows in scattered slots, then decode
steps, its logits match the model's own (through the same runner, `direct=False`) for Llama
(with and without biases, grouped and not), Mistral with a sliding window, Qwen2 (one
layer full, one windowed) and Qwen3 (its query and key heads normed), in float32 and bf16;
greedy tokens are equal. Models it does not reproduce run their own forward, untouched; the
fused projections are the model's only copy of those weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from app.engine.protocol import SamplingParams
from app.model_specs import ModelSpec
from app.models.causal_lm import CausalLMRunner, StepRow, load_causal_lm
from app.models.direct_decoder import DirectDecoder, sdpa_takes_grouped_heads
from app.models.sampling import new_generator
from app.models.token_buckets import padded_tokens
from tests.support.small_decoders import PROMPTS, SMALL_DECODER

COMMON = SMALL_DECODER
SCATTERED = [3, 1, 2]  # out of order: the cache is read by index
CONSECUTIVE = [0, 1, 2]  # read as a view of the cache
STEPS = 12
Build = Callable[[], PreTrainedModel]

BUILDS: dict[str, Build] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "llama-biases-no-gqa": lambda: LlamaForCausalLM(
        LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True)
    ),
    "llama-rope-scaled": lambda: LlamaForCausalLM(
        LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0})
    ),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=6)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    # Heads wider than hidden / heads: projections of 128 from a width of 64.
    "qwen2-head-dim-32": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, head_dim=32)),
    # Query and key heads normed before their rotation; biases on every attention projection.
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32, attention_bias=True)),
    # Layer 0 full attention, layer 1 a 6-token window: each layer takes its own mask.
    "qwen2-mixed-window": lambda: Qwen2ForCausalLM(
        Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    ),
}


def saved(build: Build, directory: Path) -> Path:
    torch.manual_seed(0)
    model = build().eval()
    # Biases start at zero and norms' weights at one: random ones, so one left out or
    # misplaced shows.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.3)
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.normal_(1.0, 0.3)
    model.save_pretrained(directory)
    return directory


def runner(directory: Path, dtype: torch.dtype, direct: bool) -> CausalLMRunner:
    built = CausalLMRunner("m", str(directory), torch.device("cpu"), dtype, 4, 64, direct)
    assert (built._direct is not None) == direct
    return built


def steps(
    model: CausalLMRunner, slots: list[int] = SCATTERED
) -> list[tuple[torch.Tensor, list[int]]]:
    """Each step's logits and greedy tokens: the prompts prefilled together, then decodes
    fed each row's own greedy token."""
    greedy = SamplingParams(max_new_tokens=STEPS + 1)
    generator = new_generator(0)
    rows = [
        StepRow(slot, prompt, 0, greedy, generator, prefill=True)
        for slot, prompt in zip(slots, PROMPTS, strict=True)
    ]
    starts = [len(prompt) for prompt in PROMPTS]
    seen = []
    for _ in range(STEPS):
        logits = model.logits(rows)
        tokens = logits.argmax(dim=-1).tolist()
        seen.append((logits, tokens))
        rows = [
            StepRow(slot, [token], start, greedy, generator)
            for slot, token, start in zip(slots, tokens, starts, strict=True)
        ]
        starts = [start + 1 for start in starts]
    return seen


@pytest.mark.parametrize("slots", [SCATTERED, CONSECUTIVE], ids=["scattered", "consecutive"])
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_logits_match_the_models_own_forward_in_float32(
    name: str, slots: list[int], tmp_path: Path
) -> None:
    directory = saved(BUILDS[name], tmp_path)
    own = steps(runner(directory, torch.float32, direct=False), slots)
    direct = steps(runner(directory, torch.float32, direct=True), slots)
    for (own_logits, own_tokens), (direct_logits, direct_tokens) in zip(own, direct, strict=True):
        # Summation order within a fused projection aside (~1e-5 here), the arithmetic is
        # the same: a wrong eps, bias, rotation or mask is off by far more.
        torch.testing.assert_close(direct_logits, own_logits, rtol=1e-4, atol=1e-4)
        assert direct_tokens == own_tokens


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_match_in_bf16(name: str, tmp_path: Path) -> None:
    directory = saved(BUILDS[name], tmp_path)
    own = steps(runner(directory, torch.bfloat16, direct=False))
    direct = steps(runner(directory, torch.bfloat16, direct=True))
    for (own_logits, own_tokens), (direct_logits, direct_tokens) in zip(own, direct, strict=True):
        torch.testing.assert_close(direct_logits, own_logits, rtol=2e-2, atol=2e-2)
        assert direct_tokens == own_tokens


# (rows, longest prompt) of a prefill over a 4-slot cache: its rows x longest tokens at the
# slot count (unpadded), and over it at and past token buckets (padded to 6, 8, 12, 16, 32
# and 48 rows for the linears).
CROSSING = [(2, 2), (1, 5), (2, 3), (1, 7), (3, 3), (1, 13), (4, 7), (3, 11)]


def prefill_then_decode(model: CausalLMRunner, prompts: list[list[int]]) -> tuple[Any, ...]:
    """The prompts' prefill logits, the next decode step's, the cache's slots after them,
    and the row counts of the prefill's linears but the head's."""
    greedy = SamplingParams(max_new_tokens=2)
    fed = [
        StepRow(slot, prompt, 0, greedy, new_generator(0), prefill=True)
        for slot, prompt in zip([3, 0, 2, 1], prompts, strict=False)
    ]
    linear_rows: list[int] = []
    linear = torch.nn.functional.linear

    def recorded(x: torch.Tensor, *args: Any) -> Any:
        linear_rows.append(x.numel() // x.shape[-1])
        return linear(x, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", recorded)
        prefill = model.logits(fed)
    following = [
        StepRow(row.slot, [token], len(row.token_ids), greedy, row.generator)
        for row, token in zip(fed, prefill.argmax(dim=-1).tolist(), strict=True)
    ]
    decode = model.logits(following)
    cache = [(layer.keys.clone(), layer.values.clone()) for layer in model.cache.slot_layers]
    return prefill, decode, cache, set(linear_rows[:-1])


@pytest.mark.parametrize(("rows", "longest"), CROSSING)
def test_a_prefill_padded_to_a_token_bucket_computes_the_unpadded_forward(
    rows: int, longest: int, tmp_path: Path
) -> None:
    """On a CPU the linears run on rows x longest tokens padded to a bucket; the logits and
    every slot of the cache (the padding's rows written nowhere) are the model's own
    forward's, and so are the next decode step's logits."""
    directory = saved(BUILDS["qwen2"], tmp_path)
    generator = torch.Generator().manual_seed(rows * 100 + longest)
    lengths = [longest - (index % 2) * (longest // 2) for index in range(rows)]
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in lengths]
    own = prefill_then_decode(runner(directory, torch.float32, direct=False), prompts)
    direct = prefill_then_decode(runner(directory, torch.float32, direct=True), prompts)
    tokens = rows * longest
    assert own[3] == {tokens}
    assert direct[3] == {tokens if tokens <= 4 else padded_tokens(tokens, 4)}
    for own_logits, direct_logits in zip(own[:2], direct[:2], strict=True):
        torch.testing.assert_close(direct_logits, own_logits, rtol=1e-4, atol=1e-4)
    for (own_keys, own_values), (keys, values) in zip(own[2], direct[2], strict=True):
        torch.testing.assert_close(keys, own_keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values, own_values, rtol=1e-4, atol=1e-4)


def test_fused_projections_are_the_models_only_copy(tmp_path: Path) -> None:
    directory = saved(BUILDS["qwen2"], tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        before = model(ids).logits
    decoder = DirectDecoder.build(model, ["full_attention"] * 2)
    assert decoder is not None
    for layer, built in zip(model.model.layers, decoder._layers, strict=True):
        fused = built.qkv_weight.untyped_storage().data_ptr()
        for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            assert linear.weight.untyped_storage().data_ptr() == fused
        assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == (
            built.gate_up_weight.untyped_storage().data_ptr()
        )
    with torch.inference_mode():
        after = model(ids).logits
    assert torch.equal(before, after)  # the model's own forward reads the same weights


class _NotPlainLinear(nn.Linear):
    """Stands for a quantized linear: an `nn.Linear` subclass computing something else."""


def _quantized_llama() -> PreTrainedModel:
    model = LlamaForCausalLM(LlamaConfig(**COMMON))
    plain = model.model.layers[1].mlp.down_proj
    swapped = _NotPlainLinear(plain.in_features, plain.out_features, bias=False)
    swapped.weight = plain.weight
    model.model.layers[1].mlp.down_proj = swapped
    return model


def _llama_with_attention_norms() -> PreTrainedModel:
    """A part the written-out attention does not compute (a query norm on a Llama, whose
    own forward never calls it), on a type it otherwise reproduces."""
    model = LlamaForCausalLM(LlamaConfig(**COMMON))
    model.model.layers[0].self_attn.q_norm = nn.LayerNorm(16)
    return model


def _mistral_with_layer_types() -> PreTrainedModel:
    # Mistral's own code windows every layer whatever `layer_types` says.
    layer_types = ["full_attention", "sliding_attention"]
    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=6, layer_types=layer_types))


def _eager_llama() -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**COMMON, attn_implementation="eager"))


REFUSED: dict[str, Build] = {
    "gemma2: another model type": lambda: Gemma2ForCausalLM(Gemma2Config(**COMMON)),
    "eager attention": _eager_llama,
    "a linear subclass": _quantized_llama,
    "an extra attention part": _llama_with_attention_norms,
    "mistral with layer_types": _mistral_with_layer_types,
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_models_it_does_not_reproduce_keep_their_own_forward_untouched(case: str) -> None:
    torch.manual_seed(0)
    model = REFUSED[case]().eval()
    weights = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    layers = len(model.model.layers)
    assert DirectDecoder.build(model, ["full_attention"] * layers) is None
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == weights


@pytest.mark.parametrize("grouped_in_sdpa", [True, False], ids=["cpu-form", "cuda-form"])
def test_grouped_heads_reach_sdpa_in_the_form_the_device_serves_fast(
    grouped_in_sdpa: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU takes grouped heads into SDPA as they are (`enable_gqa`); CUDA serves that
    under a mask only in its math kernel, so there a decode's query heads go in as rows of
    their group and a prefill's keys repeated (transformers' own SDPA path). Either form
    gives the model's own logits."""
    assert sdpa_takes_grouped_heads(torch.device("cpu"))
    assert not sdpa_takes_grouped_heads(torch.device("cuda"))
    directory = saved(BUILDS["qwen2"], tmp_path)  # 4 query heads over 2 key/value heads
    own = steps(runner(directory, torch.float32, direct=False))
    calls: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, object]]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((tuple(query.shape), tuple(key.shape), dict(kwargs)))
        return sdpa(query, key, *args, **kwargs)

    direct_runner = runner(directory, torch.float32, direct=True)
    assert direct_runner._direct is not None
    direct_runner._direct.grouped_in_sdpa = grouped_in_sdpa  # as on the device named
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    direct = steps(direct_runner)
    prefill, decode = calls[0], calls[-1]
    if grouped_in_sdpa:
        assert all(kwargs.get("enable_gqa") for _, _, kwargs in calls)
        assert prefill[1][1] == decode[1][1] == 2
    else:
        assert calls and not any(kwargs.get("enable_gqa") for _, _, kwargs in calls)
        assert prefill[0][1] == prefill[1][1] == 4  # keys repeated to the query's heads
        assert decode[0][1:3] == (2, 2)  # (rows, key/value heads, heads per group, width)
    for (own_logits, _), (direct_logits, _) in zip(own, direct, strict=True):
        torch.testing.assert_close(direct_logits, own_logits, rtol=1e-4, atol=1e-4)


def test_a_spec_chooses_the_models_own_forward(tmp_path: Path) -> None:
    directory = saved(BUILDS["qwen2"], tmp_path)
    device = torch.device("cpu")
    chosen = {
        forward: load_causal_lm(
            ModelSpec(name="m", task="generate", source=str(directory), forward=forward),
            device,
            2,
            32,
        )
        for forward in ("auto", "transformers")
    }
    assert chosen["auto"]._direct is not None
    assert chosen["transformers"]._direct is None
    with pytest.raises(ValidationError, match="only a generate model chooses its forward"):
        ModelSpec(name="e", task="embed", forward="transformers")
