"""The v2 request and response bodies, binary tensor data extension included (pure), and
that the front end that speaks them stays torch-free."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from tritonclient.http import InferResult

from app.api.v2_codec import (
    OutputTensor,
    V2Error,
    encode_response,
    parse_infer_request,
    split_bytes_elements,
)
from tests.support.server import REPO_ROOT


def binary_body(header: dict[str, object], *blobs: bytes) -> tuple[bytes, int]:
    encoded = json.dumps(header).encode()
    return encoded + b"".join(blobs), len(encoded)


def test_json_inputs_outputs_and_parameters_are_parsed() -> None:
    body = json.dumps(
        {
            "id": "r1",
            "parameters": {"binary_data_output": True, "timeout": 5000},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}],
            "outputs": [{"name": "y", "parameters": {"binary_data": False}}, {"name": "z"}],
        }
    ).encode()
    request = parse_infer_request(body, None)
    assert request.id == "r1"
    (tensor,) = request.inputs
    assert (tensor.name, tensor.datatype, tensor.shape) == ("x", "FP32", (1, 2))
    assert tensor.raw is None and tensor.data == [1.0, 2.0]
    assert request.wants_binary("y") is False  # its own parameter wins
    assert request.wants_binary("z") is True  # the request's default
    assert request.parameters["timeout"] == 5000


def test_binary_inputs_are_cut_from_the_body_in_input_order() -> None:
    first = np.arange(4, dtype="<f4").tobytes()
    second = np.arange(3, dtype="<i8").tobytes()
    body, length = binary_body(
        {
            "inputs": [
                {
                    "name": "a",
                    "datatype": "FP32",
                    "shape": [4],
                    "parameters": {"binary_data_size": 16},
                },
                {"name": "j", "datatype": "FP32", "shape": [1], "data": [7.0]},
                {
                    "name": "b",
                    "datatype": "INT64",
                    "shape": [3],
                    "parameters": {"binary_data_size": 24},
                },
            ]
        },
        first,
        second,
    )
    a, j, b = parse_infer_request(body, length).inputs
    assert a.raw == first and b.raw == second and j.raw is None and j.data == [7.0]


X = '{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}'
MALFORMED = {
    "not json": (b"{not json", None, "malformed"),
    "not an object": (b"[]", None, "JSON object"),
    "no inputs": (b'{"inputs": []}', None, "non-empty"),
    "no data": (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}', None, "neither"),
    "too many dims": (
        f'{{"inputs": [{X.replace("[1],", str([1] * 65) + ",")}]}}'.encode(),
        None,
        "65 dimensions (at most 64)",
    ),
    "negative dim": (f'{{"inputs": [{X.replace("[1],", "[-1],")}]}}'.encode(), None, "shape"),
    "duplicate": (f'{{"inputs": [{X}, {X}]}}'.encode(), None, "twice"),
    "id": (f'{{"id": 5, "inputs": [{X}]}}'.encode(), None, "id"),
    "header length": (b"{}", 10, "exceeds"),
    "outputs not a list": (f'{{"inputs": [{X}], "outputs": 5}}'.encode(), None, "outputs"),
    # Triton's top-k classification and shared memory: the whole tensor came back instead.
    "classification": (
        f'{{"inputs": [{X}], "outputs": [{{"name": "y", "parameters": '
        '{"classification": 2}}]}'.encode(),
        None,
        "['classification'] are not supported",
    ),
    "shared memory input": (
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], '
        b'"parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}]}',
        None,
        "shared-memory inputs are not supported",
    ),
}


@pytest.mark.parametrize(("body", "length", "message"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_requests_are_refused_with_a_reason(
    body: bytes, length: int | None, message: str
) -> None:
    with pytest.raises(V2Error) as raised:
        parse_infer_request(body, length)
    assert message in raised.value.message and raised.value.status == 400


def test_binary_data_must_match_the_declared_sizes() -> None:
    header = {
        "inputs": [
            {"name": "a", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}}
        ]
    }
    short, length = binary_body(header, b"\0" * 8)
    with pytest.raises(V2Error, match="'a': binary data ends"):
        parse_infer_request(short, length)
    extra, length = binary_body(header, b"\0" * 20)
    with pytest.raises(V2Error, match="4 bytes of binary data belong to no input"):
        parse_infer_request(extra, length)


def join_bytes_elements(elements: list[bytes]) -> bytes:
    """BYTES elements as a client sends them in binary data (each a 4-byte little-endian
    length, then itself)."""
    return b"".join(struct.pack("<I", len(element)) + element for element in elements)


def test_bytes_elements_round_trip_and_malformed_ones_are_refused() -> None:
    elements = [b"hello", b"", "naïve".encode()]
    joined = join_bytes_elements(elements)
    assert joined[:4] == struct.pack("<I", 5)
    assert split_bytes_elements(joined) == elements
    with pytest.raises(V2Error, match="inside an element"):
        split_bytes_elements(struct.pack("<I", 10) + b"abc")
    with pytest.raises(V2Error, match="length"):
        split_bytes_elements(b"\x01\x00")


def test_responses_parse_in_tritonclient_as_json_and_as_binary() -> None:
    scores = np.arange(6, dtype="<f4").reshape(2, 3)
    flags = np.array([True, False])
    outputs = [
        OutputTensor("scores", "FP32", (2, 3), raw=scores.tobytes()),
        OutputTensor("flags", "BOOL", (2,), data=flags.tolist()),
    ]
    body, length = encode_response("m", "id-1", outputs)
    assert length is not None and json.loads(body[:length])["id"] == "id-1"
    result = InferResult.from_response_body(body, header_length=length)
    np.testing.assert_array_equal(result.as_numpy("scores"), scores)
    np.testing.assert_array_equal(result.as_numpy("flags"), flags)
    only_json, no_length = encode_response("m", None, outputs[1:])
    assert no_length is None and "id" not in json.loads(only_json)


def test_the_v2_front_end_does_not_import_torch() -> None:
    probe = (
        "import sys, app.main, app.api.v2, app.tensor_service, app.tensors;"
        "print([m for m in ('torch', 'transformers') if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_a_leading_utf8_bom_is_ignored_as_on_the_other_json_routes() -> None:
    parsed = parse_infer_request(b"\xef\xbb\xbf" + f'{{"inputs": [{X}]}}'.encode(), None)
    assert [tensor.name for tensor in parsed.inputs] == ["x"]
