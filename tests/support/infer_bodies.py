"""Bodies for POST /infer: well-formed ones and every kind of client mistake in reading and
parsing them, as (content type, body)."""

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
