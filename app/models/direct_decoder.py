"""A Llama-family decoder's forward (Llama, Mistral, Qwen2, Qwen3) written out as its
tensor operations, over the slot cache.

Why: at a decode step's sizes a small model's forward through transformers is mostly Python
(module calls, keyword plumbing, output records, mask preparation): the tiny Qwen2 of the
tests, 32 rows decoding, bf16, one thread, took 1.50 ms a step through `Qwen2Model.forward`
and 0.80 ms here (docs/BENCHMARKS.md, session 21). The arithmetic is the model's own: the
same embedding, RMSNorm in float32 then the weight in the model's dtype, the model's own
rotary-embedding module (so every RoPE type it knows), scaled-dot-product attention with the
runner's additive masks (Qwen3's query and key heads normed first), the SiLU-gated MLP, the
final norm. Two things differ from the module-by-module forward: the query, key and value
projections are one matrix product, and so are the gate and up projections (the modules'
weights become views into the fused tensors, so the model holds one copy); each output
element is still the dot product of the same row and column, so results differ at most by
the summation order within one (bf16: equal here; float32: logits within ~1e-5), which
tests/integration/test_direct_decoder.py bounds against the model's own forward.

`DirectDecoder.build` returns None for any model it does not reproduce: another model type,
attention other than SDPA (eager attention computes its softmax differently), or modules
other than the plain ones this file computes (quantized linears, another model's norms);
those run the model's own forward. Compute threads only, one forward at a time per cache.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app.models.kv_cache import SlotKVCache
from app.models.token_buckets import padded_tokens, pads_tokens

log = logging.getLogger(__name__)

# Model types whose decoder layer is exactly: RMSNorm (float32, then weight x input dtype),
# attention (q/k/v/o linears, rotate-half RoPE, no norms inside but Qwen3's per-head query
# and key norms), residual, RMSNorm, SiLU-gated MLP, residual; embedding unscaled, final
# RMSNorm. Read against transformers' modeling_llama, modeling_mistral, modeling_qwen2 and
# modeling_qwen3 (5.x).
REPRODUCED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Model types whose attention also norms each query and key head (RMSNorm over the head's
# width) before its rotation: Qwen3, otherwise Qwen2 (modeling_qwen3).
HEAD_NORM_MODEL_TYPES = frozenset({"qwen3"})

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_HEAD_NORMS = {"q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


@dataclass(frozen=True, slots=True)
class _Norm:
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True, slots=True)
class _Layer:
    kind: str  # the layer type its mask is kept under ("full_attention", ...)
    attention_norm: _Norm
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_sizes: tuple[int, int, int]  # heads: query, key, value
    query_norm: _Norm | None  # each query head's (Qwen3), before its rotation
    key_norm: _Norm | None
    groups: int  # query heads per key/value head
    out_weight: torch.Tensor
    out_bias: torch.Tensor | None
    scaling: float
    mlp_norm: _Norm
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    intermediate: int
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


def _rms_norm(hidden: torch.Tensor, norm: _Norm) -> torch.Tensor:
    """LlamaRMSNorm's forward, op for op."""
    dtype = hidden.dtype
    wide = hidden.to(torch.float32)
    variance = wide.pow(2).mean(-1, keepdim=True)
    wide = wide * torch.rsqrt(variance + norm.eps)
    return norm.weight * wide.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def sdpa_takes_grouped_heads(device: torch.device) -> bool:
    """Whether attention hands grouped key/value heads to SDPA as they are (`enable_gqa`):
    on a CPU, whose fused kernel takes them under a mask (49 us a layer against 84 for the
    packed form, 32 decode rows of the tiny Qwen2, bf16; docs/BENCHMARKS.md Session 21).
    Not on CUDA, which serves `enable_gqa` with a mask only in its math kernel (float32
    scores of every row x head x query x key)."""
    return device.type == "cpu"


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    groups: int,
    grouped_in_sdpa: bool,
) -> torch.Tensor:
    """Scaled dot-product attention under `mask`, `groups` query heads per key/value head:
    as they are where `grouped_in_sdpa`, else as transformers' `sdpa_attention_forward`
    sends them under a mask: a decode query's heads as rows of their group, a prefill's keys
    and values repeated to the query's heads."""
    if groups == 1 or grouped_in_sdpa:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=groups > 1
        )
    rows, heads, length, width = query.shape
    if length == 1:
        query = query.reshape(rows, heads // groups, groups, width)
    else:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    return attended.reshape(rows, heads, length, values.shape[-1])


def _plain_linears(module: nn.Module, names: Sequence[str]) -> list[nn.Linear] | None:
    """The named children if each is exactly `nn.Linear` (a subclass, such as a quantized
    linear, computes something else)."""
    linears = [getattr(module, name, None) for name in names]
    if all(type(linear) is nn.Linear for linear in linears):
        return [linear for linear in linears if isinstance(linear, nn.Linear)]
    return None


def _fuse(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking the linears' outputs (all with a bias or none), the
    linears re-pointed at views of it."""
    biases = [linear.bias for linear in linears]
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        start = 0
        for linear in linears:
            end = start + linear.out_features
            linear.weight = nn.Parameter(weight[start:end], requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
            start = end
    return weight, bias


def _norm(module: Any) -> _Norm | None:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if not type(module).__name__.endswith("RMSNorm") or weight is None or eps is None:
        return None
    return _Norm(weight, float(eps))


def _head_dim(config: Any) -> int:
    heads = int(config.num_attention_heads)
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def _layer_refusal(layer: Any, head_dim: int, head_norms: bool) -> str | None:
    """Why the decoder layer is not one this file computes, or None; `head_norms`: its
    attention norms each query and key head (and has no other parts)."""
    if set(dict(layer.named_children())) != _LAYER_PARTS:
        return f"decoder layer parts {sorted(dict(layer.named_children()))}"
    attention, mlp = layer.self_attn, layer.mlp
    if set(dict(attention.named_children())) != _ATTENTION_PARTS | (
        _HEAD_NORMS if head_norms else set()
    ):
        return f"attention parts {sorted(dict(attention.named_children()))}"
    if set(dict(mlp.named_children())) != _MLP_PARTS:
        return f"MLP parts {sorted(dict(mlp.named_children()))}"
    if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
        return f"activation {type(mlp.act_fn).__name__}"
    projections = _plain_linears(attention, ("q_proj", "k_proj", "v_proj", "o_proj"))
    feeds = _plain_linears(mlp, ("gate_proj", "up_proj", "down_proj"))
    if projections is None or feeds is None:
        return "linears of another kind"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if head_norms:
        norms += [attention.q_norm, attention.k_norm]
    if any(_norm(norm) is None for norm in norms):
        return f"norms {[type(norm).__name__ for norm in norms]}"
    if getattr(attention, "head_dim", head_dim) != head_dim:
        return "per-layer head sizes"
    for group in (projections[:3], feeds[:2]):
        if len({linear.bias is None for linear in group}) > 1:
            return "projections with and without biases"
    return None


def _layer(layer: Any, kind: str, head_dim: int, head_norms: bool) -> _Layer:
    """The tensors of a layer `_layer_refusal` passed, its projections fused."""
    attention, mlp = layer.self_attn, layer.mlp
    query, key, value, out = attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    qkv_weight, qkv_bias = _fuse((query, key, value))
    gate_up_weight, gate_up_bias = _fuse((gate, up))
    attention_norm, mlp_norm = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
    assert attention_norm is not None and mlp_norm is not None  # `_layer_refusal` checked
    return _Layer(
        kind=kind,
        query_norm=_norm(attention.q_norm) if head_norms else None,
        key_norm=_norm(attention.k_norm) if head_norms else None,
        attention_norm=attention_norm,
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        qkv_sizes=(
            query.out_features // head_dim,
            key.out_features // head_dim,
            value.out_features // head_dim,
        ),
        groups=query.out_features // key.out_features,
        out_weight=out.weight,
        out_bias=out.bias,
        scaling=float(attention.scaling),
        mlp_norm=mlp_norm,
        gate_up_weight=gate_up_weight,
        gate_up_bias=gate_up_bias,
        intermediate=gate.out_features,
        down_weight=down.weight,
        down_bias=down.bias,
    )


class DirectDecoder:
    """The decoder's forward to its final norm's hidden states (the head is the runner's)."""

    def __init__(
        self,
        embedding: torch.Tensor,
        rotary: nn.Module,
        layers: Sequence[_Layer],
        norm: _Norm,
        head_dim: int,
    ) -> None:
        self._embedding = embedding
        self._rotary = rotary
        self._layers = tuple(layers)
        self._norm = norm
        self._head_dim = head_dim
        self.grouped_in_sdpa = sdpa_takes_grouped_heads(embedding.device)
        self.pads_tokens = pads_tokens(embedding.device)

    @classmethod
    def build(cls, model: Any, layer_kinds: Sequence[str]) -> DirectDecoder | None:
        """For a loaded `*ForCausalLM` of a reproduced type (its linears re-pointed at fused
        weights), else None, logged with the reason. `layer_kinds`: each layer's mask key.
        Call once, before any forward (the compute thread that loads the model)."""
        model_type = getattr(model.config, "model_type", "")
        reason = cls._refusal(model, model_type)
        if reason is not None:
            log.info("%s: the model's own forward (%s)", model_type, reason)
            return None
        base = model.base_model
        head_dim = _head_dim(model.config)
        layers = [
            _layer(layer, kind, head_dim, model_type in HEAD_NORM_MODEL_TYPES)
            for layer, kind in zip(base.layers, layer_kinds, strict=True)
        ]
        norm = _norm(base.norm)
        assert norm is not None  # `_refusal` checked
        log.info("%s: direct decoder forward", model_type)
        return cls(base.embed_tokens.weight, base.rotary_emb, layers, norm, head_dim)

    @staticmethod
    def _refusal(model: Any, model_type: str) -> str | None:
        """Why the model is not one this file computes, or None. Checks every layer before
        `build` fuses any: a refused model is left as it was loaded."""
        config = model.config
        if model_type not in REPRODUCED_MODEL_TYPES:
            return f"model type {model_type!r} not reproduced"
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return f"attention implementation {getattr(config, '_attn_implementation', None)}"
        if model_type == "mistral" and getattr(config, "layer_types", None) is not None:
            # Mistral's own code windows every layer whatever `layer_types` says; the masks
            # here follow `layer_types`.
            return "mistral with layer_types"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"activation {config.hidden_act}"
        base = model.base_model
        for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(base, part):
                return f"no {part}"
        if type(base.embed_tokens) is not nn.Embedding:
            return f"embedding {type(base.embed_tokens).__name__}"
        if _norm(base.norm) is None:
            return f"final norm {type(base.norm).__name__}"
        head_dim = _head_dim(config)
        for layer in base.layers:
            reason = _layer_refusal(layer, head_dim, model_type in HEAD_NORM_MODEL_TYPES)
            if reason is not None:
                return reason
        return None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        masks: Mapping[str, torch.Tensor],
        cache: SlotKVCache,
    ) -> torch.Tensor:
        """Hidden states (rows, query, width) after the final norm of `input_ids` (rows,
        query) at `positions`, each layer reading and writing its slots as `cache`'s plan
        says, attending under `masks[layer kind]`. Inside `inference_mode`.

        The linears run on the rows x query tokens flattened, where `pads_tokens` padded
        with zero rows to `padded_tokens`' bucket over the cache's slot count; attention,
        the cache and the result see the real tokens alone (a matrix product's output row
        is its input row's: the padding changes no real row's value)."""
        rows, query = input_ids.shape
        tokens = rows * query
        padded = padded_tokens(tokens, cache.shape.slots) if self.pads_tokens else tokens
        embedded = F.embedding(input_ids.reshape(tokens), self._embedding)
        cos, sin = self._rotary(embedded, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over the heads
        hidden = embedded if padded == tokens else F.pad(embedded, (0, 0, 0, padded - tokens))
        merged: torch.Tensor | None = None  # the padded attention output, its padding zero
        split = (rows, query, -1, self._head_dim)
        for layer, slots in zip(self._layers, cache.slot_layers, strict=True):
            normed = _rms_norm(hidden, layer.attention_norm)
            projected = F.linear(normed, layer.qkv_weight, layer.qkv_bias)
            heads = projected[:tokens].view(split).transpose(1, 2)  # (rows, heads, query, dim)
            query_heads, kv_heads = layer.qkv_sizes[0], layer.qkv_sizes[1]
            # The query and key heads are adjacent: one rotation for both (element by
            # element the same arithmetic as rotating each).
            rotating = heads[:, : query_heads + kv_heads]
            if layer.query_norm is not None and layer.key_norm is not None:
                # Qwen3: each query and key head normed over its width, then rotated.
                query_part = _rms_norm(rotating[:, :query_heads], layer.query_norm)
                key_part = _rms_norm(rotating[:, query_heads:], layer.key_norm)
                rotating = torch.cat((query_part, key_part), dim=1)
            rotated = rotating * cos + _rotate_half(rotating) * sin
            query_states, key_states = rotated[:, :query_heads], rotated[:, query_heads:]
            value_states = heads[:, query_heads + kv_heads :]
            keys, values = slots.update(key_states, value_states)
            attended = _attend(
                query_states,
                keys,
                values,
                masks[layer.kind],
                layer.scaling,
                layer.groups,
                self.grouped_in_sdpa,
            ).transpose(1, 2)  # (rows, query, heads, dim)
            if padded == tokens:
                merged = attended.reshape(tokens, -1)
            else:
                if merged is None:
                    merged = hidden.new_zeros(padded, attended.shape[2] * attended.shape[3])
                merged[:tokens].view(attended.shape).copy_(attended)
            hidden = hidden + F.linear(merged, layer.out_weight, layer.out_bias)
            normed = _rms_norm(hidden, layer.mlp_norm)
            gate_up = F.linear(normed, layer.gate_up_weight, layer.gate_up_bias)
            gate, up = gate_up[..., : layer.intermediate], gate_up[..., layer.intermediate :]
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
        return _rms_norm(hidden[:tokens], self._norm).view(rows, query, -1)
