"""Who sent a message to the engine, and how its requests are named.

A front end's socket identity (`frontend_identity`) is how the engine knows it: the key of
its requests and of `EngineStatus.taken_inputs`, and what `FrontEndGone` names when it
dies. It names one process, not a pid: a front end restarted under the same pid (the
kernel reuses them) has another. A request's number is unique only in its front end (each
counts from 1, again after a restart), so every log line and answer that names a request
names it by its reference (`request_reference`): its number at its sender's identity.
Torch-free: front ends import this module.
"""

from __future__ import annotations


def frontend_identity(pid: int, unique: int) -> bytes:
    """A front end's socket identity: its pid and `unique`, which under `steadyserve serve`
    is the token its supervisor started it with (`FrontEndGone` carries both)."""
    return f"fe-{pid}-{unique:x}".encode()


def request_reference(origin: bytes, request_id: int) -> str:
    """Request `request_id` of the sender `origin` (a socket identity), as logs and answers
    name it: `17@fe-4242-3`, `17@inprocess`; the number alone for no sender."""
    sender = origin.decode("ascii", "backslashreplace")
    return f"{request_id}@{sender}" if sender else str(request_id)
