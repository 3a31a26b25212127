"""A wall clock a test can step: time.time with an offset, patched where every module reads
it (`time.time()` is looked up at each call). The monotonic clock is left alone, as a real
step (NTP, `date -s`, a resumed virtual machine) leaves it."""

from __future__ import annotations

from collections.abc import Callable


class WallClock:
    """time.time with a step that the test sets (`offset`, seconds)."""

    def __init__(self, real: Callable[[], float]) -> None:
        self.real = real
        self.offset = 0.0

    def __call__(self) -> float:
        return self.real() + self.offset
