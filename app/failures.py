"""Failures a request can meet after admission, shared by the engine (where they happen) and
the front end (which answers them); and which of the model's exceptions mean a lost device
(`device_lost`: the engine's health and the batcher's triage both ask), read through the
exceptions a model library wrapped them in (`caused_by`). Torch-free."""

from __future__ import annotations

from collections.abc import Callable


class DeadlineExceeded(Exception):
    """The input's deadline passed (or could no longer be met) before it was computed; its
    text says where, as the client reads it (in the queue, unless told otherwise)."""

    def __init__(self, where: str = "deadline passed in the queue") -> None:
        super().__init__(where)


class BatchFailed(Exception):
    """The batch holding the input failed on the server's side (answered 500)."""


# After the engine is lost, clients retry once a new one had time to start: what a front end
# answers a request the engine took with it, and the engine a batch's that failed of a device
# another lost (`engine/lost_device.py`).
RETRY_AFTER_ENGINE_LOST_S = 1.0

# The reason of a FAILED `Failure` whose batch lost the engine its device, and the error
# type a front end answers it with (500); the message of each `DeviceLost`.
DEVICE_LOST = "device_lost"
DEVICE_LOST_MESSAGE = (
    "the request's batch failed with a sticky CUDA error, which left the GPU unusable; the "
    "engine restarts. An input of that batch may be what caused it (an index past an "
    "embedding table, say): do not resend it unchanged"
)
LOST_BESIDE_MESSAGE = (
    "the engine lost its GPU to a sticky CUDA error in another batch while the request was "
    "in it; retry"
)


class DeviceLost(BatchFailed):
    """The batch holding the input failed of a lost device (`device_lost`): the engine exits
    for a fresh one (`engine/process.py`). `first`: that batch is the one whose failure lost
    the device, answered 500 `device_lost` (not retried as is: an input of it may be what
    caused it, and would take the fresh engine down too); else a batch that failed of the
    device another batch lost, answered as the requests the exit leaves are (503
    `engine_lost`, retry)."""

    def __init__(self, message: str | None = None, *, first: bool = True) -> None:
        super().__init__(message or (DEVICE_LOST_MESSAGE if first else LOST_BESIDE_MESSAGE))
        self.first = first


class NonFiniteOutput(Exception):
    """The model computed a NaN or infinite value: a fault of the server's (answered 500
    `non_finite_output`), never rendered, since JSON has no NaN (orjson would write `null`).
    The engine fails an embedding's row with it (`ModelBatcher.rows_failed`) and sends its
    text to the front end in a `FAILED` failure of reason `REASON`, which raises it again
    there (`engine/client.py::failure_error`)."""

    REASON = "non_finite_output"

    @classmethod
    def of(cls, model: str) -> NonFiniteOutput:
        return cls(f"{model} produced a non-finite value (NaN or infinity)")


class InputFailed(Exception):
    """The model failed on this input alone while it computes others (answered 400): the
    input is at fault, not the server. Its `__cause__` is what the model raised: for the
    engine's log, never for the client (its text may hold anything, the input included)."""


# The CUDA (and ROCm HIP) runtime's own words for the errors after which "the process must
# be terminated and relaunched" (CUDA Runtime API, cudaError), as torch raises them:
# "CUDA error: <this>".
_STICKY_DEVICE_ERRORS = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "an illegal instruction was encountered",
    "misaligned address",
    "invalid program counter",
    "hardware stack error",
    "unspecified launch failure",
    "the launch timed out and was terminated",
    "operation not supported on global/shared address space",
    "uncorrectable ECC error encountered",
    # cudaErrorContained (226): an error the GPU contained (a hardware error, or
    # a bad access of a peer's memory over NVLink); NCCL logs it as "Cuda failure 226".
    "Invalid access of peer GPU memory over nvlink or a hardware error",
)
_ERROR_PREFIXES = ("CUDA error: ", "HIP error: ")


# The most exceptions `caused_by` reads of one chain: a model library wraps torch's error
# once or twice; a chain longer than this is not read further.
MAX_CAUSES = 16


def caused_by(error: BaseException, is_it: Callable[[BaseException], bool]) -> bool:
    """Whether `is_it` holds for `error` or an exception it was raised from (`__cause__`)
    or while handling (`__context__`), the chain Python's traceback prints: torch's error
    wrapped by a model library (`raise ModelError(...) from error`, or raised in its
    `except`) is still torch's. Each exception once (a cycle ends the walk), at most
    `MAX_CAUSES` of them."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(seen) < MAX_CAUSES:
        if is_it(current):
            return True
        seen.add(id(current))
        if current.__cause__ is not None:
            current = current.__cause__
        else:  # as a traceback prints it: `raise ... from None` ends the chain
            current = None if current.__suppress_context__ else current.__context__
    return False


def raised_by_torch(error: BaseException) -> bool:
    """Whether `error` is of a class torch raises its runtime's failures as: a plain
    `RuntimeError`, or its `AcceleratorError` (a CUDA runtime error, in newer torch; by
    name: no torch here); never a model's own exception class, whatever its text says."""
    return type(error) is RuntimeError or type(error).__name__ == "AcceleratorError"


def _sticky_device_error(error: BaseException) -> bool:
    if not raised_by_torch(error):
        return False
    message = str(error)
    for prefix in _ERROR_PREFIXES:
        if message.startswith(prefix):
            rest = message[len(prefix) :]
            if any(rest.startswith(words) for words in _STICKY_DEVICE_ERRORS):
                return True
    return False


def device_lost(error: BaseException) -> bool:
    """Whether `error` (or an exception it was raised from, or while handling: `caused_by`)
    is a sticky device error that leaves the process's CUDA context unusable. Only torch's
    own: its `AcceleratorError`, or a plain `RuntimeError` (older torch) whose message
    starts with the runtime's prefix, never an exception of the model's whose text merely
    says so."""
    return caused_by(error, _sticky_device_error)
