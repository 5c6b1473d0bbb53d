"""Which model the tokenizer routes serve when `model` is left out (`api/tokenize.py`):
STEADY_DEFAULT_MODEL where it is set, else the one generate model served, else (no generate
model) the one model with a tokenizer, else a 400 naming the models (lm-eval-harness probes
/tokenizer_info without a model)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from app.api.tokenize import chosen_model
from app.generation.errors import ModelNotChosen
from app.model_specs import ModelSpec, TensorSpec
from app.service import Service, UnknownModel
from app.settings import Settings


class Served:
    """What `chosen_model` reads of a `Service`: its settings' models."""

    def __init__(self, *models: ModelSpec, default: str | None = None) -> None:
        self.settings = Settings(models=models, default_model=default, spike_reports=False)

    def model_names(self) -> list[str]:
        return [spec.name for spec in self.settings.models]

    def model_task(self, name: str) -> str:
        return next(spec.task for spec in self.settings.models if spec.name == name)

    def resolve_model(self, name: str | None) -> str:
        return Service.resolve_model(cast(Any, self), name)


EMBED = ModelSpec(name="minilm")
TINY = ModelSpec(name="tiny", task="generate", source="/models/tiny")
PLAIN = ModelSpec(name="plain", task="generate", source="/models/plain")


def test_the_one_generate_model_is_chosen_whatever_the_default() -> None:
    assert chosen_model(cast(Service, Served(EMBED, TINY)), None) == "tiny"
    assert chosen_model(cast(Service, Served(EMBED, TINY)), "") == "tiny"
    assert chosen_model(cast(Service, Served(EMBED, TINY)), "minilm") == "minilm"


def test_a_configured_default_is_chosen() -> None:
    served = Served(TINY, PLAIN, EMBED, default="plain")
    assert chosen_model(cast(Service, served), None) == "plain"


def test_without_a_generate_model_the_one_model_with_a_tokenizer_is_chosen() -> None:
    """An embedding-only server answers /tokenize without `model` (the schemathesis run
    found a 400 to a request its OpenAPI document called valid)."""
    assert chosen_model(cast(Service, Served(EMBED)), None) == "minilm"


@pytest.mark.parametrize(
    ("models", "named"),
    [
        ((TINY, PLAIN, EMBED), "tiny, plain, minilm"),
        ((EMBED, ModelSpec(name="other")), "minilm, other"),
    ],
)
def test_no_single_candidate_is_a_refusal_naming_them(
    models: tuple[ModelSpec, ...], named: str
) -> None:
    with pytest.raises(ModelNotChosen, match=f"could serve \\({named}\\)"):
        chosen_model(cast(Service, Served(*models)), None)


def test_an_unknown_model_is_unknown() -> None:
    with pytest.raises(UnknownModel):
        chosen_model(cast(Service, Served(TINY)), "gpt-17")


def test_no_model_with_a_tokenizer_is_said_so() -> None:
    """A server of tensor models only: the message named "several models ... (none)"."""
    x, y = (TensorSpec(name=name, datatype="FP32", shape=(-1, 2)) for name in "xy")
    tensor = ModelSpec(name="t", task="tensor", source="/models/t.pt2", inputs=(x,), outputs=(y,))
    with pytest.raises(ModelNotChosen, match=r"^no served model has a tokenizer$"):
        chosen_model(cast(Service, Served(tensor)), None)
