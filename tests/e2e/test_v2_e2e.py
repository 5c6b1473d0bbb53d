"""The Open Inference Protocol (KServe v2) with the real tritonclient[http] against a real
`steadyserve serve`: the embedding model and exported torch modules (`tensor` task).

One server for the module (its warm-up is the cost): the bundled embedding model plus the
small modules of `tests/support/tensor_models.py`, built into a temporary directory.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support.server import ServerProcess, running_server
from tests.support.tensor_models import TensorModels, build_tensor_models

pytestmark = pytest.mark.e2e

EMBEDDER = "all-MiniLM-L6-v2"
TEXTS = ["Hello world", "The scheduler closes a batch on size or on its oldest deadline", "p99"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> TensorModels:
    return build_tensor_models(tmp_path_factory.mktemp("tensor-models"))


@pytest.fixture(scope="module")
def server(
    models: TensorModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    specs = [{"name": EMBEDDER}, *models.specs]
    env = {
        "STEADY_MODELS": json.dumps(specs),
        "STEADY_MAX_QUEUE_DELAY_MS": "60000",  # the point is the results, not shedding
        "STEADY_MAX_WAIT_MS": "5",
        "STEADY_FRONTEND_WORKERS": "1",
        "STEADY_SLOW_REQUEST_MS": "0.01",  # every request is reported: see the last test
    }
    with running_server(tmp_path_factory.mktemp("v2-server"), env) as process:
        yield process


@pytest.fixture
def client(server: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}", concurrency=16)
    yield client
    client.close()


def text_input(texts: list[str], binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=np.object_), binary_data=binary)
    return tensor


def array_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def native_vectors(server: ServerProcess, texts: list[str]) -> np.ndarray:
    response = httpx.post(f"{server.base_url}/infer", json={"inputs": texts}, timeout=30)
    assert response.status_code == 200, response.text
    return np.array(response.json()["outputs"], dtype=np.float32)


def metric_total(server: ServerProcess, name: str, model: str | None) -> float:
    """The sum of a metric's series (those of `model`, unless None)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    label = "" if model is None else f'[^}}]*model="{re.escape(model)}"'
    pattern = re.compile(rf"^{name}\{{{label}[^}}]*\}} (\S+)$", re.M)
    return sum(float(value) for value in pattern.findall(text))


# --- metadata and health --------------------------------------------------------------
def test_server_metadata_and_readiness(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "steadyserve"
    assert "binary_tensor_data" in metadata["extensions"]
    for model in (EMBEDDER, "mlp", "seq"):
        assert client.is_model_ready(model)
    assert not client.is_model_ready("no-such-model")


def test_model_metadata_names_tensors_with_dynamic_dims(
    client: triton.InferenceServerClient,
) -> None:
    embedder = client.get_model_metadata(EMBEDDER)
    assert embedder["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert embedder["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    seq = client.get_model_metadata("seq")
    assert seq["platform"] == "torch_export"
    assert seq["inputs"] == [{"name": "frames", "datatype": "FP32", "shape": [-1, -1, 4]}]
    assert [o["name"] for o in seq["outputs"]] == ["doubled", "total"]
    assert client.get_model_metadata("mlp_ts")["platform"] == "pytorch_libtorch"


# --- inference ------------------------------------------------------------------------
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_embeddings_over_v2_equal_infer(
    client: triton.InferenceServerClient, server: ServerProcess, binary: bool
) -> None:
    outputs = [triton.InferRequestedOutput("embedding", binary_data=binary)]
    result = client.infer(
        EMBEDDER, [text_input(TEXTS, binary)], outputs=outputs, request_id="req-7"
    )
    assert result.get_response()["id"] == "req-7"
    vectors = result.as_numpy("embedding")
    assert vectors.dtype == np.float32 and vectors.shape == (len(TEXTS), 384)
    np.testing.assert_array_equal(vectors, native_vectors(server, TEXTS))


def test_embeddings_in_fp16_when_asked(
    client: triton.InferenceServerClient, server: ServerProcess
) -> None:
    result = client.infer(
        EMBEDDER, [text_input(TEXTS, True)], parameters={"output_datatype": "FP16"}
    )
    vectors = result.as_numpy("embedding")
    assert vectors.dtype == np.float16
    expected = native_vectors(server, TEXTS).astype(np.float16)
    np.testing.assert_array_equal(vectors, expected)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("model", ["mlp", "mlp_ts", "mlp16"])
def test_exported_module_outputs_equal_a_direct_call(
    client: triton.InferenceServerClient, models: TensorModels, model: str, binary: bool
) -> None:
    half = model == "mlp16"
    features = (
        np.random.default_rng(3).standard_normal((5, 8)).astype(np.float16 if half else np.float32)
    )
    datatype = "FP16" if half else "FP32"
    outputs = [triton.InferRequestedOutput("scores", binary_data=binary)]
    result = client.infer(
        model, [array_input("features", features, datatype, binary)], outputs=outputs
    )
    served = result.as_numpy("scores")
    module = models.mlp16 if half else models.mlp
    with torch.inference_mode():
        expected = module(torch.from_numpy(features)).numpy()
    assert served.dtype == expected.dtype and served.shape == (5, 4)
    # Rows batched (and padded) together compute as they do alone, up to the kernel's
    # summation order for that batch size.
    np.testing.assert_allclose(
        served, expected, rtol=1e-3 if half else 1e-5, atol=1e-3 if half else 1e-6
    )


def test_dynamic_dims_are_padded_to_a_bucket_and_sliced_back(
    client: triton.InferenceServerClient, models: TensorModels
) -> None:
    frames = np.random.default_rng(4).standard_normal((2, 5, 4)).astype(np.float32)
    result = client.infer("seq", [array_input("frames", frames, "FP32", True)])
    with torch.inference_mode():
        doubled, total = models.sequence(torch.from_numpy(frames))
    assert result.as_numpy("doubled").shape == (2, 5, 4)
    np.testing.assert_array_equal(result.as_numpy("doubled"), doubled.numpy())
    np.testing.assert_allclose(result.as_numpy("total"), total.numpy(), rtol=1e-6)


def test_concurrent_v2_requests_are_batched(
    client: triton.InferenceServerClient, server: ServerProcess, models: TensorModels
) -> None:
    before_batches = metric_total(server, "steadyserve_batch_size_count", "mlp")
    before_rows = metric_total(server, "steadyserve_batch_size_sum", "mlp")
    rows = np.random.default_rng(5).standard_normal((48, 1, 8)).astype(np.float32)
    start = threading.Barrier(16)  # 16 clients, 3 requests each, starting together

    def client_sends(chunk: np.ndarray) -> list[np.ndarray]:
        local = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        try:
            start.wait(timeout=30)
            return [
                local.infer("mlp", [array_input("features", row, "FP32", True)]).as_numpy("scores")
                for row in chunk
            ]
        finally:
            local.close()

    with ThreadPoolExecutor(16) as pool:
        served = [s for chunk in pool.map(client_sends, np.split(rows, 16)) for s in chunk]
    with torch.inference_mode():
        expected = models.mlp(torch.from_numpy(rows[:, 0])).numpy()
    np.testing.assert_allclose(np.concatenate(served), expected, rtol=1e-5, atol=1e-6)
    batches = metric_total(server, "steadyserve_batch_size_count", "mlp") - before_batches
    batched_rows = metric_total(server, "steadyserve_batch_size_sum", "mlp") - before_rows
    assert batched_rows == 48
    assert batched_rows / batches > 1, f"{batches} batches for 48 concurrent requests"


# --- errors ---------------------------------------------------------------------------
def post_infer(server: ServerProcess, model: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v2/models/{model}/infer", json=body, timeout=30)


@pytest.mark.parametrize(
    ("tensor", "names"),
    [
        ({"name": "features", "datatype": "FP32", "shape": [1, 7], "data": [0.0] * 7}, "shape"),
        ({"name": "features", "datatype": "INT64", "shape": [1, 8], "data": [0] * 8}, "datatype"),
        ({"name": "pixels", "datatype": "FP32", "shape": [1, 8], "data": [0.0] * 8}, "unknown"),
    ],
    ids=["wrong shape", "wrong dtype", "unknown input"],
)
def test_a_mismatched_tensor_gets_400_naming_the_input(
    server: ServerProcess, client: triton.InferenceServerClient, tensor: dict, names: str
) -> None:
    before = metric_total(server, "steadyserve_batch_size_count", "mlp")
    response = post_infer(server, "mlp", {"inputs": [tensor]})
    assert response.status_code == 400
    message = response.json()["error"]
    assert tensor["name"] in message and names in message
    # tritonclient surfaces it as its exception, with the status and message
    array = np.zeros(
        tensor["shape"], dtype=np.float32 if tensor["datatype"] == "FP32" else np.int64
    )
    with pytest.raises(InferenceServerException) as raised:
        client.infer("mlp", [array_input(tensor["name"], array, tensor["datatype"], True)])
    assert raised.value.status() == "400" and tensor["name"] in raised.value.message()
    assert metric_total(server, "steadyserve_batch_size_count", "mlp") == before


def test_an_unknown_model_gets_404(
    server: ServerProcess, client: triton.InferenceServerClient
) -> None:
    response = post_infer(
        server, "nope", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    )
    assert response.status_code == 404 and "nope" in response.json()["error"]
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("nope")
    assert raised.value.status() == "404"


def test_version_1_is_served_and_other_versions_are_404(
    client: triton.InferenceServerClient,
) -> None:
    assert client.get_model_metadata("mlp", model_version="1")["versions"] == ["1"]
    assert client.is_model_ready("mlp", model_version="1")
    features = array_input("features", np.zeros((1, 8), np.float32), "FP32", True)
    assert client.infer("mlp", [features], model_version="1").as_numpy("scores").shape == (1, 4)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("mlp", [features], model_version="2")
    assert raised.value.status() == "404" and "version" in raised.value.message()


def test_a_request_over_its_deadline_gets_504_uncomputed(
    server: ServerProcess, client: triton.InferenceServerClient
) -> None:
    before = metric_total(server, "steadyserve_batch_size_count", "mlp")
    features = np.zeros((1, 8), dtype=np.float32)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("mlp", [array_input("features", features, "FP32", True)], timeout=1)
    assert raised.value.status() == "504", raised.value
    assert "deadline" in raised.value.message()
    assert metric_total(server, "steadyserve_batch_size_count", "mlp") == before
    # and the server still answers in time otherwise
    assert client.infer("mlp", [array_input("features", features, "FP32", True)]).as_numpy(
        "scores"
    ).shape == (1, 4)


def test_malformed_binary_framing_gets_400(server: ServerProcess) -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "datatype": "FP32",
                    "shape": [1, 8],
                    "parameters": {"binary_data_size": 32},
                }
            ]
        }
    ).encode()
    request = urllib.request.Request(
        f"{server.base_url}/v2/models/mlp/infer",
        data=header + b"\0" * 16,
        headers={"Inference-Header-Content-Length": str(len(header))},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert raised.value.code == 400
    assert "features" in json.loads(raised.value.read())["error"]


@pytest.mark.parametrize("length", ["\u00b2", "9" * 4400], ids=["superscript two", "4400 digits"])
def test_a_header_length_that_is_no_integer_gets_400(server: ServerProcess, length: str) -> None:
    """Both pass str.isdigit(); int() then refused them, and the request was a 500."""
    request = urllib.request.Request(
        f"{server.base_url}/v2/models/mlp/infer",
        data=b"{}",
        headers={"Inference-Header-Content-Length": length},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert raised.value.code == 400
    assert "Inference-Header-Content-Length" in json.loads(raised.value.read())["error"]


# --- the README's examples ------------------------------------------------------------
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_v2_blocks() -> tuple[str, str]:
    """The python and first sh block of the README's Open Inference Protocol section."""
    section = README.read_text().split("## Open Inference Protocol", 1)[1].split("\n## ", 1)[0]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    shell = re.search(r"```sh\n(.*?)```", section, re.S)
    assert python and shell, "the README's v2 section lost its examples"
    return python.group(1), shell.group(1)


def test_the_readme_tritonclient_example_runs(server: ServerProcess) -> None:
    python, _ = readme_v2_blocks()
    namespace: dict[str, object] = {}
    exec(python.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}"), namespace)
    vectors = namespace["vectors"]
    assert isinstance(vectors, np.ndarray) and vectors.shape == (2, 384)
    assert vectors.dtype == np.float32


def test_the_readme_curl_example_answers_as_shown(server: ServerProcess) -> None:
    _, shell = readme_v2_blocks()
    path = re.search(r"localhost:8000(/v2/\S+)", shell)
    body = re.search(r"-d '(.*?)'", shell, re.S)
    shown = re.search(r"# (\{.*\})", shell)
    assert path and body and shown
    response = httpx.post(f"{server.base_url}{path.group(1)}", content=body.group(1), timeout=30)
    assert response.status_code == 200, response.text
    answer = response.json()
    expected = json.loads(shown.group(1).replace("[...]", "[]"))
    assert answer["id"] == expected["id"] and answer["model_name"] == expected["model_name"]
    (output,) = answer["outputs"]
    (shown_output,) = expected["outputs"]
    assert {k: output[k] for k in ("name", "datatype", "shape")} == {
        k: shown_output[k] for k in ("name", "datatype", "shape")
    }
    assert len(output["data"]) == 384


def test_v2_requests_get_slow_request_reports(
    server: ServerProcess, client: triton.InferenceServerClient
) -> None:
    """Every request is slow for this server (STEADY_SLOW_REQUEST_MS=0.01): a v2 inference
    is reported like /infer's; metadata is not inference."""
    before = metric_total(server, "steadyserve_slow_requests_total", None)
    client.get_model_metadata("mlp")
    client.infer("mlp", [array_input("features", np.zeros((1, 8), np.float32), "FP32", True)])
    assert metric_total(server, "steadyserve_slow_requests_total", None) == before + 1
