"""Start the engine process, and restart it (with backoff) whenever it dies.

Runs in the process that owns the engine: the `steadyserve serve` parent, or a test's app.
Death is seen at once through the process sentinel (readable when the child exits), whatever
killed it: kill -9, a segfault, a fatal CUDA error, an exception at start-up. Front ends
notice on their own (their socket closes) and answer what was in flight with 503s. Until a
new engine is ready, the supervisor publishes why the last one was lost and the restart
under way (`EngineRestart`, on `EngineAddresses.restarts`): every probe answer says it, the
front ends' and its own. Event loop thread of the owning process only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

import zmq

from app.engine.process import (
    DEVICE_LOST_EXIT,
    TASK_ENDED_EXIT,
    CoreFactory,
    run_engine_process,
)
from app.engine.protocol import EngineRestart, EngineStatus, encode
from app.engine.zmq_client import RESTART_HEARTBEAT_S, EngineAddresses
from app.settings import Settings

log = logging.getLogger(__name__)

# An engine ready this long without dying resets the backoff (a front end: serving this
# long, from its start-up's success). Counted from ready, not from its start: an engine (or
# front end) that crash-loops in a warm-up longer than this reset its backoff at every
# death, restarted forever at the first wait.
STABLE_AFTER_S = 60.0
# An engine process imports torch and builds its core before its first status (17 s on a
# loaded 2-CPU machine here). Silent this long after its start, it is stuck before its
# event loop ever ran: a driver call that never returns (`torch.cuda.is_available()` on a
# wedged GPU), say.
FIRST_STATUS_WITHIN_S = 120.0
# An engine killed and still running this long after: stuck in the kernel (a wedged
# driver), where no signal reaches it. Only restarting the pod frees it.
KILL_GRACE_S = 10.0


async def wait_for_exit(process: BaseProcess) -> None:
    """Return once `process` has exited (its sentinel turns readable), without a thread."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(process.sentinel, on_readable)
    try:
        await exited
    finally:
        loop.remove_reader(process.sentinel)
    process.join()


def next_backoff(previous_s: float | None, first_s: float, longest_s: float) -> float:
    """Doubling waits between consecutive restarts, from `first_s` up to `longest_s`."""
    return first_s if previous_s is None else min(longest_s, previous_s * 2)


def loss_reason(pid: int, exitcode: int | None, killed_because: str | None) -> str:
    """Why engine `pid` is gone, for the probes and the log: the supervisor killed it
    (`killed_because`: what `EngineSupervisor.overdue` or the staleness check said), or it
    ended by a signal or with an exit status of its own."""
    if killed_because is not None:
        return f"engine {pid} killed: it {killed_because}"
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"engine {pid} exited by signal {name}"
    if exitcode == DEVICE_LOST_EXIT:
        return f"engine {pid} exited with code {exitcode} (a sticky CUDA error: device lost)"
    if exitcode == TASK_ENDED_EXIT:
        return f"engine {pid} exited with code {exitcode} (a loop of its own ended: see its log)"
    return f"engine {pid} exited with code {exitcode}"


class EngineSupervisor:
    def __init__(
        self,
        settings: Settings,
        addresses: EngineAddresses,
        on_exit: Callable[[int], None] = lambda pid: None,
        run_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        make_core: CoreFactory | None = None,
    ) -> None:
        """`run_dir`, if given, holds the engine's sockets and is removed on `stop`. The
        owner says when it hears the engine ready (`saw_ready`). `make_core` replaces the
        engine's core (`run_engine_process`)."""
        self._settings = settings
        self._make_core = make_core
        self._clock = clock
        self._run_dir = run_dir
        self._addresses = addresses
        self._on_exit = on_exit
        self._context = multiprocessing.get_context("spawn")
        self.process: BaseProcess | None = None
        self.restarts = 0  # engines started after the first try, a failed spawn's included
        self._one_died = False  # an engine started now replaces one that died
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._ready_since: float | None = None  # when the running engine was first heard ready
        self.started_at: float | None = None  # when the running engine was spawned
        # (pid, when, why) of the last engine killed.
        self._killed: tuple[int, float, str] | None = None
        # The restart under way and why the last engine was lost, published to the front
        # ends (`_publish_restart`); None once an engine is heard ready (`saw_ready`).
        self.restart: EngineRestart | None = None
        self._restart_changed = asyncio.Event()
        self._restarts_when_ready = 0  # `restarts` when an engine was last heard ready
        self._publisher: asyncio.Task[None] | None = None

    def saw_ready(self, pid: int) -> None:
        """The engine `pid` published that it is ready (its owner's status subscriber, on
        the event loop thread): from now on its running counts toward a stable engine, and
        no restart is under way. Each ready status of the running engine says so again."""
        process = self.process
        if process is None or process.pid != pid or process.exitcode is not None:
            return  # not the running engine (a dead one's status read late says nothing)
        if self._ready_since is None:
            self._ready_since = self._clock()
        self._restarts_when_ready = self.restarts
        if self.restart is not None:
            self._set_restart(None)

    @property
    def restarts_since_ready(self) -> int:
        """Restarts since an engine was last heard ready: the restart under way's attempt,
        and the supervisor's crash-loop count (`ProcessTree`), one number for both."""
        return self.restarts - self._restarts_when_ready

    def _set_restart(self, restart: EngineRestart | None) -> None:
        self.restart = restart
        self._restart_changed.set()

    def _restarting(self, why: str, backoff_s: float) -> None:
        """An engine was lost (`why`) or could not be started: one more restart, after
        `backoff_s`."""
        self.restarts += 1
        self._set_restart(EngineRestart(why, self.restarts_since_ready, backoff_s))

    def _ran_stable(self) -> bool:
        """Whether the engine that just died had been ready for `STABLE_AFTER_S`."""
        ready_since = self._ready_since
        return ready_since is not None and self._clock() - ready_since >= STABLE_AFTER_S

    def overdue(self, heard: EngineStatus | None) -> str | None:
        """Why the running engine, alive, should be killed as stuck; None while it should
        not. `heard` is its own last status (None: none heard since it started, or since
        its status went stale). Silent since its start past `FIRST_STATUS_WITHIN_S`, or
        loading or warming up past `engine_ready_timeout_s`: its warm-up is never going to
        end. Ready with a compute running past `stuck_compute_s`: a wedged GPU or a driver
        call that never returns, while its loop still publishes (warm-up's computes are
        the ready timeout's). A failed engine is left to the probes (its /healthz is 503)
        and a hung loop to the staleness of its status. On the owner's clock; event loop
        thread."""
        process, started_at = self.process, self.started_at
        if self._stopping or process is None or started_at is None:
            return None
        if self._killed is not None and self._killed[0] == process.pid:
            return None  # killed already: its exit is on its way (or it is stuck: `unkillable`)
        running_s = self._clock() - started_at
        if heard is None:
            if running_s > FIRST_STATUS_WITHIN_S:
                return f"has published nothing in the {running_s:.0f} s since it started"
            return None
        if heard.state not in ("ready", "failed") and self._ready_since is None:
            limit_s = self._settings.engine_ready_timeout_s
            if running_s > limit_s:
                return (
                    f"is still {heard.state} {running_s:.0f} s after it started "
                    f"(STEADY_ENGINE_READY_TIMEOUT_S={limit_s:g})"
                )
        stuck_s = self._settings.stuck_compute_s
        if heard.state == "ready" and heard.oldest_compute_s > stuck_s:
            return (
                f"has had a compute running for {heard.oldest_compute_s:.0f} s, still not "
                f"returned (STEADY_STUCK_COMPUTE_S={stuck_s:g})"
            )
        return None

    def kill(self, why: str) -> None:
        """Kill the running engine, alive but stuck (`why`, for the log): its death is then
        handled as any other's (restarted with backoff, a crash loop counted)."""
        process = self.process
        if process is None or not process.is_alive():
            return
        assert process.pid is not None
        log.error("engine %d %s: killing it", process.pid, why)
        self._killed = (process.pid, self._clock(), why)
        process.kill()

    def unkillable(self) -> str | None:
        """Why the pod must be restarted, if the engine killed `KILL_GRACE_S` ago still
        runs; None otherwise."""
        process, killed = self.process, self._killed
        if killed is None or process is None or process.pid != killed[0]:
            return None
        waited_s = self._clock() - killed[1]
        if waited_s < KILL_GRACE_S or not process.is_alive():
            return None
        return f"engine {killed[0]} still runs {waited_s:.0f} s after it was killed"

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="engine-supervisor")
        if self._addresses.restarts is not None:
            self._publisher = asyncio.create_task(
                self._publish_restart(self._addresses.restarts), name="engine-restarts"
            )

    async def _publish_restart(self, address: str) -> None:
        """Publish `restart` (None: none under way) on each change and every
        `RESTART_HEARTBEAT_S`, till `stop`."""
        context = zmq.Context()
        try:
            publisher = context.socket(zmq.PUB)
            publisher.setsockopt(zmq.LINGER, 0)
            publisher.bind(address)
            while True:
                with contextlib.suppress(zmq.Again):
                    publisher.send(encode(self.restart), zmq.NOBLOCK)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._restart_changed.wait(), RESTART_HEARTBEAT_S)
                self._restart_changed.clear()
        except zmq.ZMQError:  # the probes then say no more than before: not worth a stop
            log.exception("the engine's restarts cannot be published")
        finally:
            context.destroy(linger=0)

    def _spawn(self) -> BaseProcess:
        process = self._context.Process(
            target=run_engine_process,
            args=(self._settings, self._addresses, os.getpid(), self._one_died, self._make_core),
            name="steadyserve-engine",
            daemon=True,
        )
        process.start()
        log.info("engine process started (pid %d)", process.pid)
        return process

    async def _supervise(self) -> None:
        backoff: float | None = None
        while not self._stopping:
            self._ready_since = self.started_at = None
            try:
                self.process = process = self._spawn()
                self.started_at = self._clock()
            except Exception as error:
                # The pid limit, memory, /dev/shm full: a failed spawn is a failed restart,
                # retried with backoff; ending this task would leave no engine, silently.
                log.exception("the engine process could not be started")
                first, longest = self._settings.engine_restart_backoff_s
                backoff = next_backoff(backoff, first, longest)
                why = f"the engine process could not be started ({type(error).__name__})"
                self._restarting(why, backoff)
                await asyncio.sleep(backoff)
                continue
            await wait_for_exit(process)
            assert process.pid is not None
            self._one_died = True
            self._on_exit(process.pid)
            if self._stopping:
                return
            if self._ran_stable():
                backoff = None
            first, longest = self._settings.engine_restart_backoff_s
            backoff = next_backoff(backoff, first, longest)
            killed = self._killed
            why = loss_reason(
                process.pid,
                process.exitcode,
                killed[2] if killed is not None and killed[0] == process.pid else None,
            )
            self._restarting(why, backoff)
            log.error("%s; restarting in %.1f s", why, backoff)
            await asyncio.sleep(backoff)

    def stop_restarting(self) -> None:
        """No restart from now on (the server is stopping): an engine that dies while the
        front ends drain is not replaced by one that would load the model only to be
        stopped mid-load, past the pod's grace period."""
        self._stopping = True

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine (SIGUSR1: it finishes what it runs), killing it after
        `timeout_s`; no restart follows."""
        self._stopping = True
        process = self.process
        if process is not None and process.is_alive():
            assert process.pid is not None
            os.kill(process.pid, signal.SIGUSR1)
            await asyncio.to_thread(process.join, timeout_s)
            if process.is_alive():
                log.warning("engine did not stop in %.0f s; killing it", timeout_s)
                process.kill()
                await asyncio.to_thread(process.join, 5)
        for task in (self._task, self._publisher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
