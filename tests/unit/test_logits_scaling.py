"""Which way a causal LM's `logits_scaling` goes: the runner applies it to the head's output
itself (it runs base model + head, not the model's forward), and it was divided for every
model that had one, Granite's convention; HyperCLOVA X multiplies by it, so its logits were
scaling^2 times too small and every sample drawn far too hot. What each architecture's
forward does is read from transformers' own sources, so an upgrade that adds one fails here."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from app.models.causal_lm_config import (
    LOGITS_SCALING_DIVIDES,
    LOGITS_SCALING_MULTIPLIES,
    logits_scaling_divides,
)


@pytest.mark.parametrize(
    "model_type,scaling,expected",
    [
        ("granite", 8.0, (8.0, True)),
        ("granitemoehybrid", 4.0, (4.0, True)),
        ("minicpm3", 10.0, (10.0, True)),
        ("hyperclovax", 8.0, (8.0, False)),
        ("llama", None, (1.0, True)),  # none: nothing to apply
        ("some_new_model", 1.0, (1.0, True)),
    ],
)
def test_the_direction_is_the_model_types(
    model_type: str, scaling: float | None, expected: tuple[float, bool]
) -> None:
    config = SimpleNamespace(model_type=model_type, logits_scaling=scaling)
    assert logits_scaling_divides("m", config) == expected


def test_an_unknown_model_type_with_a_scaling_is_refused() -> None:
    config = SimpleNamespace(model_type="some_new_model", logits_scaling=8.0)
    with pytest.raises(ValueError, match=r"'some_new_model'.*not served"):
        logits_scaling_divides("m", config)


# `logits / self.config.logits_scaling`, `hidden_states / ...`, `... * self.config...`
USE = re.compile(r"([*/])\s*self\.config(\.text_config)?\.logits_scaling\b")


def test_the_tables_match_what_each_causal_lms_forward_does() -> None:
    models = Path(transformers.__file__).parent / "models"
    divides, multiplies = set(), set()
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        folder = models / model_type_to_module_name(model_type)
        uses = {
            (match.group(1), match.group(2))
            for path in sorted(folder.glob("modeling_*.py"))
            for match in USE.finditer(path.read_text())
        }
        assert all(text is None for _, text in uses), f"{model_type}: a text config's scaling"
        operators = {operator for operator, _ in uses}
        assert len(operators) <= 1, f"{model_type} both multiplies and divides"
        if "/" in operators:
            divides.add(model_type)
        if "*" in operators:
            multiplies.add(model_type)
    assert "granite" in divides and "hyperclovax" in multiplies  # the scan finds them
    assert divides == LOGITS_SCALING_DIVIDES
    assert multiplies == LOGITS_SCALING_MULTIPLIES
