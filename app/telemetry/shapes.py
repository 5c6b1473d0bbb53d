"""First-seen shapes: a batch at a shape warm-up did not run pays set-up on the request
path (kernel selection, allocator growth, autotuning). Engine event loop thread only."""

from __future__ import annotations

from collections.abc import Hashable


class ShapeTracker:
    def __init__(self) -> None:
        self._seen: set[Hashable] = set()

    def mark_warm(self, shape: Hashable) -> None:
        """Warm-up ran this shape."""
        self._seen.add(shape)

    def first_seen(self, shape: Hashable) -> bool:
        """True the first time traffic runs a shape warm-up did not cover."""
        if shape in self._seen:
            return False
        self._seen.add(shape)
        return True
