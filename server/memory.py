"""Handing freed heap back to the operating system.

glibc keeps freed memory for reuse, and after a large allocation is freed it raises its own
threshold for using mmap, so later large buffers (a 64 MiB body, a batch of long strings) come
from the heap and stay counted in the process's RSS after they are freed. malloc_trim(0) returns
every free page. Both processes do it every TRIM_EVERY_S on a thread of their own (it takes the
allocator's locks, not the GIL), so memory comes back within seconds of a burst of big requests.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading
import time

TRIM_EVERY_S = 5.0

_LIBC = ctypes.util.find_library("c")


def trim() -> None:
    """Return free heap pages to the OS (glibc only; elsewhere nothing)."""
    if _LIBC is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(_LIBC).malloc_trim(0)


def trim_periodically(every_s: float = TRIM_EVERY_S) -> threading.Thread:
    """A daemon thread that trims every `every_s` seconds for the life of the process."""

    def run() -> None:
        while True:
            time.sleep(every_s)
            trim()

    thread = threading.Thread(target=run, name="malloc-trim", daemon=True)
    thread.start()
    return thread
