"""Each shed path is judged on the models of the task it reaches (`model_queues.shed_verdict`):
the protocol and the middleware both pass the path's task, from the app's own map of shed
paths, so that /v1/embeddings is not let in by a generate model's short wait."""

from __future__ import annotations

from typing import Any

import uvicorn
from uvicorn.server import ServerState

from app.admission import Rejected, RejectReason
from app.api.refusal_budget import RefusalBudget
from app.api.shedding import SheddingMiddleware
from app.api.shedding_protocol import shedding_protocol
from app.main import SHED_PATHS
from app.metrics import Metrics
from tests.support.fake_transport import FakeTransport
from tests.unit.test_refusal_pause import FakeLoop

EXPECTED = {"/infer": None, "/v1/embeddings": "embed", "/v1/completions": "generate"}


class RecordingService:
    """A `Service` that refuses everything, noting the task each refusal was judged for."""

    def __init__(self) -> None:
        self.admission = type("Admission", (), {"draining": False})()
        self.metrics = Metrics()
        self.tasks: list[str | None] = []

    def shed(self, envoy_timeout_ms: float | None, task: str | None = None) -> Rejected:
        self.tasks.append(task)
        return Rejected(RejectReason.QUEUE, "busy", retry_after_s=1.0)


async def _app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("a refused request never reaches the app")


def test_the_protocol_sheds_each_path_by_its_task() -> None:
    service = RecordingService()
    protocol_class = shedding_protocol(
        service,  # type: ignore[arg-type]
        SHED_PATHS,
        read_pause_s=0.0,
        budget=RefusalBudget(0),
        body_read_timeout_s=5.0,
    )
    config = uvicorn.Config(_app, lifespan="off", log_level="warning")
    for path in EXPECTED:
        protocol = protocol_class(  # type: ignore[call-arg]
            config=config, server_state=ServerState(), app_state={}, _loop=FakeLoop()
        )
        transport = FakeTransport(("127.0.0.1", 40000))
        protocol.connection_made(transport)  # type: ignore[arg-type]
        protocol.data_received(
            f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-length: 2\r\n\r\n{{}}".encode()
        )
        assert transport.written.startswith(b"HTTP/1.1 429 "), path
    assert service.tasks == list(EXPECTED.values())


async def test_the_middleware_sheds_each_path_by_its_task() -> None:
    service = RecordingService()
    middleware = SheddingMiddleware(_app, service, SHED_PATHS)  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    for path in EXPECTED:
        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        await middleware(scope, receive, send)
    assert service.tasks == list(EXPECTED.values())
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [429] * 3
