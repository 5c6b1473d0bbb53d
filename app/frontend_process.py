"""The entry point of one front-end process of `steadyserve serve`'s tree: its signals, its
socket on the shared port and the word it sends its supervisor (`app/processes.py`) once its
start-up succeeded, then its heartbeats (`StartPipe`, on its event loop). Runs in the
front-end process, before and around uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

from app.engine.orphans import die_with_parent
from app.engine.zmq_client import EngineAddresses
from app.frontend_heartbeats import HEARTBEAT_INTERVAL_S
from app.settings import Settings
from app.shared_port import shared_port_socket


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s",
        stream=sys.stderr,
    )


# How the parent talks to its children: drain (front ends) or stop (the engine). Children
# ignore SIGTERM and SIGINT, which may reach the whole process group at once.
DRAIN_OR_STOP = signal.SIGUSR1

# What a front end writes on its start pipe once its start-up succeeded.
STARTED = b"started"
# What its event loop writes there every `HEARTBEAT_INTERVAL_S` after that (`StartPipe`).
HEARTBEAT = b"beat"


def drained(exitcode: int | None) -> bool:
    """Whether a front end asked to drain ended as asked: exit 0, or killed by the drain
    signal itself when it came before the front end's start-up had installed its handler
    (a stop right after a front end was started or restarted; it had served nothing)."""
    return exitcode in (0, -DRAIN_OR_STOP)


class StartPipe:
    """A front end's end of its start pipe (`started`, the write end), in the front-end
    process, on its event loop: `STARTED` once its start-up succeeded, then a `HEARTBEAT`
    every `interval_s` from a task on that loop, so a loop that blocks (a C extension
    spinning, a deadlock) stops saying it and the supervisor kills the front end
    (`app/frontend_heartbeats.py`); closed with nothing said when its start-up failed."""

    def __init__(self, started: Connection, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._pipe = started
        self._interval_s = interval_s
        self._beats: asyncio.Task[None] | None = None  # held: the loop holds tasks weakly

    def on_started(self, ok: bool) -> None:
        """`create_app`'s `on_started`: called on the front end's event loop once its
        start-up succeeded (`ok`) or failed. The pipe stays open for the heartbeats until
        the process exits."""
        if not ok:  # uvicorn's start-up fails, and run_uvicorn returns 1
            self._pipe.close()
            return
        self._pipe.send_bytes(STARTED)
        self._beats = asyncio.get_running_loop().create_task(self._beat(), name="heartbeat")

    async def _beat(self) -> None:
        """Never blocks the loop: each beat is one write of a few bytes, which a pipe takes
        whole or not at all; a full pipe (the supervisor's own loop held up) drops it, a
        broken one (the supervisor gone: this process dies with it) ends the task."""
        os.set_blocking(self._pipe.fileno(), False)
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self._pipe.send_bytes(HEARTBEAT)
            except BlockingIOError:
                continue
            except OSError:
                return


def run_frontend_process(
    settings: Settings,
    addresses: EngineAddresses,
    processes: int,
    started: Connection,
    parent_pid: int,
    created: int,
    token: int,
    replacing: str | None = None,
) -> None:
    """Entry point of one front-end process. Writes `STARTED` on `started` (the write end of
    its start pipe) once its start-up succeeded, then a `HEARTBEAT` from its event loop every
    `HEARTBEAT_INTERVAL_S`: the supervisor counts it as serving while it hears them, and
    kills it once they stop; a start-up that fails ends the process (exit status 1), which
    the supervisor restarts with backoff (`StartPipe`). `created`: when the process tree
    started (the served models' `created` on /v1/models, the same in every front end);
    `token`: this start's own, in the front end's engine identity (`FrontEndGone`);
    `replacing`: why the front end it replaces ended (`FrontendHeartbeats.replacing`), None
    for a first start."""
    die_with_parent(parent_pid)
    # Until uvicorn installs its handlers: a drain asked for during start-up is a clean
    # exit, and the group's SIGTERM/SIGINT are the parent's to handle.
    signal.signal(DRAIN_OR_STOP, lambda signum, frame: sys.exit(0))
    for ignored in (signal.SIGTERM, signal.SIGINT):
        signal.signal(ignored, signal.SIG_IGN)
    # Imported here: the parent never needs uvicorn's app stack.
    from app.cli import run_uvicorn
    from app.main import create_app

    configure_logging(settings.log_level, f"frontend[{os.getpid()}]")
    # Below the engine: a flood of connections must not take CPU from admitted work.
    os.nice(settings.frontend_nice)
    sock = shared_port_socket(settings.host, settings.port)

    app = create_app(
        settings,
        engine_addresses=addresses,
        frontend_processes=processes,
        on_started=StartPipe(started).on_started,
        created=created,
        spawn_token=token,
        replacing=replacing,
    )
    sys.exit(run_uvicorn(app, settings, sockets=[sock], in_process_tree=True))
