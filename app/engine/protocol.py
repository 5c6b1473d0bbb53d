"""The messages between front ends and the engine, and their encoding (msgpack via msgspec).

A request is (id, model, deadline, payload); its answer is a *stream*: zero or more `Output`
messages, then either one whose `final` is true or one `Failure` (an embedding sends one
final output or one failure; generation an output per step while it streams, and a
sequence past its deadline or in a failed step gets the outputs already made, then its
failure). The client ends a stream at either. The payload is a tagged union: a new task
adds a payload and an output type here (generation's live in `protocol_generate.py`, imported
here), and its host in the engine and its route in the
front end (docs/ARCHITECTURE.md §9 lists the steps); the transport, shedding and admission
stay as they are.

Deadlines and status times are `PROTOCOL_CLOCK` (`time.monotonic()`) seconds: on Linux that
clock is system-wide, so front ends and the engine on one host agree on it. Torch-free: front
ends import this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

import msgspec

from app.engine.identity import request_reference
from app.engine.protocol_generate import FinishReason as FinishReason
from app.engine.protocol_generate import GeneratePayload as GeneratePayload
from app.engine.protocol_generate import SamplingParams as SamplingParams
from app.engine.protocol_generate import TokensOutput as TokensOutput

# The clock of every time a message carries (`deadline`, `published_at`): time.monotonic,
# system-wide on Linux. A clock injected for tests times one process; never compare them.
PROTOCOL_CLOCK: Callable[[], float] = time.monotonic


class EmbedPayload(msgspec.Struct, frozen=True, tag="embed"):
    """Token ids of each input (the front end tokenized and checked them)."""

    token_ids: list[list[int]]


class TensorData(msgspec.Struct, frozen=True):
    """One named tensor: its Open Inference Protocol datatype (FP16, BF16, FP32, INT64,
    BOOL), its shape, and its elements row-major, little-endian (BF16 as its 2 bytes, BOOL
    one byte each)."""

    name: str
    datatype: str
    shape: list[int]
    data: bytes


class TensorPayload(msgspec.Struct, frozen=True, tag="tensor"):
    """A `tensor` model's inputs, every one named in its spec, of its datatype and shape
    (the front end checked them), all with the same first (batch) dimension."""

    inputs: list[TensorData]


Payload = EmbedPayload | GeneratePayload | TensorPayload


def payload_inputs(payload: Payload) -> int:
    """The inputs a request adds to the engine's queue, counted the same way by the front
    end that sends it and the engine that takes it (`EngineStatus.taken_inputs`): an
    embedding's texts, a tensor request's rows. A generation prompt waits for a KV slot,
    not in the batch queue the published backlog describes: none."""
    if isinstance(payload, EmbedPayload):
        return len(payload.token_ids)
    if isinstance(payload, TensorPayload):
        shape = payload.inputs[0].shape if payload.inputs else []
        return shape[0] if shape else 1
    return 0


class Submit(msgspec.Struct, frozen=True, tag="submit"):
    """`refusal_counted_by_sender`: one of the Submits one client request was sent as (a
    generation's prompts, one each): `steadyserve_rejected_total` counts requests, so its
    refusal (or expiry) is counted by the front end, once, and not here per Submit.
    `origin`: its sender's socket identity (`identity.py`), set by the engine as it takes it
    (a front end sends it empty); `reference` names the request in logs and answers."""

    request_id: int
    model: str
    deadline: float
    payload: Payload
    refusal_counted_by_sender: bool = False
    origin: bytes = b""

    @property
    def reference(self) -> str:
        return request_reference(self.origin, self.request_id)


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """The client went away: drop the request's queued work."""

    request_id: int


class DebugQuery(msgspec.Struct, frozen=True, tag="debug"):
    """Ask for a JSON report (`what`: "pool" or "config")."""

    request_id: int
    what: str


class FrontEndGone(msgspec.Struct, frozen=True, tag="frontend_gone"):
    """From the supervisor: the front-end process `pid`, started with `token`, exited on its
    own (a crash, a kill, out of memory). Nobody will read the answers of what it sent, and
    it sends no `Cancel`: the engine drops that work (its KV-cache slots included) and
    forgets what it took, by its identity (`identity.frontend_identity(pid, token)`): a
    front end started later under the same pid has another token, and is served."""

    pid: int
    token: int


ToEngine = Submit | Cancel | DebugQuery | FrontEndGone


class EmbedOutput(msgspec.Struct, frozen=True, tag="embed"):
    """Unnormalised float32 vectors, row-major, `rows` x `width`."""

    vectors: bytes
    rows: int
    width: int
    input_tokens: int


class TensorOutput(msgspec.Struct, frozen=True, tag="tensor"):
    """A `tensor` model's outputs, in its spec's order, each with the request's rows first
    and dynamic dimensions sliced back to the request's length."""

    outputs: list[TensorData]


OutputPayload = EmbedOutput | TokensOutput | TensorOutput


class BatchTrace(msgspec.Struct, frozen=True):
    """The batch that finished a request last (its slowest input's), for slow-request
    reports: its rows, padded shape and the token lengths batched with it; the wait for a
    buffer slot; copy in, run and copy out; the compute the scheduler expected for the shape;
    how long its compute thread waited, runnable, for a CPU; whether warm-up had covered
    the shape; for a row answered from its own run after its batch failed, the time lost
    to that batch (its run, the triage's runs of other rows) before the answer."""

    rows: int
    padded_rows: int
    length_bucket: int
    co_batched_lengths: list[int]
    acquire_wait_s: float
    copy_in_s: float
    run_s: float
    copy_out_s: float
    expected_compute_s: float
    runqueue_wait_s: float
    first_seen_shape: bool
    failed_batch_s: float = 0.0


class EngineTrace(msgspec.Struct, frozen=True):
    """The engine's side of a request, sent with its final output: the engine's pid, its
    model's inputs queued when it arrived, its batch, each engine probe's change over the
    request's time in the engine (docs/SPIKES.md; keys ending in `_total` are increases),
    and the compute slots (shared by every model) running a batch when it arrived, of how
    many (0: not known)."""

    pid: int
    queue_depth_at_arrival: int
    batch: BatchTrace | None
    probes: dict[str, float]
    busy_compute_slots_at_arrival: int = 0
    compute_slots: int = 0


class Output(msgspec.Struct, frozen=True, tag="output"):
    """One message of a request's answer (the last `final`). `queue_s`: how long the
    request waited before it started computing; `compute_s`: the compute this output covers,
    since the request's previous output (a request's outputs sum to its compute)."""

    request_id: int
    final: bool
    payload: OutputPayload
    queue_s: float
    compute_s: float
    trace: EngineTrace | None = None  # with the final output, while reports are on


class FailureKind(Enum):
    """How the engine answers a request it will not compute. None for an engine that dies
    with it: a dead engine answers nothing, and its front ends fail what they sent it
    themselves (503 `engine_lost`, `client.engine_lost`) when its socket closes."""

    REJECTED = "rejected"  # refused at admission: 429 (`reason`), 503 or 504
    DEADLINE = "deadline"  # expired in the queue: 504
    BAD_REQUEST = "bad_request"  # the request cannot be served as sent: 400
    FAILED = "failed"  # the batch failed on the server's side: 500


class Failure(msgspec.Struct, frozen=True, tag="failure"):
    request_id: int
    kind: FailureKind
    message: str  # answered to the client: never the model's own exception text
    # For REJECTED: a `RejectReason` value; for FAILED: `device_lost` when the batch lost the
    # engine its device (`failures.DeviceLost`), `NonFiniteOutput.REASON`, else None.
    reason: str | None = None
    retry_after_s: float | None = None
    input_index: int | None = None  # for BAD_REQUEST: the input the model failed on


class DebugReply(msgspec.Struct, frozen=True, tag="debug_reply"):
    request_id: int
    report: dict[str, object]


FromEngine = Output | Failure | DebugReply


class ModelQueue(msgspec.Struct, frozen=True):
    """One model's own queue, the figures of `EngineStatus` for it alone (front ends shed a
    request for it by them: `model_queues.shed_verdict`): `backlog_s` is its predicted
    wait ahead of a new input (`model_queues.wait_ahead`: what is left of every running
    batch, its own queue, a batch of each other model with work before each of its batches
    ahead and before its own; a generate model's, its wait for a KV-cache slot too), the
    rest its own cost (all zero, `batch_rows` 1, for a model that queues nothing in
    batches); `at_cap`: the engine refuses every new request for it (429 `queue`: a generate
    model's `generate_max_waiting` sequences wait for a KV-cache slot, none free)."""

    backlog_s: float
    seconds_per_input: float
    queued_inputs: int
    least_own_compute_s: float
    batch_rows: int
    full_batch_s: float
    at_cap: bool = False


class ModelInfo(msgspec.Struct, frozen=True):
    task: str
    output_width: int
    max_input_tokens: int
    queue: ModelQueue | None = None  # set by the engine's status; None: an older engine's


class EngineStatus(msgspec.Struct, frozen=True):
    """What the engine publishes when it changes (front ends shed load from it).

    `backlog_s`: predicted seconds before a newly queued input starts computing (what is
    left of the running batches and the queued work, divided among the compute threads);
    `seconds_per_input`: what one more queued input adds to it (full batches of the
    smallest length bucket, all workers busy); `least_own_compute_s`: the least the engine
    adds for a request's own batch when it admits it (one input of the smallest shape),
    which front ends add too, so that what they let in the engine does not then refuse;
    `queued_inputs`: the inputs waiting for a batch (of every model that batches; not the
    generate prompts waiting for a KV slot);
    `batch_rows` and `full_batch_s`: the rows and compute of a full batch of that shape,
    in which front ends count the queue as the engine does (`admission.batch_delay`);
    `taken_inputs`: the inputs (`payload_inputs`) this engine has taken from each front
    end, by its socket identity, admitted or not: what a front end sent beyond that is on
    its way and not in `backlog_s` yet, so it adds that itself;
    `models`: each model's task, widths and limits, and its own queue (`ModelQueue`): the
    figures above for it alone, which front ends shed by (`model_queues.shed_verdict`);
    those above are the whole engine's, used only without any model's queue;
    `oldest_compute_s`: how long the oldest compute job not yet finished (a batch, a
    generation step) has run, 0.0 when none runs: the supervisor kills a ready engine whose
    compute never returns (`stuck_compute_s`), which its loop's heartbeat alone hides.
    """

    engine_id: str
    pid: int
    state: str  # loading | warming_up | ready | failed
    warmup_done: int
    warmup_total: int
    healthy: bool
    backlog_s: float
    seconds_per_input: float
    queued_inputs: int
    published_at: float
    least_own_compute_s: float = 0.0
    batch_rows: int = 1
    full_batch_s: float = 0.0
    taken_inputs: dict[bytes, int] = {}
    models: dict[str, ModelInfo] = {}
    problem: str | None = None  # why it is failed or unhealthy, for /readyz and /healthz
    oldest_compute_s: float = 0.0  # a default: an older engine's status still decodes


class EngineRestart(msgspec.Struct, frozen=True):
    """What the supervisor publishes while it restarts the engine (`EngineSupervisor`), from
    the last engine's loss until its replacement is heard ready (then None): `why` the last
    engine was lost ("engine 1234 exited by signal SIGKILL", "... killed: it has had a
    compute running for 75 s ..."), `attempt`: restarts since an engine was last ready,
    `backoff_s`: the wait before this one. Both probe answers say it (`probes.readiness`)."""

    why: str
    attempt: int
    backoff_s: float


class _Addressed(msgspec.Struct):
    """A message to the engine that did not decode, read for its request id alone."""

    request_id: int


_to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
_addressed_decoder = msgspec.msgpack.Decoder(_Addressed)
_from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
_from_engine_batch_decoder = msgspec.msgpack.Decoder(list[FromEngine])
_status_decoder = msgspec.msgpack.Decoder(EngineStatus)
_restart_decoder = msgspec.msgpack.Decoder(EngineRestart | None)
_encoder = msgspec.msgpack.Encoder()


def encode(message: ToEngine | FromEngine | EngineStatus | EngineRestart | None) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine_decoder.decode(data)


def request_to_answer(unreadable: bytes) -> int | None:
    """The request id of a message `decode_to_engine` refused (a front end of another
    version), read leniently to answer it with a `Failure`; None when even that is unread."""
    try:
        return _addressed_decoder.decode(unreadable).request_id
    except msgspec.DecodeError:  # a ValidationError too
        return None


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine_decoder.decode(data)


def encode_batch(messages: list[FromEngine]) -> bytes:
    """Several messages for one front end in one frame (one generation step's outputs)."""
    return _encoder.encode(messages)


def decode_batch_from_engine(data: bytes) -> list[FromEngine]:
    return _from_engine_batch_decoder.decode(data)


def decode_status(data: bytes) -> EngineStatus:
    return _status_decoder.decode(data)


def decode_restart(data: bytes) -> EngineRestart | None:
    return _restart_decoder.decode(data)
