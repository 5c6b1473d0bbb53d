"""The pooling a model was trained with, read from its files, and the poolers themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.models.pooling import cls_pool, last_token_pool, mean_pool, pooling_mode

HIDDEN = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [9.0, 9.0]], [[2.0, 2.0], [4.0, 6.0], [6.0, 4.0]]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the first row right-padded by one


def sentence_transformers_files(directory: Path, *after: str, **modes: bool) -> Path:
    """A model's modules.json with its Pooling module turning on `modes`, then the module
    types `after` it (sentence_transformers.models.<type>)."""
    kinds = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": kinds + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": kinds + "Pooling"},
    ]
    modules += [
        {"idx": 2 + i, "name": str(2 + i), "path": f"{2 + i}_{kind}", "type": kinds + kind}
        for i, kind in enumerate(after)
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return directory


def test_poolers_keep_only_real_tokens() -> None:
    assert mean_pool(HIDDEN, MASK).tolist() == [[2.0, 1.0], [4.0, 4.0]]
    assert cls_pool(HIDDEN, MASK).tolist() == [[1.0, 0.0], [2.0, 2.0]]
    assert last_token_pool(HIDDEN, MASK).tolist() == [[3.0, 2.0], [6.0, 4.0]]


@pytest.mark.parametrize(
    "key", ["pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken"]
)
def test_the_models_own_pooling_is_read(tmp_path: Path, key: str) -> None:
    files = sentence_transformers_files(tmp_path, **{key: True, "pooling_mode_max_tokens": False})
    assert pooling_mode(files) == key


def test_a_model_that_says_nothing_is_mean_pooled(tmp_path: Path) -> None:
    assert pooling_mode(tmp_path) == "pooling_mode_mean_tokens"


@pytest.mark.parametrize(
    "modes",
    [
        {"pooling_mode_max_tokens": True},
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
        {},
    ],
)
def test_a_pooling_not_served_is_refused_at_load(tmp_path: Path, modes: dict[str, bool]) -> None:
    with pytest.raises(ValueError, match="is not served"):
        pooling_mode(sentence_transformers_files(tmp_path, **modes))


def test_normalisation_after_pooling_is_served(tmp_path: Path) -> None:
    files = sentence_transformers_files(tmp_path, "Normalize", pooling_mode_mean_tokens=True)
    assert pooling_mode(files) == "pooling_mode_mean_tokens"


@pytest.mark.parametrize("module", ["Dense", "LayerNorm"])
def test_a_module_after_pooling_that_is_not_applied_is_refused_at_load(
    tmp_path: Path, module: str
) -> None:
    """A Dense projection (distiluse 768 -> 512, LaBSE) was skipped without a word: the
    vectors served were the pooled encoder's, of another width than the model's."""
    files = sentence_transformers_files(tmp_path, module, pooling_mode_mean_tokens=True)
    with pytest.raises(ValueError, match=f"{module}' is not served"):
        pooling_mode(files)
