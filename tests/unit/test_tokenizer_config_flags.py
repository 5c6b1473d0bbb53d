"""tokenizer_config.json's `add_bos_token` and `add_eos_token` where tokenizer.json's
post-processor disagrees (intfloat/e5-mistral-7b-instruct: `add_eos_token` true, a
post-processor adding `<s>` alone): an embedding model's texts get the flags' tokens, as
transformers 4 gave them (transformers 5 does when the flags are passed to it), so a
last-token-pooling model pools its `</s>`; a generate model's prompts stay as transformers 5
encodes them, by tokenizer.json alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from app.generation.tokenizer import GenerationTokenizer
from app.models.tokenizer import FastTokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "tail latency at p99", "hello world"]
TEXTS = ["hello world", "the lazy fox", "p99 tail latency"]
UNK, BOS, EOS = "<unk>", "<s>", "</s>"


def llama_style(directory: Path, flags: dict[str, bool]) -> Path:
    """A small Llama-style tokenizer (BPE over `▁`-marked words, ids 0-2 for <unk> <s> </s>)
    whose tokenizer.json post-processor adds `<s>` alone, and a tokenizer_config.json
    setting `flags`."""
    backend = Tokenizer(models.BPE(unk_token=UNK, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=[UNK, BOS, EOS])
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    # As transformers 5's LlamaTokenizer rebuilds it: one split, merges never cross a `▁`.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 1)]
    )
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "model_max_length": 64,
        **flags,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("flags", "reference_flags"),
    [
        # e5-mistral's: both set, the post-processor adds only <s>.
        ({"add_bos_token": True, "add_eos_token": True}, {}),
        # add_eos_token alone: <s> as the post-processor adds it (transformers 4's default).
        ({"add_eos_token": True}, {"add_bos_token": True}),
        # add_bos_token false over a post-processor adding <s> (Phi-3's files): neither.
        ({"add_bos_token": False}, {"add_eos_token": False}),
    ],
)
def test_an_embedders_texts_get_the_special_tokens_the_config_asks_for(
    tmp_path: Path, flags: dict[str, bool], reference_flags: dict[str, bool]
) -> None:
    directory = llama_style(tmp_path, flags)
    ours = FastTokenizer(directory, 64)
    reference = AutoTokenizer.from_pretrained(directory, **flags, **reference_flags)
    expected = reference(TEXTS)["input_ids"]
    assert ours.tokenize(TEXTS, truncate=False) == expected
    assert [ours.tokenize([text], truncate=False)[0] for text in TEXTS] == expected
    eos_id = reference.convert_tokens_to_ids(EOS)
    assert all((ids[-1] == eos_id) == flags.get("add_eos_token", False) for ids in expected)


def test_truncation_keeps_the_eos_the_config_adds(tmp_path: Path) -> None:
    directory = llama_style(tmp_path, {"add_bos_token": True, "add_eos_token": True})
    ours = FastTokenizer(directory, 8)
    reference = AutoTokenizer.from_pretrained(directory, add_bos_token=True, add_eos_token=True)
    long_text = " ".join(CORPUS * 3)
    expected = reference(long_text, truncation=True, max_length=8)["input_ids"]
    assert ours.tokenize([long_text], truncate=True)[0] == expected
    assert expected[-1] == reference.convert_tokens_to_ids(EOS) and len(expected) == 8


def test_the_rebuilt_post_processor_is_logged_and_agreeing_flags_change_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="app.models.tokenizer"):
        agreeing = FastTokenizer(llama_style(tmp_path, {"add_bos_token": True}), 64)
    assert caplog.records == []
    plain = AutoTokenizer.from_pretrained(tmp_path)  # transformers 5: tokenizer.json alone
    assert agreeing.tokenize(TEXTS, truncate=False) == plain(TEXTS)["input_ids"]
    (tmp_path / "eos").mkdir()
    with caplog.at_level(logging.WARNING, logger="app.models.tokenizer"):
        FastTokenizer(llama_style(tmp_path / "eos", {"add_eos_token": True}), 64)
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert f"{BOS}:0 $A:0 {EOS}:0" in caplog.records[0].getMessage()


def test_a_generate_models_prompts_stay_as_transformers_5_encodes_them(tmp_path: Path) -> None:
    """A prompt followed by `</s>` would end the sequence it asks to continue."""
    directory = llama_style(tmp_path, {"add_bos_token": True, "add_eos_token": True})
    ours = GenerationTokenizer(directory, 64)
    plain = AutoTokenizer.from_pretrained(directory)
    for text in TEXTS:
        assert ours.encode(text) == plain(text)["input_ids"]
        assert ours.encode(text)[-1] != plain.convert_tokens_to_ids(EOS)


def test_a_class_whose_tokenizer_ignored_the_flags_keeps_its_post_processor(
    tmp_path: Path,
) -> None:
    """transformers 4 honoured add_bos_token/add_eos_token in Llama-like fast tokenizers
    only; a model of any other class was trained on what its tokenizer.json adds."""
    directory = llama_style(tmp_path, {"add_bos_token": True, "add_eos_token": True})
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config))
    plain = AutoTokenizer.from_pretrained(directory)  # tokenizer.json alone
    assert FastTokenizer(directory, 64).tokenize(TEXTS, truncate=False) == plain(TEXTS)["input_ids"]
