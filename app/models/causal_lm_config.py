"""What a causal LM's config asks of the runner, read once at load: its EOS ids, attention
the slot cache cannot serve (refused by name), the scale its own forward puts on its logits,
and how many positions keep every row rotated alike. Pure (configs in, values out)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


def token_ids(value: object) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, (list, tuple)):
        return frozenset(int(v) for v in value)
    raise ValueError(f"unexpected token id setting {value!r}")


def refuse_unsupported_attention(name: str, config: Any) -> None:
    """Raise `ValueError` for attention the slot cache cannot serve, naming it, instead of
    an IndexError deep in warm-up: ALiBi (Bloom, MPT, Falcon with `alibi`) takes a 2-D mask
    where every step here passes a 4-D one, and Falcon's multi-query layout keeps one KV
    head where its config names every attention head."""
    model_type = getattr(config, "model_type", "")
    alibi = getattr(config, "alibi", False) or model_type in ("bloom", "mpt")
    if alibi:
        raise ValueError(f"{name}: ALiBi attention ({model_type}) is not served")
    multi_query = getattr(config, "multi_query", False)
    if (
        model_type == "falcon"
        and multi_query
        and not getattr(config, "new_decoder_architecture", False)
    ):
        raise ValueError(f"{name}: Falcon's multi-query attention is not served")


# What a model type's own forward does with a `logits_scaling` in its config: the Granite
# family divides its logits by it (MiniCPM3 its hidden states, before a head without bias:
# the same), HyperCLOVA X multiplies ("unlike GraniteConfig"). transformers' sources are
# checked against these (tests/unit/test_logits_scaling.py).
LOGITS_SCALING_DIVIDES = frozenset(
    {
        "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared",
        "granitemoehybrid", "minicpm3",
    }
)  # fmt: skip
LOGITS_SCALING_MULTIPLIES = frozenset({"hyperclovax"})


def logits_scaling_divides(name: str, config: Any) -> tuple[float, bool]:
    """The model's `logits_scaling` (1.0 without one) and whether its forward divides the
    head's output by it (else multiplies). A model type not known to do either, with one
    other than 1, is refused (`ValueError`): its logits' scale, which sampling reads, would
    be a guess."""
    scaling = float(getattr(config, "logits_scaling", None) or 1.0)
    model_type = getattr(config, "model_type", "")
    if scaling == 1.0 or model_type in LOGITS_SCALING_DIVIDES:
        return scaling, True
    if model_type in LOGITS_SCALING_MULTIPLIES:
        return scaling, False
    raise ValueError(
        f"{name}: logits_scaling {scaling} of model type {model_type!r}: not known to divide "
        "or multiply its logits, not served"
    )


def uniform_rope_positions(config: Any) -> int:
    """The most positions a batch may hold while every row is rotated alike: longrope and
    dynamic RoPE pick their frequencies from the longest position in the forward, so past
    the model's original context one long row would change every other row's tokens (Phi-3
    and 4 mini, MiniCPM3). Unbounded for any other RoPE."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    kinds: list[Mapping[str, Any]] = []
    if isinstance(parameters, Mapping):
        nested = [v for v in parameters.values() if isinstance(v, Mapping)]
        kinds = nested or [parameters]
    for kind in kinds:
        rope_type = kind.get("rope_type") or kind.get("type")
        if rope_type in ("longrope", "dynamic"):
            original = kind.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            if original:
                log.info(
                    "%s RoPE: sequences capped at its original %d positions", rope_type, original
                )
                return int(original)
    return 1 << 30
