"""Polling waits for tests: a bound on how long a condition may take, not a timing claim."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.contracts.model import Event
    from agent.runtime.core import Runtime


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


async def announced(
    runtime: Runtime, kind: str, count: int = 1, timeout: float = 20.0
) -> list[Event]:
    """The runtime's announced events of `kind`, once there are at least `count` of them.

    An event is announced (logged, in `recent_events`, heard by listeners) only after the
    store writer has stored it, off the loop: a counter or a sample that moved says nothing
    about whether the event it raised is announced yet. Read events through this."""

    def found() -> list[Event]:
        return [e for e in runtime.recent_events if e.kind == kind]

    await until(lambda: len(found()) >= count, timeout, f"{count} {kind} event(s) announced")
    return found()
