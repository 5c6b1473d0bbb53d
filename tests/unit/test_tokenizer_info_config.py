"""What the tokenizer routes (`api/tokenize.py`) make of a tokenizer's files and of a model
without a tokenizer: /tokenizer_info's configuration (special tokens kept only in
special_tokens_map.json, no path-like keys) and the wrong-task refusal's wording."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from app.api import tokenize
from app.api.errors_doc import ERRORS
from app.generation.chat import tokenizer_configuration
from app.models.tokenizer import FastTokenizer
from app.service import Service, WrongTask


def _info(directory: Path) -> dict[str, Any]:
    tokenizer = cast(FastTokenizer, SimpleNamespace(directory=directory))
    return tokenize._info(tokenizer, 512)


def _write(directory: Path, config: dict[str, Any], special: dict[str, Any] | None) -> Path:
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if special is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(special))
    return directory


def test_special_tokens_only_in_the_map_are_answered_the_config_s_winning(tmp_path: Path) -> None:
    directory = _write(
        tmp_path / "legacy",
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<cfg>", "pad_token": None},
        {
            "bos_token": "<map>",
            "eos_token": {"content": "</s>", "lstrip": False},
            "pad_token": "<pad>",
            "additional_special_tokens": [{"content": "<x>"}, "<y>"],
        },
    )
    info = _info(directory)
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<cfg>"
    assert info["pad_token"] == "<pad>" and info["unk_token"] is None
    assert info["additional_special_tokens"] == ["<x>", "<y>"]
    assert tokenizer_configuration(directory)["bos_token"] == "<cfg>"  # the chat template's


def test_path_like_keys_are_left_out(tmp_path: Path) -> None:
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "name_or_path": "/home/someone/models/tiny",
        "tokenizer_file": "/home/someone/.cache/tokenizer.json",
        "special_tokens_map_file": "/home/someone/models/tiny/special_tokens_map.json",
        "auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]},
        "added_tokens_decoder": {"0": {"content": "<s>"}},
        "model_max_length": 2048,
        "eos_token": "</s>",
    }
    info = _info(_write(tmp_path / "old", config, None))
    assert not set(info) & tokenize._LEFT_OUT_KEYS
    assert "/home/someone" not in json.dumps(info)
    assert info["tokenizer_class"] == "GPT2Tokenizer" and info["eos_token"] == "</s>"
    assert info["model_max_length"] == 512  # the context served


class Tensor:
    """What `_tokenizer` reads of a `Service` serving a tensor model."""

    def __init__(self) -> None:
        self.tokenizers: dict[str, object] = {}

    def model_task(self, name: str) -> str:
        return "tensor"


def test_a_model_without_a_tokenizer_is_named_plainly() -> None:
    with pytest.raises(WrongTask) as refused:
        tokenize._tokenizer(cast(Service, Tensor()), "net")
    assert str(refused.value) == "model 'net' does 'tensor', not 'embed' or 'generate'"
    assert (
        str(WrongTask("tiny", "generate", "embed")) == "model 'tiny' does 'generate', not 'embed'"
    )


def test_the_detokenize_cap_is_documented() -> None:
    assert f"{tokenize.MAX_DETOKENIZE_IDS:,} token ids" in str(ERRORS[413]["description"])
