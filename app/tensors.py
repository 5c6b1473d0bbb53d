"""Tensors of the `tensor` task as bytes: datatypes, checks against a model's declared
specs, and conversions to and from numpy and JSON. Pure (numpy only, no torch): the front
ends check and encode requests with it, the engine decodes them.

Datatypes are the Open Inference Protocol's names. numpy has no bfloat16: BF16 elements
are carried as their raw 16 bits (`uint16` arrays), rounded from the JSON numbers a client
sends (once, to nearest even) and widened to float32 for those it asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.model_specs import TensorSpec

NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "FP16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # the raw bits
    "FP32": np.dtype("<f4"),
    "INT64": np.dtype("<i8"),
    "BOOL": np.dtype("bool"),
}


class TensorError(ValueError):
    """A tensor the model cannot take as sent (a client's mistake: 400). The message names
    the tensor."""


class NotJsonNumbers(ValueError):
    """An output with NaN or infinity: JSON has no such numbers (orjson would write null);
    binary output carries them."""


# The JSON values each datatype takes: integers for INT64, booleans for BOOL, any number
# for the floating types. Nothing is coerced: a string, a fraction for INT64, a boolean
# among numbers or a number for BOOL is the client's mistake.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "FP16": (int, float),
    "BF16": (int, float),
    "FP32": (int, float),
    "INT64": (int,),
    "BOOL": (bool,),
}
_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a non-integer number", str: "a string"}
_JSON_NAMES.update({dict: "an object", type(None): "a null"})
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def element_count(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def check_tensor(spec: TensorSpec, datatype: str, shape: Sequence[int]) -> None:
    """Raise `TensorError` unless `datatype` and `shape` fit `spec` (any size where the spec
    says -1)."""
    if datatype != spec.datatype:
        raise TensorError(
            f"input {spec.name!r}: datatype {datatype} does not match the model's {spec.datatype}"
        )
    fits = len(shape) == len(spec.shape) and all(
        (want == -1 and got >= 0) or got == want
        for got, want in zip(shape, spec.shape, strict=False)
    )
    if not fits:
        raise TensorError(
            f"input {spec.name!r}: shape {list(shape)} does not match the model's "
            f"{list(spec.shape)} (-1: any size)"
        )
    if shape[0] < 1:
        raise TensorError(f"input {spec.name!r}: the batch dimension must be at least 1")
    if 0 in shape:
        # An empty dynamic dimension would be padded to one element of padding, computed,
        # and answered as if the client had sent it.
        raise TensorError(f"input {spec.name!r}: every dimension must be at least 1")


@dataclass(frozen=True, slots=True)
class RequestShape:
    """A checked request's rows (its batch dimension) and length (its longest dynamic
    dimension besides the batch; 1 for a model without any)."""

    rows: int
    length: int


def check_request(
    specs: Sequence[TensorSpec], tensors: dict[str, tuple[str, Sequence[int]]]
) -> RequestShape:
    """Check a request's tensors (name -> (datatype, shape)) against a model's input specs:
    every input present, none unknown, each fitting its spec, one batch size for all.
    Raises `TensorError` naming the input at fault."""
    known = {spec.name for spec in specs}
    for name in tensors:
        if name not in known:
            raise TensorError(f"unknown input {name!r}; the model takes {sorted(known)}")
    rows: int | None = None
    length = 1
    for spec in specs:
        if spec.name not in tensors:
            raise TensorError(f"input {spec.name!r} is missing")
        datatype, shape = tensors[spec.name]
        check_tensor(spec, datatype, shape)
        if rows is not None and shape[0] != rows:
            raise TensorError(
                f"input {spec.name!r}: batch dimension {shape[0]} differs from the other "
                f"inputs' {rows}"
            )
        rows = shape[0]
        dynamic = [got for got, want in zip(shape[1:], spec.shape[1:], strict=True) if want == -1]
        length = max([length, *dynamic])
    assert rows is not None  # specs is never empty (ModelSpec checks it)
    return RequestShape(rows=rows, length=length)


def padded_dims(spec: TensorSpec, length: int) -> tuple[int, ...]:
    """A row's dimensions (batch excluded) with every dynamic one at `length`."""
    return tuple(length if size == -1 else size for size in spec.shape[1:])


def check_size(name: str, datatype: str, shape: Sequence[int], size: int) -> None:
    """Raise `TensorError` unless `size` bytes hold exactly `shape` of `datatype`."""
    expected = element_count(shape) * NUMPY_DTYPES[datatype].itemsize
    if size != expected:
        raise TensorError(
            f"input {name!r}: {size} bytes of data for shape {list(shape)} {datatype} "
            f"({expected} expected)"
        )


def from_bytes(
    datatype: str, shape: Sequence[int], data: bytes, name: str = ""
) -> npt.NDArray[Any]:
    """A read-only array over `data`; raises `TensorError` when its size does not fit."""
    check_size(name, datatype, shape, len(data))
    return np.frombuffer(data, dtype=NUMPY_DTYPES[datatype]).reshape(tuple(shape))


def bf16_bits(values: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.uint16]:
    """float32 or float64 to bfloat16 bits, rounding to nearest even, once. A float64 is
    first narrowed to float32 rounded to odd (toward zero, its lowest bit set where bits
    were dropped): 16 bits more than bfloat16 keep, so no tie is made of a value that was
    none (1 + 2^-8 + 2^-30 went to float32 as 1 + 2^-8, a tie, then to 1.0, not 1.0078125)."""
    wide = np.ascontiguousarray(values, dtype="<f8")
    with np.errstate(over="ignore"):  # beyond float32: infinity, stepped back just below
        narrow = wide.astype("<f4")
    # Toward zero: where float32 rounded away from zero (to infinity too), one step back.
    away = np.abs(narrow.astype("<f8")) > np.abs(wide)
    narrow = np.where(away, np.nextafter(narrow, np.float32(0)), narrow)
    sticky = (narrow.astype("<f8") != wide).astype("<u4")
    bits = (narrow.view("<u4") | sticky).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    result: npt.NDArray[np.uint16] = rounded.astype("<u2")
    return result


def bf16_to_float32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    widened = bits.astype("<u4") << 16
    result: npt.NDArray[np.float32] = widened.view("<f4")
    return result


def from_json(datatype: str, shape: Sequence[int], data: Any) -> bytes:
    """The bytes of a tensor sent as JSON numbers (flat or nested, row-major); raises
    `TensorError` when they are not values of the datatype (`_JSON_TYPES`), do not fit it
    (an INT64 beyond 64 bits, a finite number beyond FP16's range) or are not the shape's
    count."""
    expected = element_count(shape)
    _check_json_values(datatype, shape, data, expected)
    # Only numbers of the datatype, at most the shape's count: numpy builds a small array.
    try:
        sent = np.asarray(data)
    except (ValueError, TypeError) as error:
        raise TensorError(f"data is not {datatype} values: {error}") from None
    if sent.dtype == object:
        raise TensorError(f"data is not {datatype} values (uneven nesting)")
    if sent.size != expected:
        raise TensorError(f"{sent.size} values for shape {list(shape)}")
    # Nested data is read as nested: [[1, 2], [3, 4], [5, 6], [7, 8]] is not a [2, 4].
    if sent.ndim > 1 and sent.shape != tuple(shape):
        raise TensorError(f"data nested as {list(sent.shape)}, not the shape {list(shape)}")
    with np.errstate(over="ignore"):  # an overflow is refused just below
        # BF16 from float64 (numpy's numbers), rounded once by bf16_bits.
        array = sent.astype(np.float64 if datatype == "BF16" else NUMPY_DTYPES[datatype])
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise TensorError(f"data does not fit {datatype} (beyond its range)")
    if datatype == "BF16":
        bits = bf16_bits(array)
        # Finite as sent, rounded to BF16 it may not be (3.4e38 becomes infinity).
        if not np.isfinite(bf16_to_float32(bits)).all():
            raise TensorError("data does not fit BF16 (beyond its range)")
        return bits.tobytes()
    return np.ascontiguousarray(array).tobytes()


def _check_json_values(datatype: str, shape: Sequence[int], data: Any, expected: int) -> None:
    """Raise `TensorError` unless `data` is nested lists (or one value) of JSON values the
    datatype takes, at most `expected` of them. Walked before numpy sees it, stopping at
    the first value too many or of a wrong type: numpy reads a list holding a string as
    one fixed-width string array, its every element as wide as the longest (a 130 KB body
    of a long string and 40,000 empty ones made 1.5 GiB and held the event loop seconds)."""
    allowed = _JSON_TYPES[datatype]
    values = 0
    pending = [iter((data,))]  # one iterator per open list: no recursion, in order
    while pending:
        for value in pending[-1]:
            if type(value) is list:
                pending.append(iter(value))
                break
            values += 1
            if values > expected:
                raise TensorError(f"more than {expected} values for shape {list(shape)}")
            # bool is an int to Python: a boolean among numbers, or a number among
            # booleans, is refused (numpy read [1, true] as integers).
            if (type(value) is bool) != (allowed == (bool,)) or not isinstance(value, allowed):
                kind = _JSON_NAMES.get(type(value), type(value).__name__)
                raise TensorError(f"data is not {datatype} values ({kind} among them)")
            if type(value) is int and not _INT64_MIN <= value <= _INT64_MAX:
                raise TensorError(f"data is not {datatype} values: beyond 64-bit integers")
        else:
            pending.pop()


def to_json(datatype: str, shape: Sequence[int], data: bytes) -> npt.NDArray[Any]:
    """A tensor's elements as a flat array for orjson (`OPT_SERIALIZE_NUMPY`) to write as
    JSON numbers (or booleans), row-major: no Python object per element. Floats are widened
    to float64, whose numbers orjson writes as it writes Python's floats: float32's and
    float16's own shortest forms are other digits (0.1 for 0.10000000149011612)."""
    array = from_bytes(datatype, shape, data)
    if datatype == "BF16":
        array = bf16_to_float32(array)
    if array.dtype.kind == "f":
        if not np.isfinite(array).all():
            raise NotJsonNumbers(f"{datatype} output with NaN or infinity: ask for binary output")
        array = array.astype(np.float64)
    return array.reshape(-1)
