"""Polling waits for tests: a bound on how long a condition may take, not a timing claim."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    """Wait on the event loop until `predicate()` holds; TimeoutError naming `what` if not."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what or predicate}")
        await asyncio.sleep(0.02)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    """The same, blocking (for tests that drive subprocesses)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(0.05)
