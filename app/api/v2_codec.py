"""The Open Inference Protocol's (KServe v2) inference request and response bodies, with
its binary tensor data extension. Pure: bytes in, bytes out (orjson and numpy only).

Binary extension: the body is a JSON header of `Inference-Header-Content-Length` bytes,
then the raw data of every input whose `parameters.binary_data_size` is set, in the order
the inputs are listed. A response carries binary outputs the same way (the header then
gives the JSON's length). BYTES elements, in binary, are each a 4-byte little-endian length
then the bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

# Request parameters that take their value from the body's JSON, by type.
_BOOL_PARAMETERS = ("binary_data_output",)


class V2Error(Exception):
    """A request the protocol refuses: answered `{"error": message}` with `status`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True, slots=True)
class InferInput:
    """One input tensor as sent: `raw` (binary data) or `data` (JSON values), not both."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | None
    data: Any = None


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    name: str
    binary: bool | None  # None: the request's `binary_data_output` decides


@dataclass(frozen=True, slots=True)
class InferRequest:
    id: str | None
    inputs: tuple[InferInput, ...]
    outputs: tuple[RequestedOutput, ...]  # empty: every output
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def binary_by_default(self) -> bool:
        return bool(self.parameters.get("binary_data_output", False))

    def wants_binary(self, name: str) -> bool:
        for output in self.outputs:
            if output.name == name and output.binary is not None:
                return output.binary
        return self.binary_by_default


# numpy's own limit. A shape is checked against the model's spec only after its data is read
# into an array, and counting the elements of a 1 MiB body's 500,000 dimensions held the
# event loop for seconds.
MAX_RANK = 64


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise V2Error(f"{what} must be a JSON object")
    return value


def _name(tensor: dict[str, Any], kind: str) -> str:
    name = tensor.get("name")
    if not isinstance(name, str):
        raise V2Error(f"each {kind} needs a name")
    return name


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in value
    ):
        raise V2Error(f"input {name!r}: shape must be a list of non-negative integers")
    if len(value) > MAX_RANK:
        raise V2Error(f"input {name!r}: shape has {len(value)} dimensions (at most {MAX_RANK})")
    return tuple(value)


def parse_infer_request(body: bytes, header_length: int | None) -> InferRequest:
    """Parse a request body (`header_length`: the `Inference-Header-Content-Length` header,
    None without binary data). Raises `V2Error` (400) for anything malformed."""
    if header_length is None:
        header, binary = body, b""
    else:
        if not 0 <= header_length <= len(body):
            raise V2Error(
                f"Inference-Header-Content-Length {header_length} exceeds the body's "
                f"{len(body)} bytes"
            )
        header, binary = body[:header_length], body[header_length:]
    try:
        # A leading UTF-8 BOM is ignored, as on the other JSON routes (orjson refuses it).
        document = _object(orjson.loads(header.removeprefix(b"\xef\xbb\xbf")), "the request")
    except orjson.JSONDecodeError:
        raise V2Error("the request's JSON is malformed") from None
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise V2Error("id must be a string")
    parameters = _object(document.get("parameters", {}), "parameters")
    for name in _BOOL_PARAMETERS:
        if name in parameters and not isinstance(parameters[name], bool):
            raise V2Error(f"parameters.{name} must be a boolean")
    listed = document.get("inputs")
    if not isinstance(listed, list) or not listed:
        raise V2Error("inputs must be a non-empty list")
    inputs: list[InferInput] = []
    offset = 0
    for entry in listed:
        tensor = _object(entry, "each input")
        name = _name(tensor, "input")
        datatype = tensor.get("datatype")
        if not isinstance(datatype, str):
            raise V2Error(f"input {name!r}: datatype must be a string")
        shape = _shape(tensor.get("shape"), name)
        tensor_parameters = _object(tensor.get("parameters", {}), f"input {name!r}: parameters")
        size = tensor_parameters.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise V2Error(f"input {name!r}: binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise V2Error(f"input {name!r}: binary data ends before its {size} bytes")
            inputs.append(InferInput(name, datatype, shape, binary[offset : offset + size]))
            offset += size
        else:
            if any(key.startswith("shared_memory") for key in tensor_parameters):
                raise V2Error(f"input {name!r}: shared-memory inputs are not supported")
            if "data" not in tensor:
                raise V2Error(f"input {name!r} has neither data nor binary_data_size")
            inputs.append(InferInput(name, datatype, shape, None, tensor["data"]))
    if offset != len(binary):
        raise V2Error(f"{len(binary) - offset} bytes of binary data belong to no input")
    names = [i.name for i in inputs]
    if len(set(names)) != len(names):
        raise V2Error("an input is named twice")
    listed_outputs = document.get("outputs") or []
    if not isinstance(listed_outputs, list):
        raise V2Error("outputs must be a list")
    outputs: list[RequestedOutput] = []
    for entry in listed_outputs:
        output = _object(entry, "each output")
        name = _name(output, "output")
        output_parameters = _object(output.get("parameters", {}), f"output {name!r}: parameters")
        # Triton's `classification` (top-k as BYTES) and shared-memory outputs are not
        # served: ignored, the client got the whole tensor, or nothing where it looked.
        unserved = sorted(set(output_parameters) - {"binary_data"})
        if unserved:
            raise V2Error(f"output {name!r}: parameters {unserved} are not supported")
        binary_flag = output_parameters.get("binary_data")
        if binary_flag is not None and not isinstance(binary_flag, bool):
            raise V2Error(f"output {name!r}: binary_data must be a boolean")
        outputs.append(RequestedOutput(name, binary_flag))
    return InferRequest(request_id, tuple(inputs), tuple(outputs), parameters)


def split_bytes_elements(raw: bytes) -> list[bytes]:
    """The elements of a BYTES tensor's binary data; raises `V2Error` when malformed."""
    elements: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise V2Error("BYTES data ends inside an element's length")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise V2Error("BYTES data ends inside an element")
        elements.append(raw[offset : offset + length])
        offset += length
    return elements


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One output to send: `raw` goes as binary data, else `data` (JSON values)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | None = None
    data: Any = None


def encode_response(
    model: str, request_id: str | None, outputs: Sequence[OutputTensor]
) -> tuple[bytes, int | None]:
    """The response body and, when an output goes as binary data, the JSON header's length
    for `Inference-Header-Content-Length` (else None: the body is all JSON)."""
    listed: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for output in outputs:
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.shape),
        }
        if output.raw is not None:
            entry["parameters"] = {"binary_data_size": len(output.raw)}
            blobs.append(output.raw)
        else:
            entry["data"] = output.data
        listed.append(entry)
    document: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": listed}
    if request_id is not None:
        document["id"] = request_id
    header = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)  # one copy of the outputs, not two
