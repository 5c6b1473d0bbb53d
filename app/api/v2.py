"""The Open Inference Protocol (KServe v2, as Triton serves it) over HTTP/REST: server and
model metadata, health, and inference with JSON tensors or the binary tensor data
extension (`v2_codec.py`), so Triton and KServe clients work unchanged.

Embedding models take `text` (BYTES, [n]) and give `embedding` (FP32 [n, d], or FP16 with
the request parameter `output_datatype: "FP16"`), through the same `embed_texts` as /infer
(`embedding_service.py`); `tensor` models take and give their declared tensors
(`tensor_service.py`). Every inference request is shed before its body is read like
/infer's, and goes through the same admission, deadline (the request parameter `timeout`,
in microseconds as Triton's, else Envoy's header, else the default), batching, buffers and
metrics.

Errors under /v2 are the protocol's: `{"error": "..."}` (also those answered outside these
routes: `responses.in_envelope_of`), with 400 (malformed or mismatched tensors, an input the
model fails on, NaN asked for as JSON), 404 (unknown model), 415 (a compressed body),
429/503 (with `Retry-After`), 504 (deadline); the README's table lists them all.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app import __version__
from app.admission import Entry, Rejected
from app.api.cancellation import ClientDisconnected, run_until_disconnect
from app.api.common import BodyParsePhase, envoy_timeout_ms, expects_continue
from app.api.errors import (
    REJECTION_STATUS,
    described,
    engine_unavailable_headers,
    log_batch_failed,
    refusal_headers,
)
from app.api.responses import service_of, v2_error
from app.api.v2_codec import (
    InferInput,
    InferRequest,
    OutputTensor,
    V2Error,
    parse_infer_request,
    split_bytes_elements,
)
from app.api.v2_render import Answer, AnswerRenderer, JsonTensor
from app.embedding_service import embed_texts
from app.engine.client import EngineRefused, EngineUnavailable
from app.engine.protocol import TensorOutput
from app.failures import BatchFailed, DeadlineExceeded, DeviceLost, NonFiniteOutput
from app.model_specs import ModelSpec
from app.models.tokenizer import InputTooLong
from app.service import Service, WrongTask
from app.tensor_service import SentTensor, check_tensors, infer_tensors
from app.tensors import NotJsonNumbers, TensorError, from_json
from app.timing import PhaseTimer

router = APIRouter()

HEADER_LENGTH = "Inference-Header-Content-Length"
EMBED_INPUT = "text"
EMBED_OUTPUT = "embedding"


def _json(content: Any) -> Response:
    return Response(
        orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
    )


def _spec(service: Service, name: str) -> ModelSpec:
    if name not in service.model_names():
        raise V2Error(f"unknown model {name!r}; served: {', '.join(service.model_names())}", 404)
    return service.model_spec(name)


def _check_version(version: str | None) -> None:
    if version not in (None, "1"):
        raise V2Error(f"unknown version {version!r}; the only version is '1'", 404)


async def _guarded(work: Any) -> Response:
    try:
        response: Response = await work
        return response
    except V2Error as error:
        return v2_error(error.message, error.status)


# --- server ---------------------------------------------------------------------------
@router.get("/v2", include_in_schema=False)
async def server_metadata(request: Request) -> Response:
    return _json(
        {"name": "steadyserve", "version": __version__, "extensions": ["binary_tensor_data"]}
    )


@router.get("/v2/health/live", include_in_schema=False)
async def server_live(request: Request) -> Response:
    problem = service_of(request).liveness()
    # A body as KServe's client reads it (`response.json()["live"]`); Triton's reads the status.
    return _json({"live": True}) if problem is None else v2_error(problem, 503)


@router.get("/v2/health/ready", include_in_schema=False)
async def server_ready(request: Request) -> Response:
    readiness = service_of(request).readiness()
    if readiness.ready:
        return _json({"ready": True})
    return v2_error(readiness.problem or readiness.status, 503)


# --- models ---------------------------------------------------------------------------
def _metadata(service: Service, spec: ModelSpec) -> dict[str, Any]:
    if spec.task == "embed":
        width = service.output_width(spec.name) or -1
        inputs = [{"name": EMBED_INPUT, "datatype": "BYTES", "shape": [-1]}]
        outputs = [{"name": EMBED_OUTPUT, "datatype": "FP32", "shape": [-1, width]}]
        platform = "steadyserve_embedding"
    elif spec.task == "tensor":
        inputs = [t.model_dump() for t in spec.inputs]
        outputs = [t.model_dump() for t in spec.outputs]
        platform = "torch_export" if spec.source.endswith(".pt2") else "pytorch_libtorch"
    else:  # generate: served by /infer and the OpenAI routes, no v2 tensors in or out
        inputs, outputs = [], []
        platform = f"steadyserve_{spec.task}"
    return {
        "name": spec.name,
        "versions": ["1"],
        "platform": platform,
        "inputs": inputs,
        "outputs": outputs,
    }


@router.get("/v2/models/{name}", include_in_schema=False)
@router.get("/v2/models/{name}/versions/{version}", include_in_schema=False)
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    async def answer() -> Response:
        _check_version(version)
        service = service_of(request)
        return _json(_metadata(service, _spec(service, name)))

    return await _guarded(answer())


@router.get("/v2/models/{name}/ready", include_in_schema=False)
@router.get("/v2/models/{name}/versions/{version}/ready", include_in_schema=False)
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    async def answer() -> Response:
        _check_version(version)
        service = service_of(request)
        _spec(service, name)
        readiness = service.readiness()
        if not readiness.ready:
            return v2_error(readiness.problem or readiness.status, 503)
        return _json({"name": name, "ready": True})

    return await _guarded(answer())


# --- inference ------------------------------------------------------------------------
@router.post("/v2/models/{name}/infer", include_in_schema=False)
@router.post("/v2/models/{name}/versions/{version}/infer", include_in_schema=False)
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    """Shed from the headers alone (before the body is read) by the named model's own
    predicted wait, then parse, check and compute."""
    service = service_of(request)
    started = time.perf_counter()
    entry = service.shed(envoy_timeout_ms(request), model=name)
    if isinstance(entry, Rejected):
        rejection = entry
        timer: PhaseTimer = request.state.server_timing
        timer.add("shed", time.perf_counter() - started)
        # Answered in microseconds: timed as a request, a flood of them pulled the running
        # p99 the slow-request threshold follows down to their speed.
        timer.latency_bound = False
        # Its body is never read: a client waiting for 100 Continue will not send it.
        return _rejected(rejection, close=expects_continue(request.scope["headers"]))
    try:
        return await _guarded(_infer(request, service, name, version, entry))
    finally:
        service.leave(entry)


def _rejected(rejection: Rejected, close: bool = False) -> Response:
    """The refusal's answer; `close`: with `Connection: close` (the request's body was not
    read and will not come)."""
    headers = refusal_headers(rejection.reason, rejection.retry_after_header)
    if close:
        headers["Connection"] = "close"
    return v2_error(rejection.message, REJECTION_STATUS[rejection.reason], headers)


async def _infer(
    request: Request, service: Service, name: str, version: str | None, entry: Entry
) -> Response:
    _check_version(version)
    spec = _spec(service, name)
    header = request.headers.get(HEADER_LENGTH)
    # ASCII digits only, and few: str.isdigit() also accepts "²", and int() refuses a
    # string of over 4,300 digits; either would have been a 500.
    if header is not None and not (header.isascii() and header.isdigit() and len(header) <= 18):
        raise V2Error(f"{HEADER_LENGTH} must be a non-negative integer")
    try:
        body = await request.body()
    except ClientDisconnect:  # gone mid-body: nothing to answer (it was a 500)
        raise ClientDisconnected() from None
    if (late := service.body_arrived(entry)) is not None:
        return _rejected(late)
    with BodyParsePhase(request):
        parsed = parse_infer_request(body, int(header) if header is not None else None)
    timeout_ms = _timeout_ms(parsed)
    timer: PhaseTimer = request.state.server_timing
    envoy = envoy_timeout_ms(request)
    outputs: list[Answer]
    try:
        if spec.task == "embed":
            outputs = await _embed(request, service, spec, parsed, timeout_ms, envoy, timer)
        else:
            outputs = await _tensors(request, service, spec, parsed, timeout_ms, envoy, timer)
    except Rejected as rejection:
        return _rejected(rejection)
    except DeadlineExceeded as error:  # the engine's words: where it passed
        return v2_error(str(error) or "deadline passed before the request was computed", 504)
    except (TensorError, InputTooLong, EngineRefused, WrongTask) as error:
        return v2_error(str(error), 400)
    except EngineUnavailable as error:
        return v2_error(str(error), 503, engine_unavailable_headers(error))
    except DeviceLost as error:  # not to be resent unchanged: its batch lost the device
        return v2_error(str(error), 500)
    except BatchFailed as error:
        # The server's fault, logged by the engine with its exception; that text (a torch
        # error's repr) is not for the client, as on every other route's 500.
        log_batch_failed(described(request.scope), error)
        return v2_error("internal server error: the batch failed", 500)
    except NonFiniteOutput as error:
        return v2_error(str(error), 500)
    rendering = time.perf_counter()
    renderer: AnswerRenderer = request.app.state.v2_renderer
    try:  # a large answer off the loop
        content, header_length = await renderer.render(timer, spec.name, parsed.id, outputs)
    except NotJsonNumbers as error:  # what the client asked for: binary output carries it
        return v2_error(str(error), 400)
    headers = {HEADER_LENGTH: str(header_length)} if header_length is not None else None
    media_type = "application/json" if header_length is None else "application/octet-stream"
    response = Response(content, headers=headers, media_type=media_type)
    timer.add("serialise", time.perf_counter() - rendering)
    return response


def _timeout_ms(parsed: InferRequest) -> float | None:
    """Triton's `timeout` request parameter is in microseconds."""
    timeout_us = parsed.parameters.get("timeout")
    if timeout_us is None:
        return None
    if isinstance(timeout_us, bool) or not isinstance(timeout_us, int | float) or timeout_us <= 0:
        raise V2Error("parameters.timeout must be a positive number of microseconds")
    return float(timeout_us) / 1000


def _check_outputs(parsed: InferRequest, known: list[str]) -> list[str]:
    """The outputs to send, in the model's order (all when the request names none)."""
    for output in parsed.outputs:
        if output.name not in known:
            raise V2Error(f"unknown output {output.name!r}; the model gives {known}")
    asked = {output.name for output in parsed.outputs}
    return [name for name in known if not asked or name in asked]


def _texts(parsed: InferRequest, limit: int) -> list[str]:
    if len(parsed.inputs) != 1 or parsed.inputs[0].name != EMBED_INPUT:
        names = [i.name for i in parsed.inputs]
        raise TensorError(f"an embedding model takes the one input {EMBED_INPUT!r}; got {names}")
    tensor = parsed.inputs[0]
    if tensor.datatype != "BYTES":
        raise TensorError(f"input {EMBED_INPUT!r}: datatype {tensor.datatype} is not BYTES")
    if len(tensor.shape) != 1 or not 1 <= tensor.shape[0] <= limit:
        raise TensorError(
            f"input {EMBED_INPUT!r}: shape {list(tensor.shape)} must be [n], 1 <= n <= {limit}"
        )
    if tensor.raw is not None:
        elements = split_bytes_elements(tensor.raw)
        try:
            texts = [element.decode("utf-8") for element in elements]
        except UnicodeDecodeError:
            raise TensorError(f"input {EMBED_INPUT!r}: an element is not UTF-8") from None
    else:
        data = tensor.data
        if not isinstance(data, list) or not all(isinstance(t, str) for t in data):
            raise TensorError(f"input {EMBED_INPUT!r}: data must be a list of strings")
        texts = data
    if len(texts) != tensor.shape[0]:
        raise TensorError(
            f"input {EMBED_INPUT!r}: {len(texts)} elements for shape {list(tensor.shape)}"
        )
    if not all(texts):  # as /infer refuses them: a row of nothing but padding, or NaN
        raise TensorError(f"input {EMBED_INPUT!r}: element {texts.index('')} is empty")
    return texts


def _flag(parsed: InferRequest, name: str, default: bool) -> bool:
    value = parsed.parameters.get(name, default)
    if not isinstance(value, bool):
        raise V2Error(f"parameters.{name} must be a boolean")
    return value


async def _embed(
    request: Request,
    service: Service,
    spec: ModelSpec,
    parsed: InferRequest,
    timeout_ms: float | None,
    envoy: float | None,
    timer: PhaseTimer,
) -> list[Answer]:
    texts = _texts(parsed, service.settings.max_inputs_per_request)
    wanted = _check_outputs(parsed, [EMBED_OUTPUT])
    datatype = parsed.parameters.get("output_datatype", "FP32")
    if datatype not in ("FP32", "FP16"):
        raise V2Error("parameters.output_datatype must be FP32 or FP16")
    work = embed_texts(
        service,
        spec.name,
        texts,
        normalize=_flag(parsed, "normalize", True),
        truncate=_flag(parsed, "truncate", False),
        timeout_ms=timeout_ms,
        envoy_timeout_ms=envoy,
        timer=timer,
    )
    result = await run_until_disconnect(request, work)
    if not wanted:
        return []
    with np.errstate(over="ignore"):  # an overflow is refused just below
        vectors = result.vectors.astype("<f2" if datatype == "FP16" else "<f4", copy=False)
    if datatype == "FP16" and not np.isfinite(vectors).all():  # unnormalised, over 65504
        raise V2Error("the embedding does not fit FP16: ask for FP32 or normalize")
    shape = tuple(vectors.shape)
    if parsed.wants_binary(EMBED_OUTPUT):
        return [OutputTensor(EMBED_OUTPUT, datatype, shape, raw=vectors.tobytes())]
    return [OutputTensor(EMBED_OUTPUT, datatype, shape, data=vectors.reshape(-1))]


def _sent(tensor: InferInput) -> SentTensor:
    if tensor.raw is not None:
        return SentTensor(tensor.datatype, tensor.shape, tensor.raw)
    if tensor.datatype not in ("FP16", "BF16", "FP32", "INT64", "BOOL"):
        raise TensorError(f"input {tensor.name!r}: datatype {tensor.datatype} is not served")
    try:
        data = from_json(tensor.datatype, tensor.shape, tensor.data)
    except TensorError as error:
        raise TensorError(f"input {tensor.name!r}: {error}") from None
    return SentTensor(tensor.datatype, tensor.shape, data)


async def _tensors(
    request: Request,
    service: Service,
    spec: ModelSpec,
    parsed: InferRequest,
    timeout_ms: float | None,
    envoy: float | None,
    timer: PhaseTimer,
) -> list[Answer]:
    wanted = _check_outputs(parsed, [t.name for t in spec.outputs])
    with BodyParsePhase(request):  # JSON numbers into arrays: the body's parse, finished
        sent = {t.name: _sent(t) for t in parsed.inputs}
    checked = check_tensors(service, spec.name, sent)
    work = infer_tensors(
        service, spec.name, checked, timeout_ms=timeout_ms, envoy_timeout_ms=envoy, timer=timer
    )
    output: TensorOutput = await run_until_disconnect(request, work)
    answers: list[Answer] = []
    for tensor in output.outputs:
        if tensor.name not in wanted:
            continue
        shape = tuple(tensor.shape)
        if parsed.wants_binary(tensor.name):
            answers.append(OutputTensor(tensor.name, tensor.datatype, shape, raw=tensor.data))
        else:  # made numbers when the body is rendered
            answers.append(JsonTensor(tensor.name, tensor.datatype, shape, tensor.data))
    return answers
