"""The CUDA caching allocator and CUDA context changes, seen from the engine.

`CudaAllocatorProbe` reads `torch.cuda.memory_stats`: reserved and allocated bytes, segments,
`num_alloc_retries` (the allocator freed its cache and retried a cudaMalloc: a stall of the
whole device) and the largest free block inside reserved segments (from the allocator's
snapshot, a dict per block built under the GIL: taken once a second on the sampler thread,
`background.py`, never on the loop). `CudaContextProbe` counts
the times a compute thread finds a different CUDA context current than at its previous
batch (a context created lazily on a request, or switched under it), through the driver's
`cuCtxGetCurrent`. Both read nothing where there is no CUDA device or driver.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping
from typing import Any

from app.telemetry.background import BackgroundProbe
from app.telemetry.probe import Cached

LARGEST_FREE_BLOCK_EVERY_S = 1.0


def _largest_free_block(snapshot: list[dict[str, Any]]) -> float:
    largest = 0
    for segment in snapshot:
        for block in segment.get("blocks", []):
            if block.get("state") == "inactive":
                largest = max(largest, int(block.get("size", 0)))
    return float(largest)


class CudaAllocatorProbe(BackgroundProbe):
    """Engine only (imports torch). `device_index` None: the probe reads nothing. `read()`:
    the loop thread (the allocator's counters, cached 5 ms, with the latest largest free
    block); `sample()`: the sampler thread only (the snapshot)."""

    sample_every_s = LARGEST_FREE_BLOCK_EVERY_S

    def __init__(self, device_index: int | None, max_age_s: float = 0.005) -> None:
        super().__init__()
        self._device_index = device_index
        self._cached = Cached(self._read_now, max_age_s)

    def _read_now(self) -> Mapping[str, float]:
        if self._device_index is None:
            return {}
        import torch

        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return {}  # reading would initialise CUDA here, on the wrong thread
        stats = torch.cuda.memory_stats(self._device_index)
        return {
            "cuda_reserved_bytes": float(stats.get("reserved_bytes.all.current", 0)),
            "cuda_allocated_bytes": float(stats.get("allocated_bytes.all.current", 0)),
            "cuda_segments": float(stats.get("segment.all.current", 0)),
            "cuda_alloc_retries_total": float(stats.get("num_alloc_retries", 0)),
            "cuda_ooms_total": float(stats.get("num_ooms", 0)),
            **super().read(),  # the largest free block, as last sampled
        }

    def sample(self) -> Mapping[str, float]:
        if self._device_index is None:
            return {}
        import torch

        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return {}  # as above: the compute threads initialise CUDA
        snapshot = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
        return {"cuda_largest_free_block_bytes": _largest_free_block(snapshot)}

    def read(self) -> Mapping[str, float]:
        return self._cached.read()


def _driver() -> Any | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


class CudaContextProbe:
    """`check_thread()` is called by each compute thread before a batch; reads are free."""

    def __init__(self, enabled: bool) -> None:
        self._driver = _driver() if enabled else None
        self._local = threading.local()
        self.changes_total = 0

    @property
    def available(self) -> bool:
        return self._driver is not None

    def current_context(self) -> int | None:
        if self._driver is None:
            return None
        handle = ctypes.c_void_p()
        if self._driver.cuCtxGetCurrent(ctypes.byref(handle)) != 0:
            return None
        return int(handle.value or 0)

    def check_thread(self) -> None:
        """Compute threads only: count a change of this thread's current context."""
        context = self.current_context()
        if context is None:
            return
        previous = getattr(self._local, "context", None)
        if previous is not None and previous != context:
            self.changes_total += 1
        self._local.context = context

    def read(self) -> Mapping[str, float]:
        if self._driver is None:
            return {}
        return {"cuda_context_changes_total": float(self.changes_total)}
