"""The port every front end serves: each binds its own socket to it (SO_REUSEPORT), and the
supervisor first checks nobody else holds it. Supervisor and front-end processes; no state."""

from __future__ import annotations

import socket


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound where other front ends bind too: the kernel spreads connections among
    those listening (SO_REUSEPORT), so no single accept loop is the bottleneck. Not yet
    listening: uvicorn listens once the front end's start-up succeeded (`create_app`), and
    until then the kernel gives this front end no connection."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


def port_problem(host: str, port: int) -> str | None:
    """Why the front ends could not share (host, port), or None. Each front end binds it
    with SO_REUSEPORT: a port some other server holds would make every one of them fail and
    be restarted forever (or, another steadyserve's, silently split its connections), and
    port 0 would give each front end a port of its own."""
    if port == 0:
        return "port 0 (any free port) would give each front end its own: name one"
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        # Without SO_REUSEPORT: the bind fails if anything listens there, ours or not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return f"cannot listen on {host}:{port}: {error.strerror}"
    return None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
