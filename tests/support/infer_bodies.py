"""Bodies for POST /infer and /v1/embeddings: well-formed ones and every kind of client
mistake in reading and parsing them, as (content type, body)."""

from __future__ import annotations

import json

JSON = "application/json"
REQUESTS: list[tuple[str, bytes]] = [
    (JSON, b'{"inputs": "one sentence"}'),
    (JSON, b'{"inputs": ["two", "sentences"], "parameters": {"normalize": false}}'),
    ("application/json; charset=utf-8", b'{"inputs": "with a charset"}'),
    ("application/vnd.steady+json", b'{"inputs": "a +json type"}'),
    (JSON, b'{"inputs": '),  # JSON that does not parse
    (JSON, b""),  # no body
    (JSON, b"\x6a\xff\x02\xe9"),  # not UTF-8 at all
    (JSON, b"[" * 100_000),  # nested too deep to parse
    ("text/plain", b'{"inputs": "the right JSON, the wrong type"}'),
    (JSON, b"{}"),
    (JSON, b'{"inputs": 5}'),
    (JSON, b'{"inputs": "x", "model": "no-such-model"}'),
    (JSON, b'{"inputs": "x", "unexpected": 1}'),
    (JSON, json.dumps({"inputs": ["x"] * 1000}).encode()),  # over the input-count limit
    (JSON, b"[1, 2]"),
]

# The same for POST /v1/embeddings (OpenAI's field names and options).
EMBEDDINGS_REQUESTS: list[tuple[str, bytes]] = [
    (JSON, b'{"input": "one sentence"}'),
    (JSON, b'{"input": ["two", "sentences"], "model": null, "user": "u"}'),
    ("application/json; charset=utf-8", b'{"input": "with a charset"}'),
    ("application/vnd.steady+json", b'{"input": "a +json type"}'),
    (JSON, b'{"input": "as base64", "encoding_format": "base64"}'),
    (JSON, b'{"input": "x", "encoding_format": "hex"}'),
    (JSON, b'{"input": "x", "dimensions": 384}'),
    (JSON, b'{"input": "x", "dimensions": 7}'),
    (JSON, b'{"input": "x", "dimensions": 0}'),
    (JSON, b'{"input": "x", "dimensions": "many"}'),
    (JSON, b'{"input": '),  # JSON that does not parse
    (JSON, b""),  # no body
    (JSON, b"null"),
    (JSON, b"\x6a\xff\x02\xe9"),  # not UTF-8 at all
    (JSON, b"[" * 100_000),  # nested too deep to parse
    ("text/plain", b'{"input": "the right JSON, the wrong type"}'),
    (JSON, b"{}"),
    (JSON, b'{"input": 5}'),
    (JSON, b'{"input": ""}'),
    (JSON, b'{"input": []}'),
    (JSON, b'{"input": [1, 2]}'),  # token arrays: refused
    (JSON, b'{"input": "x", "model": 3}'),
    (JSON, b'{"input": "x", "model": "no-such-model"}'),
    (JSON, b'{"input": "x", "unexpected": 1}'),
    (JSON, json.dumps({"input": ["x"] * 1000}).encode()),  # over the input-count limit
    (JSON, b"[1, 2]"),
]
