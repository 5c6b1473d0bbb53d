"""The garbage collector after start-up, in every process (no torch here: front ends use it).

Everything alive once a process is ready (the model, tokenizers, torch, transformers,
FastAPI and pydantic modules: hundreds of thousands to millions of objects) is moved out of
the collector's reach. Otherwise every full (generation 2) collection walks all of it,
holding the GIL: in the engine ~200 ms about once a second under load on 2 cores; in a
front end, measured at 64 connections, 14 full collections in 10 s of ~27 ms each (7 % of
its event loop's time), each a latency spike on every request in flight. Objects created
later are collected as usual.

The first generation's threshold is raised too. It counts container objects allocated minus
those freed, and a front end at 64 connections holds more than the default 700 in flight
at any time, so it collected 160 times a second (plus a generation-1 collection of ~1.3 ms
every tenth): 0.4 s of every 10 s on its loop. At `GEN0_THRESHOLD` the same load collected
twice in 10 s. Request objects are freed by reference counting; what the collector is for
here, cycles, is rare, and at most that many objects wait for it.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

GEN0_THRESHOLD = 10_000


def freeze_startup_heap(role: str) -> None:
    """Call once, when the process has finished starting (`role` names it in the log):
    freezes the heap and raises the first generation's threshold. Blocks for one full
    collection, before the process reports ready."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, older, oldest)
    log.info(
        "garbage collector (%s): %d start-up objects frozen, first-generation threshold %d",
        role,
        gc.get_freeze_count(),
        GEN0_THRESHOLD,
    )
