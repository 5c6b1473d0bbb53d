"""`steadyserve serve` in engine-process mode: the process tree and its signals.

```
steadyserve serve (this module: supervises, no torch, no traffic)
├── engine          the model, buffer pools, scheduler, dispatcher threads (restarted on death)
└── front end x N   uvicorn + FastAPI on one port (SO_REUSEPORT), niced below the engine
```

The parent sets prometheus_client's multiprocess directory before any child starts: every
process's metrics appear on /metrics of any front end and of the probe port. On SIGTERM or
SIGINT it asks the front ends to drain (each answers what it admitted, then exits), then
stops the engine; a second signal stops everything at once. Front ends that die are restarted
too, and so are those whose event loop went silent (killed: `app/frontend_heartbeats.py`).
Runs on the parent's event loop thread (each front end starts in `app/frontend_process.py`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import zmq
import zmq.asyncio

from app.crash_loop import FrontendCrashLoops, crash_loop
from app.drain import ENGINE_STOP_S, STOP_MARGIN_S
from app.engine.process import CoreFactory
from app.engine.protocol import EngineStatus, FrontEndGone, encode
from app.engine.supervisor import EngineSupervisor, next_backoff, wait_for_exit
from app.engine.zmq_client import (
    STALE_AFTER_S,
    STATUS_WENT_STALE,
    EngineAddresses,
    StatusSubscriber,
    send_now,
)
from app.frontend_heartbeats import FrontendHeartbeats
from app.frontend_process import HEARTBEAT, STARTED, configure_logging, run_frontend_process
from app.metrics_archive import MULTIPROCESS_DIR_ENV, forget_dead_process
from app.metrics_render import scrape_processes
from app.probes import ProbeListener, liveness, probe_response, readiness
from app.run_dir import run_directory
from app.settings import Settings
from app.shared_port import PortUnavailable, reserve_shared_port
from app.stopping import drain_frontends, drained_all, kill_now
from app.telemetry.cgroup import available_cpus

log = logging.getLogger(__name__)


# How often the supervisor looks whether its engine is stuck (`ProcessTree._check_engine`)
# or a front end hung (`ProcessTree._check_frontends`).
CHECK_INTERVAL_S = 1.0


class ProcessTree:
    """The engine and the front ends of one server. Parent's event loop thread only."""

    def __init__(
        self,
        settings: Settings,
        run_dir: Path,
        clock: Callable[[], float] = time.monotonic,
        make_core: CoreFactory | None = None,
    ) -> None:
        """`clock` times how long each child has served (its restart backoff resets after
        `STABLE_AFTER_S` of it) and each front end's silence; `make_core`: see
        `run_engine_process`."""
        self.settings = settings
        self.run_dir = run_dir
        self.addresses = EngineAddresses.in_directory(run_dir)
        self.frontend_count = settings.frontend_processes(available_cpus())
        self.created = int(time.time())  # /v1/models' `created`, the same in every front end
        self._context = multiprocessing.get_context("spawn")
        self._clock = clock
        self.engine = EngineSupervisor(
            settings, self.addresses, on_exit=self._engine_exited, clock=clock, make_core=make_core
        )
        self.frontends: list[BaseProcess] = []
        # What the supervisor heard on each front end's start pipe (its start-up, heartbeats).
        self._heartbeats = FrontendHeartbeats(clock)
        self._frontend_loops = FrontendCrashLoops(self._heartbeats, clock)  # and their restarts
        self.hung_frontends = 0  # front ends killed for their silence (the log counts them)
        self._frontend_tokens: dict[int, int] = {}  # each live one's start token, by its pid
        self._metric_folds: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._forced = False
        self._stop_requested = asyncio.Event()
        self._zmq = zmq.asyncio.Context()
        self._engine_status = StatusSubscriber(
            self._zmq,
            self.addresses.status,
            clock,
            on_lost=self._engine_lost,
            on_status=self._engine_said,
        )
        # The supervisor's own line to the engine, only to say a front end died (`run`).
        self._engine_notices: zmq.asyncio.Socket | None = None
        self._probes = (
            ProbeListener(settings.host, settings.health_port, self._answer_probe, scrape_processes)
            if settings.health_port is not None
            else None
        )

    def _answer_probe(self, path: str) -> tuple[int, bytes]:
        """The verdicts a front end would give, from the supervisor's view: the engine's
        published status, whether any front end serves (alive, started, heartbeating: one
        whose loop hung takes connections it never answers), whether it is stopping."""
        engine = self._running_engine_status()
        can_serve = any(
            process.is_alive() and self._heartbeats.heartbeating(index)
            for index, process in enumerate(self.frontends)
        )
        ready = readiness(engine, None, self._stopping, can_serve, self.engine.restart)
        pod_problem = self._crash_loop() or self.engine.unkillable()
        return probe_response(path, ready, liveness(engine, pod_problem))

    def _running_engine_status(self) -> EngineStatus | None:
        """The running engine's own last status; None while none was heard from it (a dead
        engine's last word says nothing of its replacement). Reading it checks its age: an
        engine silent for `STALE_AFTER_S` is killed (`_engine_lost`)."""
        process = self.engine.process
        if process is None or not process.is_alive():
            return None
        engine = self._engine_status.status()
        return engine if engine is not None and engine.pid == process.pid else None

    def _check_engine(self) -> None:
        """Kill the engine if it is alive but stuck (`EngineSupervisor.overdue`, or silent
        `STALE_AFTER_S` since its last status); the supervisor restarts it with backoff.
        Every `CHECK_INTERVAL_S` (`_watch_children`), not only when a probe asks:
        without `STEADY_HEALTH_PORT` nothing asked, and a hung engine was never replaced."""
        if self._stopping:
            return
        why = self.engine.overdue(self._running_engine_status())
        if why is not None:
            self.engine.kill(why)

    def _check_frontends(self) -> None:
        """SIGKILL each front end alive but silent (`FrontendHeartbeats.overdue`: its loop
        is hung); `_keep_frontend` sees it die and restarts it with backoff. Every
        `CHECK_INTERVAL_S` (`_watch_children`); not while stopping (the drain has its own
        deadline). Each is this supervisor's own child, killed by its pid."""
        if self._stopping:
            return
        for index, process in enumerate(self.frontends):
            why = self._heartbeats.overdue(index)
            if why is None or not process.is_alive():
                continue
            self._heartbeats.give_up(index)
            self.hung_frontends += 1
            log.error(
                "front end %d %s: killing it (hung #%d)", process.pid, why, self.hung_frontends
            )
            process.kill()

    def _start_watchers(self) -> list[asyncio.Task[None]]:
        """What keeps the tree whole while it serves: a task per front end (restarted when it
        dies) and the stuck checks (`_watch_children`). Cancelled at the stop."""
        watchers = [
            asyncio.create_task(self._keep_frontend(index)) for index in range(self.frontend_count)
        ]
        watchers.append(asyncio.create_task(self._watch_children(), name="children-watch"))
        return watchers

    async def _watch_children(self) -> None:
        while not self._stopping:
            await asyncio.sleep(CHECK_INTERVAL_S)
            self._check_engine()
            self._check_frontends()

    def _crash_loop(self) -> str | None:
        """Why the pod should be restarted, if its engine keeps dying without being ready or
        every front end without serving (`app/crash_loop.py`)."""
        engine = crash_loop(self.engine.restarts_since_ready, "the engine", "becoming ready")
        return engine or self._frontend_loops.problem(len(self.frontends))

    def _engine_exited(self, pid: int) -> None:
        self._engine_status.forget()
        # Kept until done (the loop holds tasks weakly); its thread is waited for at exit.
        task = asyncio.create_task(forget_dead_process(pid))
        self._metric_folds.add(task)
        task.add_done_callback(self._metric_folds.discard)

    def _engine_said(self, status: EngineStatus) -> None:
        if status.state == "ready":
            # Heard here, not only when a probe asks: without a probe port, engines that
            # died now and then over a long life read as a crash loop at exit.
            self.engine.saw_ready(status.pid)

    def _engine_lost(self, why: str) -> None:
        """An engine whose status went silent while its process lives has a hung event loop
        (seen by `_check_engine` or a probe): kill it; the supervisor starts a fresh one."""
        if why == STATUS_WENT_STALE and not self._stopping:
            self.engine.kill(f"has published nothing for {STALE_AFTER_S:g} s (a hung loop)")

    def _spawn_frontend(self, index: int) -> None:
        # A pipe, not a shared flag: its end turns readable the moment the front end says it
        # started, beats, or dies, so the supervisor times them on its own clock.
        heard, started = self._context.Pipe(duplex=False)
        frontend = (self.settings, self.addresses, self.frontend_count, started, os.getpid())
        token = time.monotonic_ns()  # this start's own, in its engine identity (FrontEndGone)
        process = self._context.Process(
            target=run_frontend_process,
            args=(*frontend, self.created, token, self._heartbeats.replacing(index)),
            name="steadyserve-frontend",
        )
        try:
            process.start()
        except BaseException:
            heard.close()
            raise
        finally:
            started.close()  # the child's copy is the only one left: its death is EOF
        assert process.pid is not None
        self._frontend_tokens[process.pid] = token
        if index == len(self.frontends):
            self.frontends.append(process)
        else:
            self.frontends[index] = process
        self._heartbeats.spawned(index)
        asyncio.get_running_loop().add_reader(
            heard.fileno(), self._heard_frontend, index, process, heard
        )

    def _heard_frontend(self, index: int, process: BaseProcess, heard: Connection) -> None:
        """The start pipe of front end `index` turned readable: `STARTED`, a `HEARTBEAT`,
        or EOF (its death), after which it is closed. A message is one write of a few
        bytes, whole once readable: reading it never blocks the loop."""
        try:
            said = heard.recv_bytes()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(heard.fileno())
            heard.close()
            return
        if said == STARTED:
            self._frontend_started(index, process)
        elif said == HEARTBEAT and self.frontends[index] is process:
            self._heartbeats.beat(index)

    def _frontend_started(self, index: int, process: BaseProcess) -> None:
        """Front end `index` (`process`) said its start-up succeeded: it serves from now."""
        if self.frontends[index] is process:  # not a replaced one's late word
            self._heartbeats.started(index)

    async def run(self) -> int:
        """Serve until a signal; the exit status. 2, with nothing started, when the probe
        port cannot be served; should anything fail once children run, they are killed
        before the error propagates (they ignore SIGTERM, and the interpreter's exit
        would wait on them forever)."""
        if self._probes is not None:
            try:
                await self._probes.start()
            except OSError as error:
                log.error("cannot serve the probes: %s", error)
                self._zmq.destroy(linger=0)
                return 2
        try:
            return await self._serve()
        except BaseException:
            kill_now([*self.frontends, self.engine.process], reap=True)
            self._zmq.destroy(linger=0)
            raise

    async def _serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.engine.start()
        self._engine_notices = self._zmq.socket(zmq.DEALER)
        self._engine_notices.setsockopt(zmq.IMMEDIATE, 1)
        self._engine_notices.setsockopt(zmq.LINGER, 0)
        self._engine_notices.connect(self.addresses.requests)
        for index in range(self.frontend_count):
            self._spawn_frontend(index)
        self._engine_status.start()
        log.info(
            "serving on %s:%d: engine + %d front ends (niceness +%d)",
            self.settings.host,
            self.settings.port,
            self.frontend_count,
            self.settings.frontend_nice,
        )
        watchers = self._start_watchers()
        await self._stop_requested.wait()
        await self._stop_children(time.monotonic() + self.settings.drain_timeout_s + STOP_MARGIN_S)
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        if self._probes is not None:
            await self._probes.close()
        await self._engine_status.close()
        self._zmq.destroy(linger=0)
        return self.exit_status()

    def exit_status(self) -> int:
        """The server's exit status once stopped: 1 when a front end ended badly on its own
        (unhealthy, failed start-up) or the tree was crash-looping (Kubernetes probes no
        liveness before start-up succeeds, so such a pod is stopped, not found unhealthy:
        its exit must say it failed); being stopped at once on a second signal is what the
        operator asked for."""
        clean = drained_all(self.frontends) and self._crash_loop() is None
        return 0 if self._forced or clean else 1

    def _on_signal(self, sig: int) -> None:
        if self._stopping:
            log.warning("second %s: stopping at once", signal.Signals(sig).name)
            self._forced = True
            kill_now([*self.frontends, self.engine.process], reap=False)
            return
        self._stopping = True
        self.engine.stop_restarting()
        log.info("received %s: draining the front ends", signal.Signals(sig).name)
        self._stop_requested.set()

    async def _stop_children(self, stop_by: float) -> None:
        """Drain the front ends, then stop the engine, all by `stop_by` (hung ones killed):
        one budget, which the pod's grace period covers (deploy/k8s: preStop + drain +
        margin); waits of their own for each (70 s for the front ends, 10 for the engine)
        added up past it, and the kubelet's SIGKILL left the run directory behind."""
        await drain_frontends(self.frontends, stop_by - ENGINE_STOP_S)
        await self.engine.stop(timeout_s=max(1.0, stop_by - time.monotonic()))

    async def _keep_frontend(self, index: int) -> None:
        """Restart a front end that dies (with backoff), until the server stops."""
        backoff: float | None = None
        while True:
            process = self.frontends[index]
            await wait_for_exit(process)
            if self._stopping:
                return
            assert process.pid is not None
            self._tell_engine_frontend_gone(process.pid)
            await forget_dead_process(process.pid)
            if self._frontend_loops.died(index):  # had served stable: no crash loop
                backoff = None
            first, longest = self.settings.engine_restart_backoff_s
            backoff = next_backoff(backoff, first, longest)
            log.error(
                "front end %d exited with %s; restarting in %.1f s",
                process.pid,
                process.exitcode,
                backoff,
            )
            while True:
                await asyncio.sleep(backoff)
                if self._stopping:
                    return
                try:
                    self._spawn_frontend(index)
                    break
                except Exception:
                    # As for the engine (`EngineSupervisor`): retried, never given up on.
                    log.exception("front end %d could not be restarted", index)
                    backoff = next_backoff(backoff, first, longest)

    def _tell_engine_frontend_gone(self, pid: int) -> None:
        """The engine drops the work of the front end's requests (`FrontEndGone`); with no
        engine connected there is nothing to drop (a new engine knows none of it)."""
        assert self._engine_notices is not None
        token = self._frontend_tokens.pop(pid)
        if not send_now(self._engine_notices, encode(FrontEndGone(pid, token))):
            log.info("front end %d exited while no engine was connected", pid)


def serve_processes(settings: Settings, make_core: CoreFactory | None = None) -> int:
    """Run the engine (its core made by `make_core` if given: `loadtest/null_engine.py`) and
    the front ends until a signal; returns the exit status (2: the port cannot be served)."""
    configure_logging(settings.log_level, "supervisor")
    try:
        reservation = reserve_shared_port(settings.host, settings.port)
    except PortUnavailable as problem:
        log.error("%s", problem)
        return 2
    # The run directory is removed on the way out; one a killed supervisor left is removed
    # by the next to start.
    with reservation, run_directory() as run_dir:
        metrics_dir = run_dir / "metrics"
        metrics_dir.mkdir()
        # Before any child starts: each reads it when it first imports prometheus_client.
        os.environ[MULTIPROCESS_DIR_ENV] = str(metrics_dir)
        return asyncio.run(ProcessTree(settings, run_dir, make_core=make_core).run())
