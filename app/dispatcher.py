"""The engine's dedicated compute thread pool, which alone runs blocking model work
(threads and who may call what: docs/ARCHITECTURE.md §3).

The event loop never runs model code: it hands work over with `run_compute`
(`loop.run_in_executor` on a named pool) and awaits the result. torch's own intra-op and
inter-op pools are sized explicitly, from settings or else from the cgroup CPU quota, because
torch's default (all host cores) oversubscribes a CPU-limited container. On CUDA each compute
thread gets its own stream, so host-to-device copies of one batch overlap another's compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from app.settings import Settings
from app.settings_rules import default_frontend_processes
from app.telemetry.cgroup import available_cpus

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a job of `run_on_every_compute_thread` waits for every compute thread to be free.
EVERY_THREAD_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    compute_threads: int
    torch_intra_op: int
    torch_inter_op: int
    # The CPUs the plan divides among the compute threads (from `engine_thread_plan`: the
    # quota less the front ends', `engine_cpus`); more threads than these oversubscribe them.
    engine_cpus: int


def plan_threads(
    compute_threads: int | None,
    torch_threads: int | None,
    torch_interop_threads: int | None,
    cpus: int,
) -> ThreadPlan:
    """Two compute threads by default, so one batch is copied in and out while the other
    computes, and the engine's CPUs (`engine_cpus`) shared among their torch teams. With one
    CPU for the engine, one compute thread: a second would only take the batches the first
    leaves, too small to pay for themselves (on 2 CPUs, 1 x 1 served 874-1009 req/s at p99/p50
    1.13-1.24 against 2 x 1's 801-811 at 1.44-1.54, whose batches averaged 15 rows instead of
    32: docs/BENCHMARKS.md). Inter-op gets 1: each compute thread runs one batch at a time."""
    compute = compute_threads or min(2, cpus)
    return ThreadPlan(
        compute_threads=compute,
        torch_intra_op=torch_threads or max(1, cpus // compute),
        torch_inter_op=torch_interop_threads or 1,
        engine_cpus=cpus,
    )


def engine_cpus(cpus: int, frontend_processes: int) -> int:
    """The CPUs the engine's compute threads divide among them: the quota less one per
    front-end process (at least one). Front ends parse and answer while batches run; torch
    threads counted on the whole quota would be the incidents' thread starvation, between
    processes instead of within one."""
    return max(1, cpus - frontend_processes)


def engine_thread_plan(settings: Settings, cpus: int) -> ThreadPlan:
    """The engine's threads under `settings` on a CPU quota of `cpus`: what the engine runs
    and what `steadyserve check-config` counts."""
    return plan_threads(
        compute_threads=settings.dispatcher_threads,
        torch_threads=settings.torch_threads,
        torch_interop_threads=settings.torch_interop_threads,
        cpus=engine_cpus(cpus, settings.frontend_processes(cpus)),
    )


def default_thread_plan(cpus: int) -> ThreadPlan:
    """`engine_thread_plan` with every thread setting left unset, for load tools that start
    a server on `cpus` CPUs and name its layout."""
    return plan_threads(None, None, None, engine_cpus(cpus, default_frontend_processes(cpus)))


_interop_configured = False


def configure_torch_threads(plan: ThreadPlan) -> None:
    """Apply the plan to torch's process-wide pools (inter-op can be set once per process)."""
    global _interop_configured
    torch.set_num_threads(plan.torch_intra_op)
    if not _interop_configured:
        try:
            torch.set_num_interop_threads(plan.torch_inter_op)
        except RuntimeError:
            log.warning(
                "torch inter-op threads were already started; keeping %d",
                torch.get_num_interop_threads(),
            )
        _interop_configured = True
    log.info(
        "torch threads: intra-op %d, inter-op %d (cpus available %d, host cores %s)",
        torch.get_num_threads(),
        torch.get_num_interop_threads(),
        available_cpus(),
        os.cpu_count(),
    )


class Dispatcher:
    """Owns the compute pool. Construct and call from the engine's event loop thread;
    the functions it runs execute on its pool threads."""

    def __init__(
        self, plan: ThreadPlan, device: torch.device, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.plan = plan
        self.device = device
        self._local = threading.local()
        self._clock = clock
        # When each job not yet finished was handed to the pool, by job (loop thread only):
        # a compute that never returns (a wedged GPU) is seen by its age, not by its end.
        self._running: dict[int, float] = {}
        self._jobs = 0
        self.abandoned = False  # shut down without waiting for jobs still running (`shutdown`)
        configure_torch_threads(plan)
        self._compute = ThreadPoolExecutor(
            max_workers=plan.compute_threads,
            thread_name_prefix="steadyserve-compute",
            initializer=self._init_compute_thread,
        )

    @property
    def capacity(self) -> int:
        """Batches that can run at once."""
        return self.plan.compute_threads

    def _init_compute_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._local.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def stream(self) -> torch.cuda.Stream | None:
        """This compute thread's CUDA stream (None on the CPU). Compute threads only."""
        stream: torch.cuda.Stream | None = getattr(self._local, "stream", None)
        return stream

    async def run_compute(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a compute thread. The job counts as running from its hand-off until
        it returns on its thread, whether or not its caller still awaits it (a cancelled
        caller leaves the thread running it)."""
        loop = asyncio.get_running_loop()
        job = self._jobs = self._jobs + 1
        self._running[job] = self._clock()
        try:
            future = self._compute.submit(fn, *args)
        except BaseException:
            del self._running[job]
            raise

        try:
            return await asyncio.wrap_future(future, loop=loop)
        finally:
            if future.done():  # the usual end: no hop back from the compute thread
                self._running.pop(job, None)
            else:  # its caller was cancelled while it runs on: it counts until it ends
                future.add_done_callback(partial(self._forget_when_done, loop, job))

    def _forget_when_done(
        self, loop: asyncio.AbstractEventLoop, job: int, _: Future[object]
    ) -> None:
        """Drop the record of a job whose caller stopped waiting, once it ends: on the
        compute thread that ran it, or here if it ended meanwhile."""
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody reads it
            loop.call_soon_threadsafe(self._running.pop, job, None)

    def oldest_compute_s(self) -> float:
        """How long the oldest job not yet finished has run (0.0: none runs), counted from
        its hand-off: what the engine publishes, for its supervisor to kill an engine whose
        compute never returns (`EngineSupervisor.overdue`). Loop thread."""
        if not self._running:
            return 0.0
        return max(0.0, self._clock() - min(self._running.values()))

    async def run_on_every_compute_thread(self, fn: Callable[..., T], *args: object) -> list[T]:
        """`fn(*args)` once on each compute thread, all at once: warm-up, so that every
        thread (its stream, its first kernels) is set up before traffic reaches it."""
        # Each job holds its thread at the barrier until every thread has taken one, so no
        # thread can take two; the timeout turns a stuck thread into an error, not a hang.
        barrier = threading.Barrier(self.capacity)

        def together() -> T:
            barrier.wait(timeout=EVERY_THREAD_TIMEOUT_S)
            return fn(*args)

        jobs = [self.run_compute(together) for _ in range(self.capacity)]
        return list(await asyncio.gather(*jobs))

    def shutdown(self, wait: bool = True) -> None:
        """Stop the compute threads once the jobs they run return (`wait`), or at once:
        those jobs run on (a model's load cannot be interrupted), `abandoned` says whether
        any did, and the interpreter's exit would wait for them (it joins the pool's threads).
        Jobs queued and not started are dropped. Loop thread."""
        self.abandoned = not wait and bool(self._running)
        self._compute.shutdown(wait=wait, cancel_futures=True)
