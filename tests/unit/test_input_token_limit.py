"""The longest input a model takes, from its files alone (`input_token_limit`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.models.tokenizer import input_token_limit


def model_files(directory: Path, **config: object) -> Path:
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_bert_takes_all_its_positions(tmp_path: Path) -> None:
    files = model_files(tmp_path, model_type="bert", max_position_embeddings=512)
    assert input_token_limit(files, 1024, None) == 512


@pytest.mark.parametrize(
    "model_type,pad,usable", [("roberta", 1, 512), ("xlm-roberta", 1, 512), ("mpnet", 1, 512)]
)
def test_roberta_family_loses_the_positions_before_padding(
    tmp_path: Path, model_type: str, pad: int, usable: int
) -> None:
    """Their position ids start at pad_token_id + 1: a 513-token input indexed past the
    table (IndexError on the CPU, a device assert on CUDA, for the whole batch)."""
    files = model_files(
        tmp_path, model_type=model_type, max_position_embeddings=514, pad_token_id=pad
    )
    assert input_token_limit(files, 1024, None) == usable


def test_the_smallest_limit_wins(tmp_path: Path) -> None:
    files = model_files(tmp_path, model_type="bert", max_position_embeddings=512)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    assert input_token_limit(files, 1024, None) == 256
    assert input_token_limit(files, 128, None) == 128
    assert input_token_limit(files, 1024, 64) == 64
