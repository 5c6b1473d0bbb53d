"""The generation tests' tiny model loads offline the ways the server and tests load it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.models.tokenizer import load_tokenizer
from loadtest.tiny_causal_lm import build_tiny_causal_lm


def test_loads_with_transformers_and_generates_varied_tokens(tiny_causal_lm: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_causal_lm)
    model = AutoModelForCausalLM.from_pretrained(tiny_causal_lm).eval()
    encoded = tokenizer("Hello world", return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**encoded, max_new_tokens=16, do_sample=False)
    continuation = output[0, encoded["input_ids"].shape[1] :].tolist()
    assert len(set(continuation)) > 4, continuation
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id is not None
    assert encoded["input_ids"][0, 0].item() == tokenizer.bos_token_id


def test_steadyserve_tokenizer_matches_transformers(tiny_causal_lm: Path) -> None:
    ours = load_tokenizer(str(tiny_causal_lm), 512, None)
    theirs = AutoTokenizer.from_pretrained(tiny_causal_lm)
    texts = ["Hello world", "Continuous batching over a preallocated cache."]
    assert ours.tokenize(texts, truncate=False) == [theirs(t)["input_ids"] for t in texts]
    assert ours.pad_token_id == theirs.pad_token_id


def test_chat_template_present_or_absent(
    tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path
) -> None:
    chat = AutoTokenizer.from_pretrained(tiny_causal_lm)
    text = chat.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>hi<|eos|><|assistant|>"
    assert AutoTokenizer.from_pretrained(tiny_causal_lm_without_chat_template).chat_template is None


def test_build_is_deterministic(tiny_causal_lm: Path, tmp_path: Path) -> None:
    again = build_tiny_causal_lm(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_causal_lm / name).read_bytes(), name
