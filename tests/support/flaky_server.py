"""A seeded misbehaving /infer server on 127.0.0.1 for the batch client's tests.

It answers like steadyserve (``{"model", "outputs", "usage"}``, one small vector per input,
a function of the text alone) but, at random from ``seed``, answers 429 with
``Retry-After``, 503, resets the connection without answering, or stalls. Inputs that
contain ``INVALID`` get steadyserve's 422 body. ``capacity`` answers 429 to requests over
that many in flight, as steadyserve's in-flight cap does; ``capacity_after`` lifts it
after that many requests, so a test can watch a client back off and then recover.

Runs in a thread with its own event loop (``running_flaky_server``) so synchronous tests
can drive the real CLI against it; counters are read from the test's thread after the
requests they count have been answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

from app.schemas import error_object

MARKER_INVALID = "INVALID"
# A text the "model" computes NaN for: every request carrying it is answered 500, as
# steadyserve answers `non_finite_output`.
MARKER_NAN = "NAN"
DIMENSIONS = 4


def vector_of(text: str) -> list[float]:
    """The stub's embedding of ``text``: fixed, and different for different texts."""
    digest = hashlib.blake2b(text.encode(), digest_size=DIMENSIONS).digest()
    return [byte / 255.0 for byte in digest]


@dataclass(frozen=True, slots=True)
class Misbehaviour:
    """Probabilities of each fault per request (checked in this order), and their knobs."""

    seed: int = 0
    reset: float = 0.0
    throttle: float = 0.0
    unavailable: float = 0.0
    server_error: float = 0.0
    stall: float = 0.0
    stall_s: float = 0.5
    retry_after: str | None = "1"
    delay_s: float = 0.0
    capacity: int | None = None
    capacity_after: int | None = None  # requests after which ``capacity`` no longer holds
    record_inputs: bool = True  # keep every text's arrival times (off for huge runs)
    required_header: bytes | None = None  # e.g. b"authorization: bearer t"; else 401


@dataclass
class FlakyServer:
    behaviour: Misbehaviour
    port: int = 0
    requests: int = 0
    answered: dict[int, int] = field(default_factory=dict)  # status -> count
    resets: int = 0
    unauthorized: int = 0  # answered 401 (`required_header` missing)
    in_flight: int = 0
    max_in_flight_after_capacity: int = 0
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() per request
    inputs_seen: dict[str, list[float]] = field(default_factory=dict)  # text -> arrivals
    _rng: random.Random = field(init=False)
    _writers: set[asyncio.StreamWriter] = field(init=False, default_factory=set)
    _handlers: set[asyncio.Task[None]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.behaviour.seed)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                required = self.behaviour.required_header
                if required is not None and required.lower() not in head.lower():
                    self.unauthorized += 1
                    writer.write(self._answer(401, _error("unauthorized", "no token")))
                    continue
                response = await self._respond(body)
                if response is None:
                    self.resets += 1
                    writer.transport.abort()
                    return
                writer.write(response)
                await writer.drain()
        except ConnectionError:
            return
        finally:
            self._writers.discard(writer)
            if task is not None:
                self._handlers.discard(task)
            writer.close()

    async def close_connections(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        # Aborted, each handler's read fails and it returns (a stalled one after its stall).
        await asyncio.wait_for(asyncio.gather(*self._handlers, return_exceptions=True), 10)

    async def _respond(self, body: bytes) -> bytes | None:
        behaviour = self.behaviour
        self.requests += 1
        number = self.requests
        now = time.monotonic()
        if behaviour.record_inputs:
            self.arrivals.append(now)
        try:
            texts = orjson.loads(body)["inputs"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            texts = []
        texts = [texts] if isinstance(texts, str) else texts
        for text in texts if behaviour.record_inputs else ():
            self.inputs_seen.setdefault(str(text), []).append(now)
        capacity_holds = behaviour.capacity is not None and (
            behaviour.capacity_after is None or number <= behaviour.capacity_after
        )
        if capacity_holds and self.in_flight >= (behaviour.capacity or 0):
            return self._answer(429, _error("inflight", "too many requests in flight"))
        roll = self._rng.random()
        thresholds = (
            behaviour.reset,
            behaviour.throttle,
            behaviour.unavailable,
            behaviour.server_error,
            behaviour.stall,
        )
        fault = None
        for name, probability in zip(
            ("reset", "throttle", "unavailable", "server_error", "stall"), thresholds, strict=True
        ):
            if roll < probability:
                fault = name
                break
            roll -= probability
        if fault == "reset":
            return None
        if fault == "throttle":
            return self._answer(429, _error("rate", "over the rate"), behaviour.retry_after)
        if fault == "unavailable":
            return self._answer(503, _error("draining", "draining"), behaviour.retry_after)
        if fault == "server_error":
            return self._answer(500, b"Internal Server Error")
        self.in_flight += 1
        if not capacity_holds:
            self.max_in_flight_after_capacity = max(
                self.max_in_flight_after_capacity, self.in_flight
            )
        try:
            delay = behaviour.stall_s if fault == "stall" else behaviour.delay_s
            if delay > 0:
                await asyncio.sleep(delay)
        finally:
            self.in_flight -= 1
        if any(isinstance(text, str) and MARKER_NAN in text for text in texts):
            return self._answer(500, _error("non_finite_output", "the model computed NaN"))
        for index, text in enumerate(texts):
            if not isinstance(text, str) or MARKER_INVALID in text:
                detail = _error("invalid_request", "invalid input", f"inputs[{index}]")
                return self._answer(422, detail)
        outputs = [vector_of(text) for text in texts]
        usage = {"input_tokens": sum(len(t.split()) for t in texts), "inputs": len(texts)}
        return self._answer(
            200, orjson.dumps({"model": "stub", "outputs": outputs, "usage": usage})
        )

    def _answer(self, status: int, body: bytes, retry_after: str | None = None) -> bytes:
        self.answered[status] = self.answered.get(status, 0) + 1
        head = [f"HTTP/1.1 {status} X", "Content-Type: application/json"]
        head.append(f"Content-Length: {len(body)}")
        if retry_after is not None:
            head.append(f"Retry-After: {retry_after}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _error(kind: str, message: str, param: str | None = None) -> bytes:
    return orjson.dumps(error_object(kind, message, param))  # the server's own envelope


@contextlib.contextmanager
def running_flaky_server(behaviour: Misbehaviour) -> Iterator[FlakyServer]:
    """A ``FlakyServer`` serving on 127.0.0.1 in a thread; stopped on exit."""
    server = FlakyServer(behaviour)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        listener = await asyncio.start_server(server._handle, "127.0.0.1", 0, backlog=4096)
        server.port = int(listener.sockets[0].getsockname()[1])
        started.set()
        async with listener:
            await stop.wait()
            await server.close_connections()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    if not started.wait(timeout=10):
        raise RuntimeError("flaky server did not start")
    try:
        yield server
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        loop.close()
