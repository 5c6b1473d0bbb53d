"""Failures a request can meet after admission, shared by the engine (where they happen) and
the front end (which answers them). Torch-free."""

from __future__ import annotations


class DeadlineExceeded(Exception):
    """The input's deadline passed (or could no longer be met) before it was computed."""


class BatchFailed(Exception):
    """The batch holding the input failed on the server's side (answered 500)."""


class InputFailed(Exception):
    """The model failed on this input alone while it computes others (answered 400): the
    input is at fault, not the server. Its `__cause__` is what the model raised: for the
    engine's log, never for the client (its text may hold anything, the input included)."""
