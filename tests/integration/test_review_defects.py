"""Regression tests for defects found in review (issue 11, item 6), each through the app
with the gated fake model, whose outputs are exact integers (the point is what the server
does with them, not the model)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import torch
from fastapi import FastAPI
from pydantic import ValidationError

from app.cli import run_uvicorn
from app.engine.inprocess import InProcessEngine
from app.main import create_app
from app.model_specs import ModelSpec
from app.service import Service
from app.settings import Settings
from app.shared_port import shared_port_socket
from tests.support.asgi import serving
from tests.support.fake_model import GatedLoader, GatedRunner

BASE = {
    "engine": "inprocess",
    "models": (ModelSpec(name="fake"),),
    "length_buckets": (8, 16),
    "max_batch_size": 2,
    "max_wait_ms": 0.0,
}


class HalfPrecisionLoader(GatedLoader):
    """Runners that say their weights are bf16 (as `auto` picks on a CPU with native bf16)."""

    def __call__(self, spec: ModelSpec, device: torch.device, largest: int) -> GatedRunner:
        runner = super().__call__(spec, device, largest)
        runner.dtype = torch.bfloat16
        return runner


@contextlib.asynccontextmanager
async def app_with(
    loader: GatedLoader | None = None, **overrides: object
) -> AsyncIterator[tuple[httpx.AsyncClient, Service, GatedRunner]]:
    loader = loader or GatedLoader()
    app = create_app(
        Settings(**{**BASE, **overrides}),  # type: ignore[arg-type]
        loader=loader,
        tokenizer_loader=loader.tokenizer,
    )
    async with serving(app) as client:
        yield client, app.state.service, loader.runners["fake"]


def test_an_empty_debug_token_is_refused_rather_than_opening_debug(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEADY_DEBUG_TOKEN", "")
    with pytest.raises(ValidationError, match="debug_token"):
        Settings()


async def test_debug_endpoints_need_the_bearer_scheme_and_the_token() -> None:
    async with app_with(debug_token="s3cret") as (client, _, _):
        for presented in (None, "s3cret", "Basic s3cret", "Bearer", "Bearer wrong"):
            headers = {"Authorization": presented} if presented is not None else {}
            refused = await client.get("/debug/config", headers=headers)
            assert refused.status_code == 401, presented
        accepted = await client.get("/debug/config", headers={"Authorization": "Bearer s3cret"})
        assert accepted.status_code == 200
        assert accepted.json()["settings"]["debug_token"] == "***"


async def test_a_scrape_merges_the_metric_files_off_the_event_loop() -> None:
    """The merge reads every process's files and waits (flock) while the supervisor folds a
    dead process's into the archive: on the event loop it held admitted requests back."""
    async with app_with() as (client, service, _):
        loop_thread = threading.get_ident()
        render = service.metrics.render
        rendered_on: list[int] = []

        def recording_render() -> bytes:
            rendered_on.append(threading.get_ident())
            return render()

        service.metrics.render = recording_render  # type: ignore[method-assign]
        scraped = await client.get("/metrics")
        assert scraped.status_code == 200 and "steadyserve_" in scraped.text
        assert rendered_on and loop_thread not in rendered_on


async def test_a_non_finite_vector_is_a_500_not_a_null() -> None:
    async with app_with() as (client, _, runner):

        def nan_forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return torch.full((input_ids.shape[0], runner.output_width), float("nan"))

        runner.forward = nan_forward  # type: ignore[method-assign]
        response = await client.post("/infer", json={"inputs": "anything"})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "non_finite_output"
        assert "outputs" not in response.json()
        # One check serves every route that renders embeddings.
        openai = await client.post("/v1/embeddings", json={"input": "anything"})
        assert openai.status_code == 500
        assert openai.json()["error"]["code"] == "non_finite_output"
        assert openai.json()["error"]["type"] == "server_error"  # OpenAI's, on /v1
        text = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["anything"]}
        v2 = await client.post("/v2/models/fake/infer", json={"inputs": [text]})
        assert v2.status_code == 500
        assert "non-finite" in v2.json()["error"]


async def test_a_failed_batch_on_v2_is_a_500_that_keeps_the_exception_to_the_log() -> None:
    """Every other route answers a server fault "internal server error"; v2 sent the repr of
    the model's exception (a torch error with tensor shapes, paths) to the client."""
    async with app_with() as (client, _, runner):

        def failing_forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("CUDA error at /opt/secret/kernel.cu:42")

        runner.forward = failing_forward  # type: ignore[method-assign]
        text = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["anything"]}
        v2 = await client.post("/v2/models/fake/infer", json={"inputs": [text]})
        assert v2.status_code == 500
        assert v2.json() == {"error": "internal server error: the batch failed"}


async def test_outputs_keep_fp32_precision_whatever_the_weights_dtype() -> None:
    async with app_with(HalfPrecisionLoader()) as (client, _, _):
        # One 300-letter word: the fake model's first output is 1 + 300 + 2 = 303, which
        # bf16 (8 significant bits) would round to 304.
        body = {"inputs": "x" * 300, "parameters": {"normalize": False}}
        response = await client.post("/infer", json=body)
        assert response.status_code == 200
        assert response.json()["outputs"][0][0] == 303.0


async def test_warm_up_runs_every_shape_on_every_compute_thread() -> None:
    async with app_with(dispatcher_threads=2) as (_, service, runner):
        engine = service.engine
        assert isinstance(engine, InProcessEngine)
        shapes = engine.core.hosts["fake"].batcher.scheduler.policy.shapes()
        threads_by_shape: dict[tuple[int, int], set[str]] = {}
        for rows, thread in zip(runner.batches, runner.batch_threads, strict=True):
            threads_by_shape.setdefault((len(rows), len(rows[0])), set()).add(thread)
        assert {(s.batch, s.length) for s in shapes} == set(threads_by_shape)
        assert all(len(threads) == 2 for threads in threads_by_shape.values()), threads_by_shape


def front_end_in_the_tree(
    loader: GatedLoader, tokenizer: Callable[[ModelSpec, int], object], reports: list[bool]
) -> FastAPI:
    """A front end as the process tree starts it: its start-up's outcome goes to `reports`."""
    return create_app(
        Settings(**BASE),  # type: ignore[arg-type]
        loader=loader,
        tokenizer_loader=tokenizer,  # type: ignore[arg-type]
        on_started=reports.append,
    )


@pytest.mark.parametrize("fails", [False, True])
async def test_a_front_end_reports_how_its_start_up_ended(fails: bool) -> None:
    """What the supervisor's probes count a front end by (and a failed one exits on)."""
    loader = GatedLoader()

    def tokenizer(spec: ModelSpec, largest: int) -> object:
        if fails:
            raise OSError("no tokenizer files in the cache")
        return loader.tokenizer(spec, largest)

    reports: list[bool] = []
    app = front_end_in_the_tree(loader, tokenizer, reports)
    lifespan = app.router.lifespan_context(app)
    if fails:  # uvicorn's start-up fails with it: the port is never listened on
        with pytest.raises(RuntimeError, match="front-end start-up failed"):
            await lifespan.__aenter__()
        assert reports == [False]
        return
    async with lifespan:
        assert reports == [True]
        assert app.state.service.started


def test_a_front_end_whose_start_up_fails_exits_1_without_listening() -> None:
    """uvicorn itself exits 3 when the app's start-up fails; the process tree's front end
    exits 1, as for any unhealthy end, and never listened on the port its siblings serve."""

    def tokenizer(spec: ModelSpec, largest: int) -> object:
        raise OSError("no tokenizer files in the cache")

    sock = shared_port_socket("127.0.0.1", 0)
    reports: list[bool] = []
    app = front_end_in_the_tree(GatedLoader(), tokenizer, reports)
    try:
        status = run_uvicorn(app, app.state.service.settings, sockets=[sock], in_process_tree=True)
        with pytest.raises(ConnectionRefusedError):  # bound, never listened on
            socket.create_connection(sock.getsockname()[:2], timeout=2).close()
    finally:
        sock.close()
    assert status == 1 and reports == [False]


async def test_a_front_end_in_the_process_tree_listens_only_once_it_can_serve() -> None:
    """uvicorn opens its sockets after the lifespan's start-up: that start-up lasts until
    the front end can serve, so a restarting front end takes no connection (nor answers a
    health check 503) on the port its siblings serve."""
    loader = GatedLoader()
    loop = asyncio.get_running_loop()
    tokenizer_called, tokenizer_may_load = asyncio.Event(), asyncio.Event()

    def tokenizer(spec: ModelSpec, largest: int) -> object:  # on a thread (to_thread)
        loop.call_soon_threadsafe(tokenizer_called.set)
        asyncio.run_coroutine_threadsafe(tokenizer_may_load.wait(), loop).result()
        return loader.tokenizer(spec, largest)

    reports: list[bool] = []
    app = front_end_in_the_tree(loader, tokenizer, reports)
    lifespan = app.router.lifespan_context(app)
    entering = asyncio.create_task(lifespan.__aenter__())
    await tokenizer_called.wait()  # start-up is under way, and cannot end before it loads
    assert not entering.done() and reports == [], "start-up ended before it could serve"
    tokenizer_may_load.set()
    await entering
    try:
        assert reports == [True] and app.state.service.started
    finally:
        await lifespan.__aexit__(None, None, None)


async def test_an_embedding_over_fp16s_range_is_refused_as_fp16_not_sent_as_null() -> None:
    async with app_with() as (client, _, runner):

        def huge_forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return torch.full((input_ids.shape[0], runner.output_width), 1e6)

        runner.forward = huge_forward  # type: ignore[method-assign]
        text = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["anything"]}
        body = {
            "inputs": [text],
            "parameters": {"output_datatype": "FP16", "normalize": False},
        }
        refused = await client.post("/v2/models/fake/infer", json=body)
        assert refused.status_code == 400
        assert "does not fit FP16" in refused.json()["error"]
        body["parameters"] = {"output_datatype": "FP32", "normalize": False}
        fine = await client.post("/v2/models/fake/infer", json=body)
        assert fine.status_code == 200
        assert fine.json()["outputs"][0]["data"][0] == 1e6


async def test_the_openapi_document_says_the_probes_answer_503_too() -> None:
    async with app_with() as (client, _, _):
        paths = (await client.get("/openapi.json")).json()["paths"]
    for probe in ("/healthz", "/readyz"):
        assert {"200", "503"} <= set(paths[probe]["get"]["responses"]), probe


async def test_a_compressed_body_is_a_415_that_says_so() -> None:
    """It used to be a bare 400 "There was an error parsing the body"."""
    import gzip

    async with app_with() as (client, _, _):
        body = gzip.compress(b'{"inputs": "text"}')
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        response = await client.post("/infer", content=body, headers=headers)
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["type"] == "unsupported_content_encoding"
    assert "'gzip'" in error["message"]


async def test_a_trailing_slash_is_a_json_404_not_a_redirect_that_reposts_the_body() -> None:
    async with app_with() as (client, _, _):
        response = await client.post("/infer/", json={"inputs": "text"})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"


async def test_an_empty_text_is_refused_on_v2_as_on_infer() -> None:
    async with app_with() as (client, _, _):
        text = {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["fine", ""]}
        refused = await client.post("/v2/models/fake/infer", json={"inputs": [text]})
        assert refused.status_code == 400
        assert "element 1 is empty" in refused.json()["error"]
        infer = await client.post("/infer", json={"inputs": ["fine", ""]})
        assert infer.status_code == 422
