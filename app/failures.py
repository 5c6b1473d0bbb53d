"""Failures a request can meet after admission, shared by the engine (where they happen) and
the front end (which answers them); and which of the model's exceptions mean a lost device
(`device_lost`: the engine's health and the batcher's triage both ask). Torch-free."""

from __future__ import annotations


class DeadlineExceeded(Exception):
    """The input's deadline passed (or could no longer be met) before it was computed; its
    text says where, as the client reads it (in the queue, unless told otherwise)."""

    def __init__(self, where: str = "deadline passed in the queue") -> None:
        super().__init__(where)


class BatchFailed(Exception):
    """The batch holding the input failed on the server's side (answered 500)."""


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
)
_ERROR_PREFIXES = ("CUDA error: ", "HIP error: ")


def device_lost(error: BaseException) -> bool:
    """Whether `error` (or an exception it was raised from, or while handling) is a sticky
    device error that leaves the process's CUDA context unusable. Only torch's own: its
    `AcceleratorError`, or a plain `RuntimeError` (older torch) whose message starts with
    the runtime's prefix, never an exception of the model's whose text merely says so."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ == "AcceleratorError" or type(current) is RuntimeError:
            message = str(current)
            for prefix in _ERROR_PREFIXES:
                if message.startswith(prefix):
                    rest = message[len(prefix) :]
                    if any(rest.startswith(words) for words in _STICKY_DEVICE_ERRORS):
                        return True
        current = current.__cause__ or current.__context__
    return False
