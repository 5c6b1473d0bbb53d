"""The engine's answer to a request whose batch (or generation step) failed of a lost device
(a sticky CUDA error: `failures.device_lost`), sent before the engine exits for a fresh one
(`engine/process.py::exit_when_device_lost`), and a generation step's answer to any other
failure (`step_failure`). Engine event loop thread only; torch-free.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from app.admission import RejectReason
from app.engine.protocol import Failure, FailureKind, Submit
from app.failures import DEVICE_LOST, RETRY_AFTER_ENGINE_LOST_S, DeviceLost, device_lost

if TYPE_CHECKING:
    from app.engine.host import EngineContext  # torch: for types only

log = logging.getLogger(__name__)


def device_lost_failure(request_id: int, error: DeviceLost) -> Failure:
    """500 `device_lost` (not to be resent unchanged) for a request of the batch whose
    failure lost the device (`error.first`); for one of a batch that failed of it beside
    that one, the retryable 503 `engine_lost` its front end answers every request the exit
    leaves unanswered."""
    if error.first:
        return Failure(request_id, FailureKind.FAILED, str(error), reason=DEVICE_LOST)
    return Failure(
        request_id,
        FailureKind.REJECTED,
        str(error),
        reason=RejectReason.ENGINE_LOST.value,
        retry_after_s=RETRY_AFTER_ENGINE_LOST_S,
    )


def step_failure(request: Submit, error: BaseException, context: EngineContext) -> Failure:
    """The answer to a sequence of a generation step that raised `error`: a lost device's
    (`device_lost_failure`; the step that lost it unless `context.lost_device_before(error)`
    says another failure did), else 500 (`FAILED`): what failed and the class of `error`,
    the server's fault, and the request's reference, under which this log holds its text
    (the model's words may hold anything: the prompt itself, the model's internals)."""
    if device_lost(error):
        lost = DeviceLost(first=not context.lost_device_before(error))
        return device_lost_failure(request.request_id, lost)
    log.error(
        "request %s to %s: failed with its generation step: %s: %s",
        request.reference,
        request.model,
        type(error).__name__,
        error,
    )
    message = server_fault("computing a generation step of this request", error, request)
    return Failure(request.request_id, FailureKind.FAILED, message)


def server_fault(what: str, error: BaseException, request: Submit) -> str:
    """A 500's message for a generation the server failed `what`-ing: the class of `error`
    only (its text, which may hold the prompt or the model's internals, goes to the log
    under the request's reference, which the message names)."""
    return (
        f"generation failed: the server failed {what} ({type(error).__name__}), a fault of "
        f"the server's, not of the request; the server logged why under request "
        f"{request.reference}"
    )
