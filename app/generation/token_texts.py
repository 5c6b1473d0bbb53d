"""Each token of a tokenizer as OpenAI's log probabilities name it: its bytes (chat's
`bytes`: the UTF-8 a token adds to the text, which may be part of a character) and its text
(`token`, completions' `tokens` and `top_logprobs` keys): the bytes as UTF-8, or, for bytes
that are no text alone, `bytes:` and their escapes (`bytes:\\xe2\\x80`), as OpenAI writes it.

Read from tokenizer.json's vocabulary and decoder: a byte-level BPE's token is its bytes
spelled in GPT-2's byte alphabet; a SentencePiece model's `<0xE2>` byte-fallback token is
that byte, and its `▁` a space; an added token (a special one included) is its content; a
token of any other tokenizer is what decoding it alone gives. The leading space a token
carries is kept (" the"), as OpenAI shows it. Torch-free; thread-safe (a cache filled on use).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, reversed: the character each byte is spelled as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelled = {byte: byte for byte in printable}
    for byte in range(256):
        if byte not in spelled:
            spelled[byte] = 256 + len(spelled) - len(printable)
    return {chr(character): byte for byte, character in spelled.items()}


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for child in decoder.get("decoders", []) for step in _decoder_steps(child)]
    return [decoder]


def openai_token(raw: bytes) -> str:
    """A token's text as OpenAI names it: its UTF-8, else `bytes:` and escapes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


class TokenTexts:
    def __init__(self, backend: Tokenizer) -> None:
        self._backend = backend
        steps = _decoder_steps(
            json.loads(backend.decoder.__getstate__()) if backend.decoder else None
        )
        kinds = {step.get("type") for step in steps}
        self._byte_level = byte_level_alphabet() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        self._spaces: list[str] = [
            step["replacement"] for step in steps if step.get("type") == "Metaspace"
        ]
        self._spaces += [
            step["pattern"]["String"]
            for step in steps
            if step.get("type") == "Replace"
            and step.get("content") == " "
            and "String" in step.get("pattern", {})
        ]
        self._added = {
            int(token_id): token.content
            for token_id, token in backend.get_added_tokens_decoder().items()
        }
        self._cache: dict[int, tuple[str, bytes]] = {}

    def named(self, token_id: int) -> tuple[str, bytes]:
        """The token's text as OpenAI names it, and its bytes."""
        known = self._cache.get(token_id)
        if known is None:
            raw = self._bytes(token_id)
            known = self._cache[token_id] = (openai_token(raw), raw)
        return known

    def _bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._backend.id_to_token(token_id)
        if piece is None:  # outside the vocabulary: what decoding gives
            return self._backend.decode([token_id], skip_special_tokens=False).encode()
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if self._byte_fallback and (byte := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        if self._spaces:
            for space in self._spaces:
                piece = piece.replace(space, " ")
            return piece.encode()
        return self._backend.decode([token_id], skip_special_tokens=False).encode()
