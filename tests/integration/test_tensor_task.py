"""The `tensor` task in-process: an exported torch module served through the scheduler,
its preallocated slots and warm-up, and what the engine refuses on its own. The test
models (`models`) come from tests/integration/conftest.py; what a model is checked for
before it serves (a state dict at load, an output's dtype at warm-up) is in
test_tensor_model_checks.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import numpy as np
import orjson
import pytest
import pytest_asyncio
import torch

from app.admission import RejectReason
from app.engine.core import EngineCore
from app.engine.host import EngineLoad
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import (
    EmbedPayload,
    Failure,
    FailureKind,
    FromEngine,
    Submit,
    TensorData,
    TensorPayload,
)
from app.engine.tensor_host import TensorHost
from app.main import create_app
from app.model_specs import ModelSpec
from app.settings import Settings
from tests.support.asgi import post_directly, serving
from tests.support.tensor_models import LOOKUP_ROWS, TensorModels

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(models: TensorModels) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        engine="inprocess",
        models=tuple(ModelSpec.model_validate(s) for s in models.specs if s["name"] != "mlp16"),
        length_buckets=(4, 8, 16),
        max_batch_size=8,
        max_wait_ms=2.0,
        torch_threads=1,
        max_queue_delay_ms=10_000,
    )
    async with serving(create_app(settings)) as client:
        yield client


async def test_a_v2_request_shed_in_microseconds_is_not_timed_as_a_slow_request(
    models: TensorModels,
) -> None:
    """Shed before its body is read, like the prebuilt answers of the other routes: timed,
    a flood of them pulled the running p99 (the slow-request threshold) down to theirs."""
    settings = Settings(
        engine="inprocess",
        models=tuple(ModelSpec.model_validate(s) for s in models.specs if s["name"] == "mlp"),
        length_buckets=(4, 8, 16),
        torch_threads=1,
        slow_request_ms=1e-6,  # any timed request is slow
    )
    async with serving(create_app(settings)) as client:
        app = client._transport.app  # type: ignore[attr-defined]
        app.state.service.drain.begin()
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8]}]}
        response = await client.post("/v2/models/mlp/infer", json=body)
        assert response.status_code == 503
        assert app.state.recorder.recent() == []


def core_of(client: httpx.AsyncClient) -> EngineCore:
    engine = client._transport.app.state.service.engine  # type: ignore[attr-defined]
    assert isinstance(engine, InProcessEngine)
    return engine.core


def host_of(client: httpx.AsyncClient, name: str) -> TensorHost:
    host = core_of(client).hosts[name]
    assert isinstance(host, TensorHost)
    return host


def frames_body(frames: np.ndarray) -> dict[str, object]:
    return {
        "inputs": [
            {
                "name": "frames",
                "datatype": "FP32",
                "shape": list(frames.shape),
                "data": frames.reshape(-1).tolist(),
            }
        ],
    }


async def test_warm_up_covers_every_shape_and_traffic_stays_in_the_preallocated_slots(
    client: httpx.AsyncClient, models: TensorModels
) -> None:
    host = host_of(client, "seq")
    shapes = host.batcher.scheduler.policy.shapes()
    assert {s.length for s in shapes} == {4, 8, 16} and host.warmup_total == len(shapes)
    assert all(host.batcher.scheduler.estimated_compute(shape) > 0 for shape in shapes)
    before = host.pool.stats()
    rng = np.random.default_rng(1)
    # Every length bucket, several batch sizes, at once: rows of different lengths share
    # batches of their bucket and are sliced back to their own length.
    shapes_sent = [(1, 3), (2, 4), (3, 5), (1, 8), (2, 11), (1, 16), (5, 2)]
    sent = [rng.standard_normal((r, n, 4)).astype(np.float32) for r, n in shapes_sent]
    responses = await asyncio.gather(
        *(client.post("/v2/models/seq/infer", json=frames_body(f)) for f in sent)
    )
    for frames, response in zip(sent, responses, strict=True):
        assert response.status_code == 200, response.text
        outputs = {o["name"]: o for o in response.json()["outputs"]}
        with torch.inference_mode():
            doubled, total = models.sequence(torch.from_numpy(frames))
        assert outputs["doubled"]["shape"] == list(frames.shape)
        np.testing.assert_array_equal(
            np.array(outputs["doubled"]["data"], dtype=np.float32).reshape(frames.shape),
            doubled.numpy(),
        )
        np.testing.assert_allclose(
            np.array(outputs["total"]["data"]).reshape(total.shape), total.numpy(), rtol=1e-5
        )
    after = host.pool.stats()
    assert after.misses == before.misses == 0
    assert after.bytes_preallocated == before.bytes_preallocated
    assert all(not host.batcher.shapes.first_seen(shape) for shape in shapes)


async def test_int64_bool_and_bf16_tensors_keep_their_values(
    client: httpx.AsyncClient, models: TensorModels
) -> None:
    """Slots of every declared dtype: BF16 travels as its raw bits, in and out."""
    ids = [[1, 2, 3, 4, 5], [10, 20, 30, 40, 50]]
    mask = [[True, False, True, False, True], [False] * 5]
    scale = [[1.5], [-0.375]]  # exact in bfloat16
    body = {
        "inputs": [
            {"name": "ids", "datatype": "INT64", "shape": [2, 5], "data": ids},
            {"name": "mask", "datatype": "BOOL", "shape": [2, 5], "data": mask},
            {"name": "scale", "datatype": "BF16", "shape": [2, 1], "data": scale},
        ]
    }
    response = await client.post("/v2/models/typed/infer", json=body)
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    with torch.inference_mode():
        total, doubled, kept_any = models.typed(
            torch.tensor(ids), torch.tensor(mask), torch.tensor(scale, dtype=torch.bfloat16)
        )
    assert outputs["total"] == {
        "name": "total",
        "datatype": "INT64",
        "shape": [2],
        "data": total.tolist(),
    }
    assert outputs["doubled"]["data"] == doubled.float().reshape(-1).tolist() == [3.0, -0.75]
    assert outputs["any"]["data"] == kept_any.tolist() == [True, False]


async def test_a_dynamic_dim_over_the_largest_bucket_is_refused_before_queuing(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(
        "/v2/models/seq/infer", json=frames_body(np.zeros((1, 17, 4), dtype=np.float32))
    )
    assert response.status_code == 400
    assert "largest length bucket (16)" in response.json()["error"]


async def test_tensor_rows_are_admitted_by_predicted_delay(client: httpx.AsyncClient) -> None:
    """The engine's delay admission sees a fixed-shape model's rows (length 1), not its
    feature dimension."""
    host = host_of(client, "mlp")
    features = TensorData("features", "FP32", [2, 8], bytes(64))
    request = Submit(9, "mlp", 1e12, TensorPayload([features]))
    load = EngineLoad(
        model="mlp", queued_inputs=0, backlog_s=5.0, now=0.0, max_queue=4096, max_queue_delay_s=0.1
    )
    verdict = host.admit(request, load)
    assert verdict is not None and verdict.reason is RejectReason.QUEUE
    assert host.admit(request, replace(load, backlog_s=0.0)) is None
    full = host.admit(request, replace(load, backlog_s=0.0, queued_inputs=4095))
    assert full is not None and full.reason is RejectReason.QUEUE


async def test_native_infer_on_a_tensor_model_is_a_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/infer", json={"inputs": "text", "model": "mlp"})
    assert response.status_code == 400
    assert "'tensor'" in response.json()["error"]["message"]


async def test_the_engine_refuses_a_payload_that_does_not_fit_the_spec(
    client: httpx.AsyncClient,
) -> None:
    """A misbehaving front end's payload is answered 400 by the engine, never computed."""
    core = core_of(client)
    answers: list[FromEngine] = []
    bad = TensorData("features", "FP32", [1, 8], b"\0" * 16)  # 16 bytes for 32
    core.submit(b"test", Submit(1, "mlp", 1e12, TensorPayload([bad])), answers.append)
    core.submit(b"test", Submit(2, "mlp", 1e12, EmbedPayload([[1, 2]])), answers.append)
    assert [type(a) for a in answers] == [Failure, Failure]
    assert all(isinstance(a, Failure) and a.kind is FailureKind.BAD_REQUEST for a in answers)
    first, second = answers
    assert isinstance(first, Failure) and "'features'" in first.message
    assert isinstance(second, Failure) and "takes tensors" in second.message


async def test_a_draining_server_sheds_v2_requests_with_the_protocol_s_error(
    client: httpx.AsyncClient,
) -> None:
    service = client._transport.app.state.service  # type: ignore[attr-defined]
    service.drain.begin()
    try:
        body = {
            "inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": [0] * 8}]
        }
        response = await client.post("/v2/models/mlp/infer", json=body)
    finally:
        service.admission.draining = False
    assert response.status_code == 503
    assert set(response.json()) == {"error"} and "draining" in response.json()["error"]
    assert "shed;dur=" in response.headers["server-timing"]
    assert service.admission.inflight == 0


async def test_the_engine_publishes_the_inputs_it_took_from_each_front_end(
    client: httpx.AsyncClient,
) -> None:
    """Refused or not, what the engine took is counted per front end, in the units the
    front ends count what they send (a tensor request's rows, an embedding's texts)."""
    core = core_of(client)
    answers: list[FromEngine] = []
    before = core.status().taken_inputs
    bad = TensorData("features", "FP32", [3, 8], b"\0" * 16)  # 16 bytes for 96
    core.submit(b"front-a", Submit(1, "mlp", 1e12, TensorPayload([bad])), answers.append)
    core.submit(b"front-b", Submit(1, "mlp", 1e12, EmbedPayload([[1], [2]])), answers.append)
    core.submit(b"front-b", Submit(2, "mlp", 1e12, EmbedPayload([[3]])), answers.append)
    taken = core.status().taken_inputs
    assert taken[b"front-a"] - before.get(b"front-a", 0) == 3
    assert taken[b"front-b"] - before.get(b"front-b", 0) == 3
    assert len(answers) == 3  # all refused, at once


def ids_body(ids: list[list[int]]) -> dict[str, object]:
    flat = [i for row in ids for i in row]
    return {"inputs": [{"name": "ids", "datatype": "INT64", "shape": [len(ids), 3], "data": flat}]}


async def test_the_lookup_model_throws_on_a_bad_id_before_it_indexes(models: TensorModels) -> None:
    """The test below needs an input the model throws on as a request's own error on every
    device. Indexing past the table throws IndexError on the CPU, but on CUDA it is a
    device-side assert that leaves the process's CUDA context unusable (the H200 run: every
    later batch and test in the process failed); the exported program checks the ids on the
    host (`_assert_scalar`) before its embedding reads them."""
    program = torch.export.load(next(s["source"] for s in models.specs if s["name"] == "lookup"))
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    checks = [i for i, t in enumerate(targets) if t is torch.ops.aten._assert_scalar.default]
    embedding = targets.index(torch.ops.aten.embedding.default)
    assert len(checks) >= 2 and max(checks) < embedding, targets
    for bad in ([[1, 2, LOOKUP_ROWS]], [[1, -1, 2]]):
        with pytest.raises(RuntimeError, match="Runtime assertion failed"):
            program.module()(torch.tensor(bad))


async def test_an_input_the_model_throws_on_fails_only_its_own_request(
    client: httpx.AsyncClient, models: TensorModels
) -> None:
    """A batch fails whole when one input makes the model throw (an id past the embedding
    table, refused by the model's own check): every request sharing it got a 500, and a few
    such batches turned /healthz 503, so one client's bad ids failed others' requests and got
    the pod restarted."""
    good_ids = [[1, 2, 3], [4, 5, 6]]
    bad_ids = [[1, 2, LOOKUP_ROWS]]
    with torch.inference_mode():
        expected = models.lookup(torch.tensor(good_ids)).numpy()
    threshold = core_of(client).health.threshold
    for _ in range(threshold + 1):  # more bad batches than make the engine unhealthy
        good, bad = await asyncio.gather(
            client.post("/v2/models/lookup/infer", json=ids_body(good_ids)),
            client.post("/v2/models/lookup/infer", json=ids_body(bad_ids)),
        )
        assert good.status_code == 200, good.text
        summed = good.json()["outputs"][0]
        np.testing.assert_allclose(np.array(summed["data"]).reshape(2, 4), expected, rtol=1e-6)
        assert bad.status_code == 400, bad.text
        # Which input, and the class of what the model raised: never its text.
        assert bad.json()["error"].startswith("the model could not process input 0 (")
    alone = await client.post("/v2/models/lookup/infer", json=ids_body(bad_ids))
    assert alone.status_code == 400  # a batch of one bad input is the input's fault too
    assert (await client.get("/healthz")).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/v2/models/mlp/infer", {}, 405),  # a wrong method
        ("GET", "/v2/models/mlp/config", {}, 404),  # a route the protocol has, this not
        ("POST", "/v2/models/mlp/infer", {"content-encoding": "gzip"}, 415),
    ],
)
async def test_errors_answered_outside_the_v2_routes_keep_the_protocol_s_envelope(
    client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str], status: int
) -> None:
    """KServe and Triton clients read `error` as a string; these got the project's object."""
    response = await client.request(method, path, headers=headers, content=b"\x1f\x8b")
    assert response.status_code == status
    assert isinstance(response.json()["error"], str), response.text
    plain = await client.request(
        method, "/infer" if method == "POST" else "/nowhere", headers=headers
    )
    assert isinstance(plain.json()["error"], dict)  # the project's own, elsewhere


async def test_a_client_gone_mid_body_on_v2_is_not_a_server_fault(
    client: httpx.AsyncClient,
) -> None:
    """Starlette's ClientDisconnect escaped the v2 route: logged and counted as a 500."""
    app = client._transport.app  # type: ignore[attr-defined]
    messages = [
        {"type": "http.request", "body": b'{"inputs": [', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, object]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    headers = [(b"content-type", b"application/json")]
    status, _ = await post_directly(app, "/v2/models/mlp/infer", headers, receive)
    assert status == 499


async def test_health_endpoints_answer_with_the_bodies_kserve_clients_read(
    client: httpx.AsyncClient,
) -> None:
    """KServe's client calls `response.json()["live"]`: an empty 200 raised JSONDecodeError."""
    assert (await client.get("/v2/health/live")).json() == {"live": True}
    assert (await client.get("/v2/health/ready")).json() == {"ready": True}
    assert (await client.get("/v2/models/mlp/ready")).json() == {"name": "mlp", "ready": True}


async def test_nan_asked_for_as_json_is_the_client_s_to_fix_not_a_500(
    client: httpx.AsyncClient,
) -> None:
    """JSON has no NaN; binary output carries it, which the client can ask for."""
    nan = np.full((1, 8), np.nan, dtype="<f4").tobytes()
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "datatype": "FP32",
                    "shape": [1, 8],
                    "parameters": {"binary_data_size": len(nan)},
                }
            ],
            "outputs": [{"name": "scores", "parameters": {"binary_data": False}}],
        }
    )
    response = await client.post(
        "/v2/models/mlp/infer",
        content=header + nan,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 400
    assert "ask for binary output" in response.json()["error"]
