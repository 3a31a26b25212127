"""Freed heap memory back to the kernel, so the agent's resident size follows what it holds.

CPython gives its own small-object arenas back when they empty, but what it took from the C
allocator (objects over 512 bytes, the storage of dicts and lists, the start-up's temporaries,
the benchmark child's parsed output, the NVIDIA driver's own mallocs) stays in the process's
heap once freed, and is counted in its resident memory for the agent's whole life. glibc's
`malloc_trim(0)` returns every free page of every arena to the kernel (madvise): on this
project's test machine 0.6 MB of a 39 MB agent, in under a millisecond (docs/MEASUREMENTS.md
has the H200's figures). Another C library (musl) has no such call: then nothing is done.

The runtime trims after the first round of every collector and then every TRIM_INTERVAL
seconds, on the event loop: the call takes each arena's lock for about a millisecond, far less
than a round of any collector.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

TRIM_INTERVAL = 60.0
"""Seconds between trims after the first: one benchmark run's garbage is gone within a minute."""


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: the C library it runs on
    except OSError:
        return None
    function = getattr(libc, "malloc_trim", None)
    if function is None:
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


class HeapTrimmer:
    """`trim()` hands the heap's free pages back; a no-op where the C library cannot."""

    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def trim(self) -> bool:
        """Trim now; whether anything was given back (False also where it cannot trim)."""
        if self._trim is None:
            return False
        self.trims += 1
        return bool(self._trim(0))
