"""The entry point of one front-end process of `steadyserve serve`'s tree: its signals, its
socket on the shared port and the word it sends its supervisor (`app/processes.py`) once its
start-up succeeded. Runs in the front-end process, before and around uvicorn.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

from app.engine.orphans import die_with_parent
from app.engine.zmq_client import EngineAddresses
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


def drained(exitcode: int | None) -> bool:
    """Whether a front end asked to drain ended as asked: exit 0, or killed by the drain
    signal itself when it came before the front end's start-up had installed its handler
    (a stop right after a front end was started or restarted; it had served nothing)."""
    return exitcode in (0, -DRAIN_OR_STOP)


def run_frontend_process(
    settings: Settings,
    addresses: EngineAddresses,
    processes: int,
    started: Connection,
    parent_pid: int,
    created: int,
) -> None:
    """Entry point of one front-end process. Writes `STARTED` on `started` (the write end of
    its start pipe) once its start-up succeeded: the supervisor counts it as serving from
    then on; a start-up that fails ends the process (exit status 1), which the supervisor
    restarts with backoff. `created`: when the process tree started (the served models'
    `created` on /v1/models, the same in every front end)."""
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

    def on_started(ok: bool) -> None:
        if ok:  # else uvicorn's start-up fails, and run_uvicorn returns 1
            started.send_bytes(STARTED)
        started.close()

    app = create_app(
        settings,
        engine_addresses=addresses,
        frontend_processes=processes,
        on_started=on_started,
        created=created,
    )
    sys.exit(run_uvicorn(app, settings, sockets=[sock], in_process_tree=True))
