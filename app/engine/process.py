"""The engine process: an `EngineCore` served over ZeroMQ.

A ROUTER socket takes requests from every front end (each frame tagged with the sender's
identity, so outputs go back to the front end that asked); a PUB socket publishes the
engine's status within milliseconds of a change, and at least every `STATUS_HEARTBEAT_S`.
`run_engine_process` is the entry point the supervisor starts (a fresh interpreter:
`spawn`); everything else runs on the engine's event loop thread, and compute on the
dispatcher's threads. A `CoreFactory` given to it replaces the `EngineCore` it serves (the
front-end cost bench's engine with a null model: `loadtest/null_model.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from app.engine.health import BatchHealth
from app.engine.orphans import die_with_parent
from app.engine.protocol import (
    Cancel,
    DebugQuery,
    DebugReply,
    EngineStatus,
    Failure,
    FailureKind,
    FromEngine,
    FrontEndGone,
    ModelInfo,
    Submit,
    ToEngine,
    decode_to_engine,
    encode,
    encode_batch,
    request_to_answer,
)
from app.engine.zmq_client import STATUS_HEARTBEAT_S, STATUS_INTERVAL_S, EngineAddresses
from app.metrics import Metrics
from app.settings import Settings

if TYPE_CHECKING:
    from app.engine.core import EngineCore

log = logging.getLogger(__name__)

# Builds the core an engine process serves, in that process, from its settings and metrics;
# picklable (a module-level function, or a partial of one): the process is spawned.
CoreFactory = Callable[[Settings, Metrics], "EngineCore"]

# Engine-side gauges (queue depth, pool slots) are refreshed this often, not on every tick.
GAUGE_INTERVAL_S = 0.25

# A model's published wait (`ModelQueue.backlog_s`) is sent again only once it moved more
# than the larger of these since it was last sent: a decoding generate model's next
# step, from its step time averaged over every step, is in every other model's wait,
# and had a status sent at every tick (~200 a second) with nothing else changed. Front ends'
# figure is off by at most that (2 ms of a 100 ms budget) until a status is sent.
WAIT_TOLERANCE_S = 0.001
WAIT_TOLERANCE_SHARE = 0.02

# The exit status of an engine whose CUDA context a sticky error made unusable.
DEVICE_LOST_EXIT = 3
# After a batch lost the device, the engine serves on this long before it exits: the failed
# batch's requests are answered within a few loop turns (their rows failed before health
# heard of the loss; a generation step's once its loop reads the failure).
DEVICE_LOST_ANSWER_S = 0.05
# Then how long the exit waits for what was sent to leave the sockets (ZeroMQ's linger).
DEVICE_LOST_LINGER_S = 1.0
# The exit status of an engine stopped because its request or status loop ended on its own
# (`EngineServer._on_task_end`: a bug, logged with its traceback). It exited 0, read as a
# clean exit by whoever looked.
TASK_ENDED_EXIT = 4


def exit_when_device_lost(
    health: BatchHealth,
    exit_process: Callable[[int], object] = os._exit,
    before_exit: Callable[[], object] = lambda: None,
    answer_s: float = DEVICE_LOST_ANSWER_S,
) -> None:
    """Have the engine process exit when a batch fails with a sticky CUDA error
    (`health.device_lost`), so that its supervisor starts a fresh engine with a fresh CUDA
    context. Otherwise it ran on with a dead one: every batch failed (500, after a triage
    run that failed too) while `/readyz` still said ready, until enough failures turned
    `/healthz` 503 and Kubernetes restarted the whole pod. Not at once, in the call that
    recorded the failure: that cut the failed batch's own answers (500 `device_lost`: not to
    be resent unchanged), and its requests were answered the retryable 503 `engine_lost` of
    every request the exit leaves, so a client resent the input that took the engine down
    to each fresh one. The exit comes `answer_s` later, on the event loop, after
    `before_exit` (the server sends what is pending and closes its sockets, waiting up to
    `DEVICE_LOST_LINGER_S` for it to leave); should the loop not run it, a watchdog thread
    exits `answer_s` plus that linger and a second later. Exits once."""
    exited = threading.Lock()

    def exit_once() -> None:
        if exited.acquire(blocking=False):
            exit_process(DEVICE_LOST_EXIT)

    def exit_after_sends() -> None:
        try:
            before_exit()
        except Exception:
            log.exception("engine: sending the last answers before the exit failed")
        exit_once()

    def exit_soon() -> None:
        log.critical(
            "engine: a batch failed with a sticky CUDA error; the CUDA context is unusable: "
            "exiting (%d) in %.0f ms, once that batch's requests are answered, for the "
            "supervisor to start a fresh engine",
            DEVICE_LOST_EXIT,
            answer_s * 1000,
        )
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop (none answers anything): at once
            exit_after_sends()
            return
        watchdog = threading.Timer(answer_s + DEVICE_LOST_LINGER_S + 1.0, exit_once)
        watchdog.daemon = True
        watchdog.start()
        loop.call_later(answer_s, exit_after_sends)

    health.on_device_lost = exit_soon


class EngineServer:
    """Carries protocol messages between the sockets and the core. Event loop thread only."""

    def __init__(
        self,
        core: EngineCore,
        addresses: EngineAddresses,
        exit_process: Callable[[int], object] = os._exit,
    ) -> None:
        """`exit_process`: how the process exits when its device is lost (tests inject it)."""
        self.core = core
        exit_when_device_lost(core.health, exit_process, before_exit=self._send_and_close)
        self._context = zmq.asyncio.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(addresses.requests)
        self._pending: dict[bytes, list[FromEngine]] = {}
        self._flush_scheduled = False
        self._publisher = self._context.socket(zmq.PUB)
        self._publisher.setsockopt(zmq.LINGER, 0)
        self._publisher.bind(addresses.status)

    def _emitter(self, origin: bytes) -> Callable[[FromEngine], None]:
        def emit(message: FromEngine) -> None:
            pending = self._pending.setdefault(origin, [])
            pending.append(message)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)

        return emit

    def _flush(self) -> None:
        """Send what was emitted during one loop turn, one frame per front end: a
        generation step emits an output per sequence, and a frame each would cost both
        sides a send and a receive per token."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for origin, messages in pending.items():
            self._router.send_multipart([origin, encode_batch(messages)], zmq.NOBLOCK)

    def _send_and_close(self) -> None:
        """Before the engine exits for a lost device: send what is pending, then close the
        sockets, waiting up to `DEVICE_LOST_LINGER_S` for the sends to reach the front ends
        (the exit that follows would drop what ZeroMQ's I/O thread still holds)."""
        self._flush()
        self._context.destroy(linger=int(DEVICE_LOST_LINGER_S * 1000))

    async def serve(self, stop: asyncio.Event) -> int:
        """Serve until `stop` is set; the process's exit status: 0, or `TASK_ENDED_EXIT`
        when a loop's end on its own set it."""
        startup = asyncio.create_task(self.core.start(), name="engine-startup")
        tasks = [
            asyncio.create_task(self._receive(), name="engine-requests"),
            asyncio.create_task(self._publish(), name="engine-status"),
        ]
        for task in tasks:
            # Either ending on its own (a bug) leaves an engine that takes no request or
            # publishes no status: stop, so the supervisor starts a fresh one.
            task.add_done_callback(lambda done: self._on_task_end(done, stop))
        try:
            await stop.wait()
        finally:
            ended = any(task.done() for task in tasks)  # before any was cancelled here
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not startup.done():
                startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            await self.core.stop()
            self._context.destroy(linger=0)
        return TASK_ENDED_EXIT if ended else 0

    @staticmethod
    def _on_task_end(task: asyncio.Task[None], stop: asyncio.Event) -> None:
        if task.cancelled() or stop.is_set():
            return
        log.critical(
            "engine: %s ended; stopping the engine",
            task.get_name(),
            exc_info=task.exception(),
        )
        stop.set()

    async def _receive(self) -> None:
        """Take every front end's messages. One that fails (a bug, or a message this engine
        cannot read) is logged and answered with a failure where its request id can be
        read (`request_to_answer`), else dropped (its request waits out the front end's
        `ANSWER_GRACE_S`): it must not end this loop, which would leave every later request
        unanswered while the status still says ready."""
        while True:
            frames = await self._router.recv_multipart()
            origin = frames[0]
            try:
                if len(frames) != 2:
                    raise ValueError(f"{len(frames) - 1} frames where one message is one")
                message = decode_to_engine(frames[1])
            except Exception:
                log.exception("engine: a message from %r could not be read", origin)
                request_id = request_to_answer(frames[1]) if len(frames) == 2 else None
                if request_id is None:
                    log.error("engine: no request id in it to answer: dropped")
                else:
                    unread = "engine: the request could not be read (another version?)"
                    self._emitter(origin)(Failure(request_id, FailureKind.FAILED, unread))
                continue
            try:
                self._handle(origin, message)
            except Exception as error:
                log.exception("engine: a message from %r failed", origin)
                if isinstance(message, Submit | DebugQuery):
                    failure = Failure(message.request_id, FailureKind.FAILED, f"engine: {error}")
                    self._emitter(origin)(failure)

    def _handle(self, origin: bytes, message: ToEngine) -> None:
        if isinstance(message, Submit):
            self.core.submit(origin, message, self._emitter(origin))
        elif isinstance(message, Cancel):
            self.core.cancel(origin, message.request_id)
        elif isinstance(message, FrontEndGone):
            self.core.frontend_gone(message.pid, message.token)
        elif isinstance(message, DebugQuery):
            try:
                report = self.core.debug_report(message.what)
            except ValueError as error:
                report = {"error": str(error)}
            self._emitter(origin)(DebugReply(message.request_id, report))

    async def _publish(self) -> None:
        """Every `STATUS_INTERVAL_S`, send the status if it changed (`worth_publishing`:
        its time aside, a model's wait within tolerance), or if `STATUS_HEARTBEAT_S` passed
        since the last one sent: a decoding batch changes little front ends read, and
        sending the same status 200 times a second took CPU from it."""
        loop = asyncio.get_running_loop()
        # A plain socket over the same one: a zmq.asyncio send makes a future per message,
        # which doubled the cost of each (24 us against 11 us, measured here).
        publisher: zmq.Socket[bytes] = zmq.Socket.shadow(self._publisher.underlying)
        next_gauges = 0.0
        sent: EngineStatus | None = None
        while True:
            status = self.core.status()
            if worth_publishing(status, sent):
                publisher.send(encode(status), zmq.NOBLOCK)
                sent = status
            if loop.time() >= next_gauges:
                self.core.refresh_gauges()
                next_gauges = loop.time() + GAUGE_INTERVAL_S
            await self.core.telemetry.sleep(STATUS_INTERVAL_S)


def worth_publishing(status: EngineStatus, last_sent: EngineStatus | None) -> bool:
    """Whether to send `status`: it differs from the last one sent in more than its time,
    the age of its oldest compute (which grows at every tick while a batch runs) and its
    models' waits moved within tolerance (`WAIT_TOLERANCE_S`), or that one is
    `STATUS_HEARTBEAT_S` old. Pure."""
    if last_sent is None or status.published_at - last_sent.published_at >= STATUS_HEARTBEAT_S:
        return True
    unchanged = msgspec.structs.replace(
        status,
        published_at=last_sent.published_at,
        oldest_compute_s=last_sent.oldest_compute_s,
        models=_waits_as_sent(status.models, last_sent.models),
    )
    return unchanged != last_sent


def _waits_as_sent(
    models: dict[str, ModelInfo], sent: dict[str, ModelInfo]
) -> dict[str, ModelInfo]:
    """`models`, each queue's wait that moved within tolerance since `sent` as it was sent."""
    settled = {}
    for name, info in models.items():
        queue, before = info.queue, sent.get(name)
        was = before.queue if before is not None else None
        if queue is not None and was is not None and queue.backlog_s != was.backlog_s:
            tolerance = max(WAIT_TOLERANCE_S, WAIT_TOLERANCE_SHARE * was.backlog_s)
            if abs(queue.backlog_s - was.backlog_s) <= tolerance:
                queue = msgspec.structs.replace(queue, backlog_s=was.backlog_s)
                info = msgspec.structs.replace(info, queue=queue)
        settled[name] = info
    return settled


async def _serve(
    settings: Settings,
    addresses: EngineAddresses,
    replacement: bool,
    make_core: CoreFactory | None,
) -> tuple[int, bool]:
    """The exit status, and whether a compute thread still runs a job the stop did not wait
    for (a load: `EngineCore.stop` before the engine was ready)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Only the supervisor stops the engine (SIGUSR1), after the front ends drained: a
    # SIGTERM or Ctrl-C sent to the whole process group must not cut the engine first.
    loop.add_signal_handler(signal.SIGUSR1, stop.set)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from app.engine.core import EngineCore  # torch: only in the engine process

    metrics = Metrics()
    if replacement:
        # Counted by the new engine: a counter outlives its process in multiprocess mode,
        # so the total over processes is the number of restarts.
        metrics.engine_restarts.inc()
    core = EngineCore(settings, metrics) if make_core is None else make_core(settings, metrics)
    status = await EngineServer(core, addresses).serve(stop)
    return status, core.dispatcher.abandoned


def run_engine_process(
    settings: Settings,
    addresses: EngineAddresses,
    parent_pid: int,
    replacement: bool = False,
    make_core: CoreFactory | None = None,
) -> None:
    """Entry point of the engine process (spawned by the supervisor, `parent_pid`);
    `replacement` when it replaces one that died; `make_core` builds the core instead of
    `EngineCore(settings, metrics)`."""
    die_with_parent(parent_pid)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s",
        stream=sys.stderr,
    )
    status, abandoned = 0, False
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop

            status, abandoned = uvloop.run(_serve(settings, addresses, replacement, make_core))
        except ImportError:
            status, abandoned = asyncio.run(_serve(settings, addresses, replacement, make_core))
    if abandoned:
        # Stopped while it loaded: the interpreter's exit would join the compute thread, and
        # so wait for the load (until the supervisor's stop killed it). Its sockets are closed.
        log.info("engine: stopped before it was ready; exiting without the load under way")
        logging.shutdown()
        os._exit(status)
    if status:
        sys.exit(status)  # the supervisor names it (`supervisor.loss_reason`)
