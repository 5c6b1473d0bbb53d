"""Tensors against a model's declared specs, and their byte and JSON forms (pure)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from pydantic import ValidationError

from app.model_specs import ModelSpec, TensorSpec
from app.settings import Settings
from app.tensors import (
    NotJsonNumbers,
    TensorError,
    bf16_bits,
    bf16_to_float32,
    check_request,
    from_bytes,
    from_json,
    padded_dims,
    to_json,
)

FRAMES = TensorSpec(name="frames", datatype="FP32", shape=(-1, -1, 4))
MASK = TensorSpec(name="mask", datatype="BOOL", shape=(-1, -1))
IDS = TensorSpec(name="ids", datatype="INT64", shape=(-1, 3))


def test_a_request_gives_its_rows_and_longest_dynamic_dim() -> None:
    shape = check_request(
        [FRAMES, MASK, IDS],
        {"frames": ("FP32", [2, 7, 4]), "mask": ("BOOL", [2, 9]), "ids": ("INT64", [2, 3])},
    )
    assert (shape.rows, shape.length) == (2, 9)
    assert check_request([IDS], {"ids": ("INT64", [5, 3])}).length == 1


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"frames": ("FP32", [2, 7, 5])}, "input 'frames': shape [2, 7, 5]"),
        ({"frames": ("FP16", [2, 7, 4])}, "input 'frames': datatype FP16"),
        ({"frames": ("FP32", [2, 7])}, "input 'frames': shape"),
        ({"frames": ("FP32", [0, 7, 4])}, "batch dimension must be at least 1"),
        # An empty dynamic dimension was padded to one element and answered as sent.
        ({"frames": ("FP32", [2, 0, 4])}, "every dimension must be at least 1"),
        ({"frames": ("FP32", [2, 7, 4]), "extra": ("FP32", [2])}, "unknown input 'extra'"),
        ({}, "input 'frames' is missing"),
    ],
)
def test_mismatches_name_the_input(tensors: dict[str, tuple[str, list[int]]], message: str) -> None:
    with pytest.raises(TensorError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_request([FRAMES], tensors)


def test_inputs_must_agree_on_the_batch() -> None:
    with pytest.raises(TensorError, match="'mask': batch dimension 3 differs"):
        check_request([FRAMES, MASK], {"frames": ("FP32", [2, 4, 4]), "mask": ("BOOL", [3, 4])})


def test_padded_dims_put_the_bucket_in_every_dynamic_dimension() -> None:
    assert padded_dims(FRAMES, 16) == (16, 4)
    assert padded_dims(IDS, 16) == (3,)


def test_bytes_and_json_forms_agree() -> None:
    values = [[1.5, -2.0], [0.25, 8.0]]
    data = from_json("FP32", [2, 2], values)
    np.testing.assert_array_equal(from_bytes("FP32", [2, 2], data), np.array(values))
    assert to_json("FP32", [2, 2], data).tolist() == [1.5, -2.0, 0.25, 8.0]
    assert to_json("BOOL", [2], from_json("BOOL", [2], [True, False])).tolist() == [True, False]
    with pytest.raises(TensorError, match="3 values for shape"):
        from_json("FP32", [2, 2], [1.0, 2.0, 3.0])
    with pytest.raises(TensorError, match="not INT64"):
        from_json("INT64", [1], ["seven"])
    with pytest.raises(TensorError, match="'x': 4 bytes of data for shape"):
        from_bytes("INT64", [1], b"\0" * 4, "x")


@pytest.mark.parametrize(
    "datatype,values",
    [
        ("INT64", [1.7, -2.9]),  # truncated to 1, -2
        ("INT64", ["12"]),  # a string parsed as a number
        ("FP32", ["1.5", "nan"]),  # NaN through a string: JSON has none
        ("BOOL", [2, 0.5]),  # numbers taken as truthiness
        ("BOOL", ["false"]),  # a non-empty string is True
        ("INT64", [2**64]),  # beyond 64 bits
        ("FP16", [70000.0]),  # beyond FP16: infinity
        ("BF16", [3.4e38]),  # finite in float32, infinity once rounded to BF16
        ("INT64", [1, True]),  # a boolean among integers, read as 1
        ("FP32", [True, 1.5]),  # a boolean among numbers, read as 1.0
    ],
)
def test_json_values_are_taken_as_sent_or_refused(datatype: str, values: list[object]) -> None:
    """Nothing is coerced: numpy would have turned each of these into some other value."""
    with pytest.raises(TensorError, match=f"{datatype}"):
        from_json(datatype, [len(values)], values)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # numpy read this as one string array, every element 2,000 characters wide (32
        # MiB; a 130 KB body made 1.5 GiB), only to count its elements.
        (["a" * 2000] + [""] * 4000, r"not FP32 values \(a string among them\)"),
        ([0.5] * 200_000, r"more than 8 values for shape \[1, 8\]"),
    ],
)
def test_json_data_is_walked_before_numpy_builds_an_array(data: list[object], message: str) -> None:
    """Refused at the first wrong value, or the first one over the shape's count, with no
    array built: the walk's peak memory is a few KiB."""
    tracemalloc.start()
    try:
        with pytest.raises(TensorError, match=message):
            from_json("FP32", [1, 8], data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024


def test_json_values_of_other_types_are_refused_by_name() -> None:
    with pytest.raises(TensorError, match=r"not INT64 values \(a non-integer number among"):
        from_json("INT64", [2], [1, 2.0])
    with pytest.raises(TensorError, match=r"not BOOL values \(an integer among them\)"):
        from_json("BOOL", [2], [True, 1])
    with pytest.raises(TensorError, match=r"not FP16 values \(a null among them\)"):
        from_json("FP16", [2], [[1.0], [None]])
    with pytest.raises(TensorError, match="beyond 64-bit integers"):
        from_json("FP32", [1], [-(2**63) - 1])
    with pytest.raises(TensorError, match="not FP32 values"):
        from_json("FP32", [3], [[1, 2], [3]])  # uneven nesting
    assert (
        from_json("INT64", [2], [2**63 - 1, -(2**63)])
        == np.array([2**63 - 1, -(2**63)], dtype="<i8").tobytes()
    )


def test_nested_data_must_be_nested_as_the_shape() -> None:
    """Only the element count was compared: four pairs were served as two rows of four."""
    with pytest.raises(TensorError, match=r"nested as \[4, 2\], not the shape \[2, 4\]"):
        from_json("FP32", [2, 4], [[1, 2], [3, 4], [5, 6], [7, 8]])
    flat = from_json("FP32", [2, 4], [1, 2, 3, 4, 5, 6, 7, 8])  # flat, row-major: fine
    assert from_json("FP32", [2, 4], [[1, 2, 3, 4], [5, 6, 7, 8]]) == flat


def test_integers_are_numbers_for_the_floating_types() -> None:
    assert to_json("FP32", [2], from_json("FP32", [2], [1, 2])).tolist() == [1.0, 2.0]
    assert to_json("INT64", [0], from_json("INT64", [0], [])).tolist() == []


def test_an_output_with_nan_or_infinity_is_not_rendered_as_json_null() -> None:
    data = np.array([1.0, float("nan"), float("-inf")], dtype="<f4").tobytes()
    with pytest.raises(NotJsonNumbers, match="ask for binary output"):
        to_json("FP32", [3], data)


def test_json_output_is_an_array_for_orjson_not_a_python_float_per_element() -> None:
    """`tolist()` made a Python float (24 bytes) and a list slot (8) per element, on the
    event loop: 8 MiB for a 1 MiB FP32 output. The float64 array orjson writes is 2 MiB."""
    data = np.arange(1 << 18, dtype="<f4").tobytes()
    tracemalloc.start()
    try:
        values = to_json("FP32", [1 << 18], data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(values, np.ndarray) and values.dtype == np.float64
    assert peak < 3 << 20


def test_bfloat16_bits_round_to_nearest_even() -> None:
    values = np.array([1.0, -3.5, 1.00390625, 1.01171875], dtype=np.float32)
    # 1 + 2^-8 is halfway between two bf16 values: it rounds to even (1.0);
    # 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
    assert bf16_to_float32(bf16_bits(values)).tolist() == [1.0, -3.5, 1.0, 1.015625]
    as_json = to_json("BF16", [4], from_json("BF16", [4], values.tolist())).tolist()
    assert as_json == [1.0, -3.5, 1.0, 1.015625]


@pytest.mark.parametrize(
    ("value", "nearest"),
    [
        # Past the tie 1 + 2^-8 by 2^-30: float32 first made it the tie, then 1.0.
        (1 + 2**-8 + 2**-30, 1.0078125),
        (-(1 + 2**-8 + 2**-40), -1.0078125),
        (1 + 2**-8 - 2**-40, 1.0),  # short of the tie
        (1 + 2**-8, 1.0),  # ties, to even: down
        (1 + 3 * 2**-8, 1.015625),  # and up
        # Subnormal: half the smallest BF16 and a little more, not a tie rounded to 0.
        (2**-134 + 2**-160, 2**-133),
        # Just short of the tie between BF16's largest and infinity: its largest, not a 400.
        ((2 - 2**-8 - 2**-40) * 2**127, (2 - 2**-7) * 2**127),
    ],
)
def test_json_bfloat16_is_rounded_once_from_the_number_sent(value: float, nearest: float) -> None:
    """To the nearest BF16 (ties to even) of the float64 sent, not of its float32."""
    assert to_json("BF16", [1], from_json("BF16", [1], [value])).tolist() == [nearest]


def test_tensor_specs_are_checked_at_the_edge() -> None:
    with pytest.raises(ValidationError, match="first dimension must be -1"):
        TensorSpec(name="x", datatype="FP32", shape=(4, 8))
    with pytest.raises(ValidationError, match="-1 \\(dynamic\\) or positive"):
        TensorSpec(name="x", datatype="FP32", shape=(-1, 0))
    with pytest.raises(ValidationError):
        TensorSpec(name="x", datatype="FP64", shape=(-1,))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="declares inputs and outputs"):
        ModelSpec(name="m", task="tensor", source="/m.pt2", inputs=(IDS,))
    with pytest.raises(ValidationError, match="only a tensor model"):
        ModelSpec(name="m", inputs=(IDS,))
    with pytest.raises(ValidationError, match="unique"):
        ModelSpec(name="m", task="tensor", source="/m.pt2", inputs=(IDS,), outputs=(IDS,))


def test_a_dynamic_output_needs_a_dynamic_input() -> None:
    """Its length is the row's longest dynamic input dimension: with no dynamic input the
    buffers held 1, and a model answering any other length never became ready."""
    scores = TensorSpec(name="scores", datatype="FP32", shape=(-1, -1))
    with pytest.raises(ValidationError, match="output 'scores' has a dynamic dimension"):
        ModelSpec(name="m", task="tensor", source="/m.pt2", inputs=(IDS,), outputs=(scores,))
    ModelSpec(name="m", task="tensor", source="/m.pt2", inputs=(MASK,), outputs=(scores,))


def test_steady_models_takes_a_tensor_model_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "STEADY_MODELS",
        '[{"name": "m", "task": "tensor", "source": "/models/m.pt2", '
        '"inputs": [{"name": "x", "datatype": "BF16", "shape": [-1, -1]}], '
        '"outputs": [{"name": "y", "datatype": "BF16", "shape": [-1]}]}]',
    )
    (spec,) = Settings().models
    assert spec.task == "tensor" and spec.inputs[0].dynamic and not spec.outputs[0].dynamic


def tensor_model(datatype: str, shape: tuple[int, ...]) -> dict[str, object]:
    return {
        "name": "m",
        "task": "tensor",
        "source": "/m.pt2",
        "inputs": [{"name": "x", "datatype": datatype, "shape": shape}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": (-1,)}],
    }


@pytest.mark.parametrize(
    ("datatype", "shape"),
    [
        ("FP32", (-1, 300_000)),  # 1.2 MB of raw bytes; JSON of one-digit numbers, 0.6 MB
        ("INT64", (-1, 400_000, -1)),  # token ids in JSON take fewer bytes than as INT64
        ("BOOL", (-1, 1_000_000)),
    ],
)
def test_a_tensor_model_some_request_fits_is_served(datatype: str, shape: tuple[int, ...]) -> None:
    Settings(models=(tensor_model(datatype, shape),))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("datatype", "shape"),
    [("FP32", (-1, 600_000)), ("BOOL", (-1, 1_100_000)), ("FP16", (-1, 2, -1, 300_000))],
)
def test_a_tensor_model_whose_smallest_request_is_too_large_is_refused(
    datatype: str, shape: tuple[int, ...]
) -> None:
    """Accepted, it answered every request 413: one row (dynamic dimensions at 1) cannot
    fit STEADY_MAX_BODY_BYTES, whether its data is binary or JSON."""
    with pytest.raises(ValidationError, match=r"max_body_bytes .* tensor model 'm'"):
        Settings(models=(tensor_model(datatype, shape),))  # type: ignore[arg-type]


def test_datatype_sizes_are_numpys() -> None:
    from app.model_specs import DATATYPE_BYTES
    from app.tensors import NUMPY_DTYPES

    assert {name: dtype.itemsize for name, dtype in NUMPY_DTYPES.items()} == DATATYPE_BYTES
