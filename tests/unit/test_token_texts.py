"""Tokens named as OpenAI's log probabilities name them (`generation/token_texts.py`): a
byte-level BPE's token is its bytes in GPT-2's byte alphabet, a SentencePiece byte-fallback
token its byte and `▁` a space, an added token its content; bytes that are no text alone
are `bytes:` and escapes."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from app.generation.token_texts import TokenTexts, byte_level_alphabet, openai_token


def test_the_byte_alphabet_is_gpt2_s() -> None:
    assert byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}


def test_bytes_that_are_no_text_alone_are_named_by_their_escapes() -> None:
    assert openai_token(b" the") == " the"
    assert openai_token("é".encode()) == "é"
    assert openai_token(b"\xe2\x80") == "bytes:\\xe2\\x80"


def test_a_byte_level_bpe_s_tokens() -> None:
    vocab = {"Ġthe": 0, "Ã": 1, "©": 2, "a": 3}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|eos|>", special=True)])
    texts = TokenTexts(backend)
    assert texts.named(0) == (" the", b" the")
    assert texts.named(1) == ("bytes:\\xc3", b"\xc3")  # "é" is \xc3\xa9
    assert texts.named(2) == ("bytes:\\xa9", b"\xa9")
    assert texts.named(4) == ("<|eos|>", b"<|eos|>")


def test_a_sentencepiece_model_s_byte_fallback_and_spaces() -> None:
    vocab = [("<unk>", 0.0), ("▁the", -1.0), ("<0xE2>", -2.0), ("<0x80>", -2.0), ("x", -3.0)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    texts = TokenTexts(backend)
    assert texts.named(1) == (" the", b" the")  # the leading space kept, as OpenAI shows it
    assert texts.named(2) == ("bytes:\\xe2", b"\xe2")
    assert texts.named(4) == ("x", b"x")
    metaspace = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    metaspace.decoder = decoders.Metaspace()
    assert TokenTexts(metaspace).named(1) == (" the", b" the")
