"""The real all-MiniLM-L6-v2 through the ASGI app: results, batching, limits and errors.

Every test that takes `client` runs twice: with the engine in its own process (as served)
and in-process (as debugged)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import orjson
import pytest
import pytest_asyncio
import torch
from transformers import AutoModel, AutoTokenizer

from app.main import create_app
from app.model_specs import BUNDLED_DEFAULT_SOURCE
from app.models.base import resolve_device, resolve_dtype
from app.models.source import resolve_source
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.reference_pooling import masked_mean

pytestmark = pytest.mark.asyncio(loop_scope="module")

SETTINGS = Settings(
    length_buckets=(16, 32, 64),
    max_batch_size=16,
    max_wait_ms=5.0,
    torch_threads=2,
    max_body_bytes=16_384,
    max_inputs_per_request=8,
    # The point here is the results: admission by delay is tested with a fake model and an
    # injected clock, and must not refuse these on a busy shared machine.
    max_queue_delay_ms=10_000,
)
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog near the quiet river bank",
    "Batching scheduler closes a batch on size, on max wait, or on the oldest deadline; "
    "cancelled and expired requests are dropped before they take a buffer slot at all.",
    "p99",
]
LONG_TEXT = " ".join(["tail latency"] * 80)


@pytest.fixture(scope="module")
def reference() -> tuple[AutoTokenizer, AutoModel]:
    """The same weights on the same device and dtype as the server (CUDA in gpu_check.sh)."""
    location = resolve_source(BUNDLED_DEFAULT_SOURCE)
    device = resolve_device(SETTINGS.device)
    model = AutoModel.from_pretrained(location, dtype=resolve_dtype("auto", device, Path(location)))
    return AutoTokenizer.from_pretrained(location), model.to(device).eval()


def reference_vectors(
    reference: tuple[AutoTokenizer, AutoModel], texts: list[str], normalize: bool = True
) -> npt.NDArray[np.float32]:
    """A direct transformers computation: each text alone, no padding, same dtype."""
    tokenizer, model = reference
    rows = []
    with torch.inference_mode():
        for text in texts:
            encoded = tokenizer(text, return_tensors="pt", truncation=True, max_length=64)
            encoded = encoded.to(model.device)
            hidden = model(**encoded).last_hidden_state
            rows.append(masked_mean(hidden, encoded["attention_mask"])[0].cpu().numpy())
    vectors = np.stack(rows)
    if normalize:
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def cosines(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    dots = (a * b).sum(axis=1)
    result: npt.NDArray[np.float32] = dots / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return result


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["process", "inprocess"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    settings = SETTINGS.model_copy(update={"engine": request.param})
    async with serving(create_app(settings)) as client:
        client.headers["x-test-engine"] = request.param
        yield client


def engine_metrics_visible(client: httpx.AsyncClient) -> bool:
    """Engine-side metrics reach a front end's /metrics through the multiprocess directory
    `steadyserve serve` sets up (checked end to end in tests/e2e); an app that owns its
    engine process in a test has none, so only the in-process engine shows them here."""
    return client.headers["x-test-engine"] == "inprocess"


async def test_infer_matches_a_direct_transformers_computation(
    client: httpx.AsyncClient, reference: tuple[AutoTokenizer, AutoModel]
) -> None:
    response = await client.post("/infer", json={"inputs": TEXTS})
    assert response.status_code == 200
    body = response.json()
    assert body["model"] == "all-MiniLM-L6-v2"
    assert body["usage"]["inputs"] == len(TEXTS)
    served = np.array(body["outputs"], dtype=np.float32)
    assert served.shape == (len(TEXTS), 384)
    assert np.allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-4)
    assert cosines(served, reference_vectors(reference, TEXTS)).min() >= 0.9999


async def test_unnormalized_outputs_are_the_raw_mean_pool(
    client: httpx.AsyncClient, reference: tuple[AutoTokenizer, AutoModel]
) -> None:
    response = await client.post(
        "/infer", json={"inputs": TEXTS[1], "parameters": {"normalize": False}}
    )
    assert response.status_code == 200, response.text
    served = np.array(response.json()["outputs"], dtype=np.float32)
    expected = reference_vectors(reference, [TEXTS[1]], normalize=False)
    assert cosines(served, expected).min() >= 0.9999
    assert np.linalg.norm(served) == pytest.approx(np.linalg.norm(expected), rel=0.01)


async def test_openai_embeddings_float_and_base64_agree_with_infer(
    client: httpx.AsyncClient,
) -> None:
    native = np.array((await client.post("/infer", json={"inputs": TEXTS})).json()["outputs"])
    floats = await client.post("/v1/embeddings", json={"input": TEXTS, "model": "all-MiniLM-L6-v2"})
    assert floats.status_code == 200
    body = floats.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    as_floats = np.array([d["embedding"] for d in body["data"]])
    encoded = await client.post(
        "/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}
    )
    as_base64 = np.stack(
        [
            np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
            for d in encoded.json()["data"]
        ]
    )
    assert np.allclose(as_floats, native, atol=1e-6)
    assert np.allclose(as_base64, native, atol=1e-6)


async def test_models_are_listed(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert [m["id"] for m in body["data"]] == ["all-MiniLM-L6-v2"]


async def test_concurrent_requests_are_batched(client: httpx.AsyncClient) -> None:
    if not engine_metrics_visible(client):
        pytest.skip("batch metrics live in the engine process (see tests/e2e)")

    def batches_and_inputs(metrics: str) -> tuple[float, float]:
        count = total = 0.0
        for line in metrics.splitlines():
            if line.startswith("steadyserve_batch_size_count"):
                count += float(line.split()[-1])
            elif line.startswith("steadyserve_batch_size_sum"):
                total += float(line.split()[-1])
        return count, total

    before = batches_and_inputs((await client.get("/metrics")).text)
    texts = [f"request number {i} about batching" for i in range(32)]
    responses = await asyncio.gather(*(client.post("/infer", json={"inputs": t}) for t in texts))
    assert all(r.status_code == 200 for r in responses)
    after = batches_and_inputs((await client.get("/metrics")).text)
    batches, inputs = after[0] - before[0], after[1] - before[1]
    assert inputs == 32
    assert inputs / batches > 1  # mean batch size
    # Batching does not mix results up: each answer is its own text's embedding.
    solo = (await client.post("/infer", json={"inputs": texts[7]})).json()["outputs"][0]
    assert np.dot(solo, responses[7].json()["outputs"][0]) >= 0.9999


async def test_every_response_carries_server_timing(client: httpx.AsyncClient) -> None:
    ok = await client.post("/infer", json={"inputs": "timing"})
    phases = {entry.split(";")[0] for entry in ok.headers["server-timing"].split(", ")}
    assert {"admission", "tokenize", "queue", "compute", "total"} <= phases
    error = await client.post("/infer", json={"inputs": []})
    assert "total;dur=" in error.headers["server-timing"]
    too_big = await client.post("/infer", json={"inputs": ["y" * 20_000]})
    assert too_big.status_code == 413
    assert "total;dur=" in too_big.headers["server-timing"]


async def test_metrics_expose_http_and_steadyserve_instruments(client: httpx.AsyncClient) -> None:
    await client.post("/infer", json={"inputs": "metrics"})
    text = (await client.get("/metrics")).text
    front_end = (
        "http_requests_total",
        "steadyserve_request_duration_seconds_bucket",
        'le="0.15"',
        "steadyserve_inflight_requests",
    )
    engine = (
        "steadyserve_queue_wait_seconds_bucket",
        "steadyserve_batch_compute_seconds_bucket",
        "steadyserve_pool_slots{",
        "steadyserve_pool_bytes{",
        "steadyserve_warmup_shapes{",
    )
    for name in front_end + (engine if engine_metrics_visible(client) else ()):
        assert name in text, name


async def test_an_expired_deadline_gets_504(client: httpx.AsyncClient) -> None:
    response = await client.post("/infer", json={"inputs": "late", "timeout_ms": 0.0001})
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "deadline"
    envoy = await client.post(
        "/infer", json={"inputs": "late"}, headers={"x-envoy-expected-rq-timeout-ms": "0.0001"}
    )
    assert envoy.status_code == 504


async def test_long_text_is_refused_unless_truncation_is_asked_for(
    client: httpx.AsyncClient, reference: tuple[AutoTokenizer, AutoModel]
) -> None:
    refused = await client.post("/infer", json={"inputs": ["short", LONG_TEXT]})
    assert refused.status_code == 413
    assert refused.json()["error"] == {
        "type": "input_too_long",
        "message": refused.json()["error"]["message"],
        "param": "inputs[1]",
        "code": "input_too_long",
    }
    truncated = await client.post(
        "/infer", json={"inputs": LONG_TEXT, "parameters": {"truncate": True}}
    )
    assert truncated.status_code == 200
    served = np.array(truncated.json()["outputs"], dtype=np.float32)
    assert cosines(served, reference_vectors(reference, [LONG_TEXT])).min() >= 0.9999


BAD_REQUESTS: list[tuple[str, object, int, str | None]] = [
    ("malformed JSON", b'{"inputs": ["unterminated"', 400, None),
    ("not an object", b"[1, 2, 3]", 422, None),
    ("not UTF-8", b"\xff\xfe" + '{"inputs": ["x"]}'.encode("utf-16-le"), 400, None),
    ("UTF-16 without a BOM", '{"inputs": ["x"]}'.encode("utf-16-le"), 400, None),
    ("UTF-8 BOM, then no inputs", b'\xef\xbb\xbf{"parameters": {}}', 422, "inputs"),
    ("missing inputs", {"parameters": {}}, 422, "inputs"),
    ("wrong type", {"inputs": 42}, 422, "inputs"),
    ("wrong item type", {"inputs": ["ok", 7]}, 422, "inputs"),
    ("empty list", {"inputs": []}, 422, "inputs"),
    ("empty string", {"inputs": ""}, 422, "inputs"),
    ("empty item", {"inputs": ["fine", ""]}, 422, "inputs"),
    ("unknown field", {"inputs": "x", "surprise": 1}, 422, "surprise"),
    ("bad parameter", {"inputs": "x", "parameters": {"normalize": "maybe"}}, 422, None),
    ("negative timeout", {"inputs": "x", "timeout_ms": -5}, 422, "timeout_ms"),
    ("too many inputs", {"inputs": ["x"] * 9}, 413, "inputs"),
    ("unknown model", {"inputs": "x", "model": "gpt-17"}, 404, "model"),
    ("oversized body", {"inputs": ["y" * 1000] * 20}, 413, None),
]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_input_gets_a_clear_4xx(
    client: httpx.AsyncClient, body: object, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        response = await client.post(
            "/infer", content=body, headers={"content-type": "application/json"}
        )
    else:
        response = await client.post("/infer", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] and error["message"]
    if param is not None:
        assert error["param"].startswith(param), error


async def test_a_chunked_body_over_the_limit_gets_413(client: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"inputs": ["'
        for _ in range(40):
            yield b"z" * 1000
        yield b'"]}'

    response = await client.post(
        "/infer", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413


async def test_openai_errors_are_4xx_too(client: httpx.AsyncClient) -> None:
    tokens = await client.post("/v1/embeddings", json={"input": [[1, 2, 3]]})
    assert tokens.status_code == 400
    dims = await client.post("/v1/embeddings", json={"input": "x", "dimensions": 12})
    assert dims.status_code == 400 and dims.json()["error"]["param"] == "dimensions"
    unknown = await client.get("/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found"
    # Under /v2, in the Open Inference Protocol's envelope: a string.
    unknown_v2 = await client.get("/v2/nothing")
    assert unknown_v2.status_code == 404 and isinstance(unknown_v2.json()["error"], str)


async def test_caps_and_rate_give_429_with_retry_after() -> None:
    """The in-flight cap refuses at the door, the token bucket once a request's tokens are
    counted (after its body), each counted under the model. Each request's body is held
    until every request has been to the door, so the door never sees a bucket the others
    already drew from: left to the event loop's order, under Python 3.12 (whose `wait_for`
    no longer reads the body in a task of its own) each request ran from the door to the
    bucket before the next arrived, and all were refused `rate` at the door, with no model."""
    tight = Settings(
        engine="inprocess",
        length_buckets=(16,),
        max_batch_size=4,
        max_inflight=8,  # 2 of the 10 refused at the door, then the bucket decides
        rate_limit_per_s=1.0,
        rate_limit_burst=16,  # model tokens: "burst N" is 4 ([CLS] burst N [SEP])
        max_inputs_per_request=1,
        max_admission_wait_ms=0.0,
        # The caps and the bucket decide here, not the queue-delay budget: on a slow machine
        # a few batches of MiniLM exceed the default budget, and every refusal said `queue`.
        max_queue_delay_ms=60_000,
    )
    texts = [f"burst {i}" for i in range(10)]
    been_to_the_door = 0  # requests let in (now reading their body) or refused there
    all_been = asyncio.Event()
    release = asyncio.Event()

    def went_to_the_door() -> None:
        nonlocal been_to_the_door
        been_to_the_door += 1
        if been_to_the_door == len(texts):
            all_been.set()

    async def body(text: str) -> AsyncIterator[bytes]:
        went_to_the_door()  # a body is read only once the door let its request in
        await release.wait()
        yield orjson.dumps({"inputs": text})

    def answered(post: asyncio.Task[httpx.Response]) -> None:
        if not release.is_set():  # refused at the door, its body never read
            went_to_the_door()

    async with serving(create_app(tight)) as client:
        posts = []
        for text in texts:
            post = asyncio.create_task(
                client.post(
                    "/infer", content=body(text), headers={"content-type": "application/json"}
                )
            )
            post.add_done_callback(answered)
            posts.append(post)
        await asyncio.wait_for(all_been.wait(), 60)
        release.set()
        responses = await asyncio.gather(*posts)
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}
        rejected = [r for r in responses if r.status_code == 429]
        assert len(rejected) >= 6  # 4 tokens at 1/s: at most 4 of 10 get in
        assert all(int(r.headers["retry-after"]) >= 1 for r in rejected)
        reasons = {r.json()["error"]["type"] for r in rejected}
        assert "rate" in reasons and reasons <= {"rate", "inflight"}
        metrics = (await client.get("/metrics")).text
        assert 'steadyserve_rejected_total{model="all-MiniLM-L6-v2",reason="rate"}' in metrics
