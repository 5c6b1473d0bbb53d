"""The garbage collector after start-up, in every process (no torch here: front ends use it).

Everything alive once a process is ready (the model, tokenizers, torch, transformers,
FastAPI and pydantic modules: hundreds of thousands to millions of objects) is moved out of
the collector's reach. Otherwise every full (generation 2) collection walks all of it,
holding the GIL: in the engine ~200 ms about once a second under load on 2 cores; in a
front end, measured at 64 connections, 14 full collections in 10 s of ~27 ms each (7 % of
its event loop's time), each a latency spike on every request in flight. Objects created
later are collected as usual.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(role: str) -> None:
    """Call once, when the process has finished starting (`role` names it in the log).
    Blocks for one full collection, before the process reports ready."""
    gc.collect()
    gc.freeze()
    log.info("garbage collector (%s): %d start-up objects frozen", role, gc.get_freeze_count())
