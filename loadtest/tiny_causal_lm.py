"""A tiny random-weight causal LM built on the fly, for generation tests and benchmarks.

`build_tiny_causal_lm(directory)` trains a small byte-level BPE tokenizer on an in-code
corpus with `tokenizers`, makes a two-layer Qwen2 model (hidden 64) with a large
`initializer_range` so greedy continuations vary instead of repeating one token, and saves
both with `save_pretrained`: the directory loads offline with `AutoTokenizer` /
`AutoModelForCausalLM.from_pretrained` and with steadyserve's `FastTokenizer`. Everything is
seeded: the same call builds the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SEED = 1234
VOCAB_SIZE = 384
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
MAX_POSITIONS = 512

# A ChatML-like template: each message on its role token, closed by EOS; the generation
# prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|eos|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tail latency is the slowest requests' share of the experience.",
    "Continuous batching lets sequences join and leave between decode steps.",
    "A key value cache keeps the attention state of every token already seen.",
    "Preallocate the buffers at start-up so a request never waits for memory.",
    "Hello world! How are you today? I am fine, thank you.",
    "Once upon a time there was a small model that generated tokens one by one.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024.",
    "Servers answer 429 with Retry-After when the queue is full.",
    "steadyserve keeps p99 flat under load by refusing work it cannot finish in time.",
]


# Qwen2's own pre-tokenization: transformers 5 loads a Qwen2 model's tokenizer as
# `Qwen2Tokenizer`, which applies this split and NFC whatever tokenizer.json says; the file
# must say the same, or steadyserve (which reads tokenizer.json) tokenizes digits differently.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE over the corpus with Qwen2's pre-tokenization, BOS prepended to
    every encoding."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS, *CHAT_ROLES],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build_tiny_causal_lm(
    directory: Path, chat_template: bool = True, hidden_size: int = 64, layers: int = 2
) -> Path:
    """Write the tiny model and its tokenizer to `directory` (created) and return it.
    `chat_template` false leaves the template out (for the front end's no-template path);
    `hidden_size` and `layers` make a larger one (benchmarks: where compute, not Python
    overhead, dominates a step)."""
    directory.mkdir(parents=True, exist_ok=True)
    backend = train_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.save_pretrained(directory)
    if chat_template:
        # In tokenizer_config.json, where front ends look for it (transformers 5 would
        # otherwise write a separate chat_template.jinja; it reads either).
        config_path = directory / "tokenizer_config.json"
        tokenizer_config = json.loads(config_path.read_text())
        tokenizer_config["chat_template"] = CHAT_TEMPLATE
        config_path.write_text(json.dumps(tokenizer_config, indent=2))

    torch.manual_seed(SEED)
    config = Qwen2Config(
        vocab_size=backend.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.3,
        bos_token_id=backend.token_to_id(BOS),
        eos_token_id=backend.token_to_id(EOS),
        pad_token_id=backend.token_to_id(PAD),
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(directory)
    return directory
