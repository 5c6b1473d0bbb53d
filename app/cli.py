"""`steadyserve serve | check-config | bench | batch | settings | spikes`.

`serve` builds the one `Settings` of the server (from the environment, then flags). In
engine-process mode (the default) it runs the process tree of `processes.py`; with
`STEADY_ENGINE=inprocess` it runs one process. Each front end runs uvicorn with a
drain-aware shutdown: the first SIGTERM/SIGINT turns /readyz to 503, answers new requests
503 and waits (up to `drain_timeout_s`) for every admitted request to be answered before
uvicorn closes its sockets; the process then exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import math
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn
from pydantic import ValidationError
from pydantic_settings import SettingsError
from uvicorn.config import STARTUP_FAILURE

from app.drain import FRONTEND_GRACEFUL_SHUTDOWN_S
from app.limits import lift_open_file_limit
from app.settings import Settings
from app.settings_doc import settings_table

if TYPE_CHECKING:
    # Imported by `serve` at call time: `steadyserve batch` runs on orchestrator machines
    # and loads none of the server.
    from fastapi import FastAPI

    from app.service import Service

log = logging.getLogger("app.cli")


class DrainingServer(uvicorn.Server):
    """uvicorn, draining on `drain_signals` (SIGTERM and SIGINT for a server of its own;
    SIGUSR1 alone for a front end of the process tree, whose parent decides when)."""

    def __init__(
        self,
        config: uvicorn.Config,
        service: Service,
        drain_timeout_s: float,
        quiet_s: float,
        drain_signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
        ignored_signals: tuple[signal.Signals, ...] = (),
    ) -> None:
        super().__init__(config)
        self._drain_signals = drain_signals
        self._ignored_signals = ignored_signals
        self._service = service
        self._drain_timeout_s = drain_timeout_s
        self._quiet_s = quiet_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._drain_requested = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in self._drain_signals}
        previous.update({sig: signal.signal(sig, signal.SIG_IGN) for sig in self._ignored_signals})
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler this does not re-raise the signal after shutdown:
        # a drained server exits 0.
        if self._loop is None or self._drain_requested:
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT
            return
        self._drain_requested = True
        log.info(
            "received %s: draining for up to %.0f s",
            signal.Signals(sig).name,
            self._drain_timeout_s,
        )
        # This runs in a signal handler: hand the work to the loop thread-safely, which
        # also wakes its selector at once.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        self._service.drain.begin()
        await self._service.drain.wait(self._drain_timeout_s, self._quiet_s)
        self.should_exit = True


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def uvicorn_config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    """How a front end runs uvicorn: refusals written by the HTTP protocol itself, before
    any ASGI machinery runs (`api/shedding_protocol.py`), connection limits and keep-alive from
    `settings`, uvicorn's lines in the process's log format, less the warnings any client
    can cause (`api/uvicorn_warnings.py`, installed here)."""
    from app.api.refusal_budget import RefusalBudget  # the server's code: loaded to serve only
    from app.api.shedding_protocol import shedding_protocol
    from app.api.uvicorn_warnings import quiet_client_warnings

    service: Service = app.state.service
    budget = RefusalBudget(settings.refusals_at_once_per_admission)
    quiet_client_warnings()
    return uvicorn.Config(
        app,
        http=shedding_protocol(
            service,
            app.state.shed_paths,
            settings.refused_read_pause_s,
            budget,
            settings.trusted_proxies,
            body_read_timeout_s=settings.body_read_timeout_s,
        ),
        host=settings.host,
        port=settings.port,
        # uvicorn's loggers propagate to the process's handler (its format: time, level,
        # process role and pid), not to handlers of uvicorn's own; their level is still set.
        log_config=None,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_keep_alive=math.ceil(settings.keep_alive_timeout_s),
        # uvicorn's connection cap; the protocol answers it (429 `connections`, counted)
        # in place of uvicorn's own plain-text 503.
        limit_concurrency=settings.max_connections,
        backlog=settings.listen_backlog,
        # A backstop only: by the time uvicorn shuts down, the drain has already waited for
        # every admitted request (see DrainingServer).
        timeout_graceful_shutdown=FRONTEND_GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )


def run_uvicorn(
    app: FastAPI,
    settings: Settings,
    sockets: list[socket.socket] | None = None,
    in_process_tree: bool = False,
) -> int:
    """Serve `app` until drained; 0 unless the server is unhealthy. In the process tree the
    parent asks for the drain (SIGUSR1) and SIGTERM/SIGINT are ignored, so that a signal
    sent to the whole process group does not count twice."""
    service: Service = app.state.service
    config = uvicorn_config(app, settings)
    drain_signals, ignored_signals = (
        ((signal.SIGUSR1,), (signal.SIGTERM, signal.SIGINT))
        if in_process_tree
        else ((signal.SIGTERM, signal.SIGINT), ())
    )
    server = DrainingServer(
        config,
        service,
        settings.drain_timeout_s,
        settings.drain_quiet_s,
        drain_signals=drain_signals,
        ignored_signals=ignored_signals,
    )
    try:
        server.run(sockets=sockets)
    except SystemExit as exit_:
        # uvicorn exits 3 when the app's start-up failed (a front end in the process tree
        # whose tokenizers or engine connection failed): a failed start, status 1.
        if exit_.code != STARTUP_FAILURE:
            raise
        return 1
    return 0 if service.liveness() is None else 1


def settings_problems(error: ValidationError) -> list[str]:
    """One line per invalid setting, named as its environment variable (what an operator
    set), or as the settings when the problem spans several."""
    lines = []
    for problem in error.errors():
        location = problem.get("loc") or ()
        name = f"STEADY_{str(location[0]).upper()}" if location else "settings"
        lines.append(f"{name}: {problem.get('msg', 'invalid')}")
    return lines


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings `serve`'s flags override (those given): they win over the environment."""
    return {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}


class CommandLineError(ValueError):
    """A command line `main` would refuse (check-config reads the server container's)."""


class _RefusingParser(argparse.ArgumentParser):
    """The command line's parser, raising where `main`'s would print and exit."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise CommandLineError(message or f"it exits (status {status}) without serving")


def serve_command_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """The settings the command line `steadyserve <argv>` overrides, parsed by `main`'s own
    parser; raises `CommandLineError` where it runs no `serve` or `main` would refuse it."""
    args, rest = build_parser(_RefusingParser).parse_known_args(list(argv))
    if args.command != "serve":
        raise CommandLineError(f"it runs `{args.command}`, not `serve`")
    if rest:
        raise CommandLineError(f"unrecognized arguments: {' '.join(rest)}")
    return serve_overrides(args)


def serve(args: argparse.Namespace) -> int:
    try:
        settings = Settings(**serve_overrides(args))
    except ValidationError as error:
        for line in settings_problems(error):
            sys.stderr.write(f"steadyserve: {line}\n")
        return 2
    except SettingsError as error:  # a list or object variable that is not JSON
        sys.stderr.write(f"steadyserve: {error} (lists and objects are JSON, e.g. [16, 32])\n")
        return 2
    lift_open_file_limit()  # before any child starts: they inherit it
    if settings.engine == "process":
        from app.processes import serve_processes

        return serve_processes(settings)
    from app.main import create_app

    _configure_logging(settings.log_level)
    return run_uvicorn(create_app(settings), settings)


# Sub-commands with a command line of their own, by the module that runs them. Each module has
# `parse_arguments(argv)` (what its `main` parses, raising SystemExit on a usage error) and
# `main(argv) -> int`; imported by name at call time: these tools are not needed to serve.
DELEGATED = {
    "check-config": "app.checkconfig",
    "bench": "loadtest.cli",
    "batch": "app.batchclient.cli",
    "spikes": "app.spikes.table",
}


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    """The top-level command line: `serve` and `settings` parsed here, the others' arguments
    left for their own modules (`DELEGATED`)."""
    parser = parser_class(prog="steadyserve")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="serve the configured models over HTTP")
    serve_parser.add_argument("--host", help="overrides STEADY_HOST")
    serve_parser.add_argument("--port", type=int, help="overrides STEADY_PORT")
    commands.add_parser("settings", help="print every setting as a Markdown table")
    delegated_help = {
        "check-config": "compare settings, Envoy and k8s files with deploy/baseline.yaml",
        "bench": "load generator (loadtest); `bench compare` runs the comparison",
        "batch": "push a JSONL file through /infer at the server's pace",
        "spikes": "a server's recent slow-request reports as a table",
    }
    for command, module in DELEGATED.items():
        commands.add_parser(command, help=delegated_help.get(command, module), add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("serve", "settings") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        return serve(args)
    if args.command == "settings":
        print(settings_table())
        return 0
    return int(importlib.import_module(DELEGATED[args.command]).main(rest))


if __name__ == "__main__":
    sys.exit(main())
