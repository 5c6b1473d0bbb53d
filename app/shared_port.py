"""The port every front end serves: each binds its own socket to it (SO_REUSEPORT), and the
supervisor first checks nobody else holds it, then holds it for them. Supervisor and
front-end processes; no state."""

from __future__ import annotations

import socket


class PortUnavailable(Exception):
    """Why the front ends could not share the port: one line, for the operator."""


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


def reserve_shared_port(host: str, port: int) -> socket.socket:
    """Check that nobody holds (host, port), then hold it for the front ends until the
    returned socket is closed (the supervisor keeps it for its whole life); PortUnavailable
    otherwise. Each front end binds it with SO_REUSEPORT: a port some other server holds
    would make every one of them fail and be restarted forever (or, another steadyserve's,
    silently split its connections), and port 0 would give each front end a port of its own.

    Held, not only checked: the first front end listens only once its start-up succeeded,
    and none does while they all restart; a server that bound the port meanwhile (with
    SO_REUSEADDR it may, next to sockets that do not listen) made each front end's listen
    fail, with a traceback, restarted forever. The reservation never listens (the kernel
    gives it no connection) and has SO_REUSEPORT without SO_REUSEADDR: the front ends'
    sockets join it, anything else is refused the port."""
    if port == 0:
        raise PortUnavailable("port 0 (any free port) would give each front end its own: name one")
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        # Without SO_REUSEPORT: the bind fails if anything listens there, ours or not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _bind(probe, host, port)
    reservation = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        _bind(reservation, host, port)  # taken in the instant since the check: refused too
    except BaseException:
        reservation.close()
        raise
    return reservation


def _bind(sock: socket.socket, host: str, port: int) -> None:
    try:
        sock.bind((host, port))
    except OSError as error:
        raise PortUnavailable(f"cannot listen on {host}:{port}: {error.strerror}") from error


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
