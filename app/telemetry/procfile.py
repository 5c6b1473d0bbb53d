"""A small kernel file (/proc, cgroup) re-read in one `pread` on a descriptor kept open.

Probes read these files on the event loops' 10 ms ticks and per slow-request window: a
`pread` costs ~2 us where open, read and close cost 10-25 us, and each of those system
calls hands the GIL back and forth with the compute threads. The kernel regenerates such a
file's text on every read from offset 0.

One thread at a time per `ProcFile`.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

# Errors that say the file is not there (or not ours to read), unlike EMFILE or ENFILE.
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM})


class ProcFile:
    def __init__(self, path: Path, size: int = 4096) -> None:
        """`size`: the most bytes read (the head of a longer file)."""
        self.path = path
        self.size = size
        self._fd: int | None = None
        self._missing = False

    def text(self) -> str | None:
        """The file's text now; None where it does not exist or cannot be read. A file
        missing once is not looked for again (these files do not appear later)."""
        if self._fd is None:
            if self._missing:
                return None
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as error:
                # Only absence is for good: out of descriptors (a connection flood), the
                # next read tries again.
                self._missing = error.errno in _ABSENT
                return None
        try:
            return os.pread(self._fd, self.size, 0).decode("ascii", "replace")
        except OSError:
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()
