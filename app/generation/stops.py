"""Stop strings: the text stream is cut before the first occurrence of any of them.

Text that might be the beginning of a stop string is held back until the next piece shows
whether it is one, so nothing past a stop is ever released, even when the stop string
spans several tokens. One instance per sequence; any one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopScan:
    text: str  # safe to release now
    stopped: bool  # a stop string was found: `text` ends just before it; nothing follows


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._held = ""
        self._stopped = False

    def feed(self, text: str) -> StopScan:
        """Scan a new piece of text; after a stop, everything is dropped."""
        if self._stopped:
            return StopScan("", True)
        buffer = self._held + text
        found = [index for stop in self._stops if (index := buffer.find(stop)) >= 0]
        if found:
            self._stopped = True
            self._held = ""
            return StopScan(buffer[: min(found)], True)
        keep = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return StopScan(buffer[: len(buffer) - keep], False)

    def flush(self) -> str:
        """The held-back text, once the sequence ended without reaching a stop string."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _partial_stop_length(self, buffer: str) -> int:
        """The longest end of `buffer` that is the start (not the whole) of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[len(buffer) - length :]):
                    longest = length
                    break
        return longest
