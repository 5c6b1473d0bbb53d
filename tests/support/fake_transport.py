"""An asyncio transport without a socket, for driving uvicorn's HTTP protocol (and the
shedding subclass, `app/api/shedding_protocol.py`) with bytes: it keeps what is written and whether
reading is paused or the connection closed (its writes are never buffered)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeTransport:
    peer: tuple[str, int]
    written: bytearray = field(default_factory=bytearray)
    reading: bool = True
    closing: bool = False
    eof_written: bool = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peer, "sockname": ("10.9.9.9", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0  # written at once

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True
