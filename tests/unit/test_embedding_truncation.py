"""An embedding input with `truncate` keeps the first tokens the whole text has, however few
of its characters those are: the character cap (32 a token of the limit) cut it before it
was tokenized, so 20,000 spaces then "hello" (3 BERT tokens) lost its "hello". The text is
cut where a word ends and read further only while it holds fewer tokens than the limit."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from app.embedding_service import truncated_token_ids
from app.engine.protocol import EmbedPayload
from app.models.tokenizer import FastTokenizer
from app.service import MAX_CHARS_PER_TOKEN
from tests.support.edge import front_end

LIMIT = 8
MAX_CHARS = LIMIT * MAX_CHARS_PER_TOKEN
WORDS = ["hello", "world", "tail", "latency", "p99", "quick", "brown", "fox", "naïve", "über"]
CORPUS = [" ".join(WORDS), "hello, world! tail latency: p99.", "the quick brown fox"] * 4
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def wordpiece(directory: Path) -> FastTokenizer:
    """BERT's pipeline: lower-casing normalizer, whitespace and punctuation split, [CLS] and
    [SEP] around each text, words over 100 characters one [UNK]."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.train_from_iterator(
        CORPUS, trainer=trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIALS)
    )
    backend.post_processor = processors.BertProcessing(
        ("[SEP]", backend.token_to_id("[SEP]")), ("[CLS]", backend.token_to_id("[CLS]"))
    )
    return saved(backend, directory / "wordpiece")


def byte_level(directory: Path) -> FastTokenizer:
    """GPT-2's pipeline: a space starts the word after it, whitespace runs are tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    return saved(backend, directory / "byte-level")


def metaspace(directory: Path) -> FastTokenizer:
    """SentencePiece's pipeline as Llama's tokenizer.json has it: spaces become `▁`, one
    split (BPE over the whole text), <s> before and </s> after each text."""
    backend = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return saved(backend, directory / "metaspace")


def saved(backend: Tokenizer, directory: Path) -> FastTokenizer:
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    return FastTokenizer(directory, LIMIT)


def random_text(rng: random.Random) -> str:
    """Words, punctuation and runs of whitespace (some thousands of characters long), so
    that the first `MAX_CHARS` characters hold from none to many more tokens than `LIMIT`."""
    pieces = [
        lambda: rng.choice(WORDS),
        lambda: rng.choice([",", ".", "!", "'s", "-"]),
        lambda: " " * rng.choice([1, 1, 1, 2, 3, 50, 400, 3000]),
        lambda: rng.choice(["\n", "\t", " \n ", "\n\n  ", "\u3000", "\x1c"]),
        lambda: "x" * rng.choice([99, 100, 101, 700]),
    ]
    return "".join(rng.choice(pieces)() for _ in range(rng.randint(0, 40)))


@pytest.mark.parametrize("build", [wordpiece, byte_level, metaspace])
def test_truncating_equals_cutting_the_whole_texts_tokens(
    tmp_path: Path, build: Callable[[Path], FastTokenizer]
) -> None:
    tokenizer = build(tmp_path)
    rng = random.Random(7)
    texts = [random_text(rng) for _ in range(400)]
    texts += [" " * 20_000 + "hello", "hello" + " " * 20_000 + "world", "x" * 5000 + " hello"]
    texts += ["你好世界" * 2000, "x" * 200 + "\t" + "über" * 100 + " hello"]
    assert any(len(text) > 4 * MAX_CHARS for text in texts)
    for text in texts:
        whole = tokenizer.tokenize([text], truncate=True)
        assert truncated_token_ids(tokenizer, [text], MAX_CHARS) == whole, repr(text)
    # Several texts at once: each its own.
    assert truncated_token_ids(tokenizer, texts[:50], MAX_CHARS) == tokenizer.tokenize(
        texts[:50], truncate=True
    )


class Counting:
    """A tokenizer that counts the characters it is given."""

    def __init__(self, tokenizer: FastTokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_input_tokens = tokenizer.max_input_tokens
        self.pad_token_id = tokenizer.pad_token_id
        self.read = 0

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        self.read += sum(len(text) for text in texts)
        return self.tokenizer.tokenize(texts, truncate)


def test_a_long_text_costs_a_pass_over_its_first_part_unless_its_tokens_are_sparse(
    tmp_path: Path,
) -> None:
    counting = Counting(wordpiece(tmp_path))
    dense = "hello world " * 100_000  # 1.2 MB
    truncated_token_ids(counting, [dense], MAX_CHARS)
    assert counting.read <= MAX_CHARS
    counting.read = 0
    # Written without spaces, dense in tokens: cut where the cap falls, not read whole.
    truncated_token_ids(counting, ["你好世界" * 100_000], MAX_CHARS)
    assert counting.read <= MAX_CHARS
    counting.read = 0
    sparse = " " * 1_000_000 + "hello"
    expected = counting.tokenizer.tokenize(["hello"], truncate=False)  # [CLS] hello [SEP]
    assert truncated_token_ids(counting, [sparse], MAX_CHARS) == expected
    assert counting.read <= 7 * len(sparse) // 3 + 20


async def test_the_route_embeds_the_first_tokens_of_a_text_of_sparse_tokens(
    tmp_path: Path,
) -> None:
    """Cut at 256 characters before tokenizing, the text was 1,000 spaces: [CLS] [SEP]."""
    embedder = wordpiece(tmp_path)
    text = " " * 1000 + "hello world"
    expected = embedder.tokenize([text], truncate=True)
    assert len(expected[0]) == 4  # [CLS] hello world [SEP]
    async with front_end(tmp_path, embedder=embedder) as (client, _, engine):
        await client.post(
            "/infer", json={"model": "minilm", "inputs": text, "parameters": {"truncate": True}}
        )
        # Without truncate (OpenAI's route has none), a text over the cap is still refused
        # before it is tokenized, whatever its tokens.
        refused = await client.post("/v1/embeddings", json={"model": "minilm", "input": text})
    assert [submit.payload for submit in engine.submitted] == [EmbedPayload(expected)]
    assert refused.status_code == 413 and "1011 characters" in refused.text, refused.text
