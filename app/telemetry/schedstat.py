"""How long the calling thread has waited, runnable, for a CPU (Linux schedstat: the second
field of /proc/thread-self/schedstat, in nanoseconds). A thread that waits on a lock, a
sleep or a CUDA stream is not runnable and does not count: this is time taken from it by
other threads and processes (or by a cgroup quota). 0.0 where the kernel does not say.

Any thread may call it, about for itself. Each thread keeps its own file open (closed when
the thread ends) and re-reads it with one `pread`: under a microsecond, where opening the
file each time cost ~5 us, paid on the event loops' tickers and twice per batch.
"""

from __future__ import annotations

import os
import threading

SCHEDSTAT = "/proc/thread-self/schedstat"
_available = os.path.exists(SCHEDSTAT)


class _ThreadFile:
    """This thread's schedstat file, open for as long as the thread lives."""

    def __init__(self) -> None:
        self.fd = -1  # set first: an open that fails (EMFILE in a flood) leaves nothing to close
        # /proc/thread-self resolves when opened: the descriptor stays this thread's.
        self.fd = os.open(SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


_per_thread = threading.local()


def thread_runqueue_wait_s() -> float:
    if not _available:
        return 0.0
    try:
        file: _ThreadFile | None = getattr(_per_thread, "file", None)
        if file is None:
            file = _per_thread.file = _ThreadFile()
        return int(os.pread(file.fd, 128, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
