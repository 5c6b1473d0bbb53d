"""The v2 bench's requests are what the server parses: one row, binary or JSON."""

from __future__ import annotations

import numpy as np

from app.api.v2_codec import parse_infer_request
from app.tensors import from_bytes, from_json
from loadtest.httpclient import Target
from loadtest.v2_bench import binary_request, json_request

TARGET = Target.parse("http://127.0.0.1:8000/v2/models/bench_mlp/infer")


def split(request: bytes) -> tuple[dict[str, str], bytes]:
    head, body = request.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")[1:]
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    assert int(headers["content-length"]) == len(body)
    return headers, body


def test_binary_and_json_requests_carry_the_same_row() -> None:
    row = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    headers, body = split(binary_request(TARGET, row))
    parsed = parse_infer_request(body, int(headers["inference-header-content-length"]))
    (tensor,) = parsed.inputs
    assert tensor.shape == (1, 16) and parsed.binary_by_default
    assert tensor.raw is not None
    np.testing.assert_array_equal(from_bytes("FP32", tensor.shape, tensor.raw)[0], row)
    headers, body = split(json_request(TARGET, row))
    assert "inference-header-content-length" not in headers
    (as_json,) = parse_infer_request(body, None).inputs
    assert from_json("FP32", as_json.shape, as_json.data) == row.tobytes()
