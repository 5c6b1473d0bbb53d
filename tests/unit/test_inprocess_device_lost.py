"""An in-process engine (`STEADY_ENGINE=inprocess`) whose device is lost (a sticky CUDA
error) cannot be restarted alone as an engine process is (it exits, status 3): its
readiness turns failed with the reason and its liveness 503, so the pod is restarted.
Stand-in hosts; torch's own error class, built on the CPU."""

from __future__ import annotations

import torch

from app.admission import RejectReason
from app.engine.core import EngineCore
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import EmbedPayload, Submit
from app.metrics import Metrics
from app.probes import liveness, probe_response, readiness
from app.settings import Settings
from tests.support.stand_in_host import StandInHost


def test_a_lost_device_fails_readiness_and_liveness_in_process() -> None:
    """exit_when_device_lost is installed only in the engine process: in-process, /readyz
    stayed 200 and every batch was answered 500."""
    core = EngineCore(Settings(engine="inprocess"), Metrics())
    core.hosts = {"minilm": StandInHost()}  # type: ignore[dict-item]
    core._ready = True
    engine = InProcessEngine(core)
    request = Submit(1, "minilm", 1e12, EmbedPayload([[1, 2]]))
    assert readiness(engine.status(), None, False, True).ready
    assert core._admit(request) is None

    core.health.record(torch.AcceleratorError("CUDA error: device-side assert triggered"))

    status = engine.status()
    assert status is not None
    ready = readiness(status, None, False, True)
    assert not ready.ready and ready.status == "failed"
    assert ready.problem is not None and "sticky CUDA error" in ready.problem
    assert probe_response("/readyz", ready, None)[0] == 503
    alive_problem = liveness(status, None)
    assert alive_problem == ready.problem
    assert probe_response("/healthz", ready, alive_problem)[0] == 503
    refused = core._admit(request)
    assert refused is not None and refused.reason is RejectReason.NOT_READY
