"""A `tensor` model's answer under /v2, through the real route in front of an engine double:
the body is the same bytes it was when every element went through a Python list, for each
datatype, JSON or binary; a large answer is rendered on the front end's render thread, not
on its event loop."""

from __future__ import annotations

import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from app.api.v2_render import RENDER_ON_LOOP_MAX_BYTES
from app.engine.protocol import ModelInfo, Output, Submit, TensorData, TensorOutput, ToEngine
from app.main import create_app
from app.model_specs import ModelSpec, TensorSpec
from app.settings import Settings
from app.tensors import NUMPY_DTYPES, bf16_to_float32
from loadtest.null_engine import AlwaysReadyEngine
from tests.support.asgi import serving

ROWS, WIDTH = 2, 500
DATATYPES = ("FP16", "BF16", "FP32", "INT64", "BOOL")
WIDE = RENDER_ON_LOOP_MAX_BYTES // 4 + 1  # one FP32 row of it is over the threshold
DUMPS = orjson.dumps  # the test's own, not recorded by `renders`
SETTINGS = Settings(
    models=(
        ModelSpec(
            name="every",
            task="tensor",
            source="unused.pt2",
            inputs=(TensorSpec(name="x", datatype="FP32", shape=(-1, 2)),),
            outputs=tuple(
                TensorSpec(name=d.lower(), datatype=d, shape=(-1, WIDTH)) for d in DATATYPES
            ),
        ),
        ModelSpec(
            name="wide",
            task="tensor",
            source="unused.pt2",
            inputs=(TensorSpec(name="x", datatype="FP32", shape=(-1, 2)),),
            outputs=(TensorSpec(name="y", datatype="FP32", shape=(-1, WIDE)),),
        ),
    ),
)


def random_bytes(datatype: str, count: int, rng: np.random.Generator) -> bytes:
    """`count` elements of `datatype` from random bits (every float finite: JSON has no
    NaN), with each type's extremes among them."""
    dtype = NUMPY_DTYPES[datatype]
    if datatype == "BOOL":
        return rng.integers(0, 2, count).astype(bool).tobytes()
    if datatype == "INT64":
        values = rng.integers(-(2**63), 2**63 - 1, count, dtype="<i8", endpoint=True)
        values[:3] = [-(2**63), 2**63 - 1, 0]
        return values.tobytes()
    bits = rng.integers(0, 2 ** (8 * dtype.itemsize), 4 * count, dtype="<u8")
    array = bits.astype(f"<u{dtype.itemsize}").view(dtype)
    widened = bf16_to_float32(array) if datatype == "BF16" else array
    return array[np.isfinite(widened)][:count].tobytes()


class TensorEngine(AlwaysReadyEngine):
    """Answers each request at once with its model's fixed outputs."""

    def __init__(self, settings: Settings, outputs: dict[str, list[TensorData]]) -> None:
        super().__init__(settings)
        self.outputs = outputs

    def model_info(self, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(spec.task, 0, 1)

    def _send(self, message: ToEngine) -> None:
        if isinstance(message, Submit):
            payload = TensorOutput(self.outputs[message.model])
            self._deliver(Output(message.request_id, True, payload, queue_s=0.0, compute_s=0.0))


def old_rendering(model: str, outputs: list[TensorData], binary: Collection[str]) -> bytes:
    """The body as the route rendered it before: each JSON output's elements a Python list
    (`tolist()`, BF16 widened to float32), the binary outputs concatenated after the JSON."""
    listed: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for tensor in outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": tensor.shape,
        }
        if tensor.name in binary:
            entry["parameters"] = {"binary_data_size": len(tensor.data)}
            blobs.append(tensor.data)
        else:
            array = np.frombuffer(tensor.data, NUMPY_DTYPES[tensor.datatype])
            if tensor.datatype == "BF16":
                array = bf16_to_float32(array)
            entry["data"] = array.tolist()
        listed.append(entry)
    document = {"model_name": model, "model_version": "1", "outputs": listed, "id": "r"}
    return DUMPS(document) + b"".join(blobs)


def request(model: str, binary: Collection[str] = ()) -> dict[str, Any]:
    names = DATATYPES if model == "every" else ("y",)
    return {
        "id": "r",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [ROWS, 2], "data": [0.5] * 4}],
        "outputs": [
            {"name": n.lower(), "parameters": {"binary_data": n.lower() in binary}} for n in names
        ],
    }


@pytest.fixture
def outputs() -> dict[str, list[TensorData]]:
    rng = np.random.default_rng(7)
    every = [
        TensorData(d.lower(), d, [ROWS, WIDTH], random_bytes(d, ROWS * WIDTH, rng))
        for d in DATATYPES
    ]
    wide = [TensorData("y", "FP32", [ROWS, WIDE], random_bytes("FP32", ROWS * WIDE, rng))]
    return {"every": every, "wide": wide}


async def post(
    tmp_path: Path, outputs: dict[str, list[TensorData]], model: str, body: dict[str, Any]
) -> httpx.Response:
    app = create_app(SETTINGS, engine=TensorEngine(SETTINGS, outputs))
    client: httpx.AsyncClient
    async with serving(app) as client:
        return await client.post(f"/v2/models/{model}/infer", json=body)


@pytest.mark.parametrize("binary", [set(), {"fp32", "bool"}], ids=["json", "mixed"])
async def test_every_datatype_renders_the_same_bytes_as_through_a_python_list(
    tmp_path: Path, outputs: dict[str, list[TensorData]], binary: set[str]
) -> None:
    """orjson writes a float64 array's numbers as it writes Python's floats (float32's and
    float16's own shortest forms would be other digits: 0.1, not 0.10000000149011612)."""
    response = await post(tmp_path, outputs, "every", request("every", binary))
    assert response.status_code == 200, response.text
    assert response.content == old_rendering("every", outputs["every"], binary)


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread each answer's JSON (its document with `model_name`) is
    written on."""
    threads: list[str] = []

    def recording(value: Any, *args: Any, **kwargs: Any) -> bytes:
        if isinstance(value, dict) and "model_name" in value:
            threads.append(threading.current_thread().name)
        return DUMPS(value, *args, **kwargs)

    monkeypatch.setattr(orjson, "dumps", recording)
    return threads


@pytest.mark.parametrize("binary", [set(), {"y"}], ids=["json", "binary"])
async def test_a_large_answer_is_rendered_off_the_event_loop(
    tmp_path: Path, outputs: dict[str, list[TensorData]], renders: list[str], binary: set[str]
) -> None:
    """Its elements made numbers and written as JSON (7.5 ms a MiB of FP32), or its binary
    outputs joined, held the front end's loop for every other request."""
    loop_thread = threading.current_thread().name
    response = await post(tmp_path, outputs, "wide", request("wide", binary))
    assert response.status_code == 200, response.text
    assert response.content == old_rendering("wide", outputs["wide"], binary)
    (thread,) = renders
    assert thread != loop_thread and thread.startswith("steadyserve-render"), thread


async def test_a_small_answer_is_rendered_on_the_loop(
    tmp_path: Path, outputs: dict[str, list[TensorData]], renders: list[str]
) -> None:
    """Under the threshold a thread hop would cost more than the render."""
    loop_thread = threading.current_thread().name
    response = await post(tmp_path, outputs, "every", request("every"))
    assert response.status_code == 200, response.text
    assert renders == [loop_thread]


async def test_nan_in_a_large_json_answer_is_still_the_client_s_400(
    tmp_path: Path, outputs: dict[str, list[TensorData]]
) -> None:
    """`NotJsonNumbers`, raised on the render thread, is answered as on the loop."""
    (tensor,) = outputs["wide"]
    with_nan = np.frombuffer(tensor.data, "<f4").copy()
    with_nan[-1] = np.nan
    outputs["wide"] = [TensorData("y", "FP32", tensor.shape, with_nan.tobytes())]
    response = await post(tmp_path, outputs, "wide", request("wide"))
    assert response.status_code == 400, response.text
    assert "ask for binary output" in response.json()["error"]
