"""Waiting for the runtime's events: announced only once stored, by the store writer off the
loop, and in the order they were emitted, whatever a caller does meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from agent.runtime.store_guard import StoreGuard
from tests.support.stores import slow_store


def event(n: int) -> Event:
    return Event("test", "thing", Severity.INFO, f"event {n}", subject=f"s{n}")


def runtime() -> Runtime:
    cfg = dataclasses.replace(config.parse({"prometheus": {"enabled": False}}), collectors={})
    return Runtime(cfg, StateStore.in_memory(), collectors={}, sinks=registry.SINKS)


async def test_settle_waits_for_the_batch_in_hand_and_keeps_the_order() -> None:
    rt = runtime()
    await rt.start()
    slow = threading.Event()
    flush = rt.guard.flush

    def slow_flush(outbox: bool) -> bool:
        slow.set()
        time.sleep(0.5)  # a disk that stalls: the writer holds the first batch
        return flush(outbox)

    rt.guard.flush = slow_flush  # type: ignore[method-assign]
    try:
        first = event(1)
        rt.emit(first)
        while not slow.is_set():  # the writer has taken it
            await asyncio.sleep(0.01)
        later = [event(n) for n in range(2, 5)]
        for e in later:
            rt.emit(e)
        threaded = event(5)
        threading.Thread(target=rt.emit, args=(threaded,)).start()
        time.sleep(0.05)  # handed to the loop, not yet run there
        with pytest.raises(RuntimeError, match="settle"):
            rt.flush_events()  # it would announce `later` before `first`
        assert await rt.settle()
        ids = [e.id for e in rt.recent_events if e.kind == "thing"]
        assert ids == [first.id, *(e.id for e in later), threaded.id]
        assert {e.id for e in rt.store.recent_events()} >= set(ids)
    finally:
        rt.guard.flush = flush  # type: ignore[method-assign]
        await rt.stop()


def test_the_slow_store_option_delays_every_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `pytest --slow-store` does (tests/conftest.py): the developer's way to make a read
    that races the store writer fail every time."""
    guard = StoreGuard(StateStore.in_memory(), tmp_path)
    guard.queue(event(1))
    slow_store(monkeypatch, 0.3)
    start = time.monotonic()
    assert guard.flush(False)
    assert time.monotonic() - start >= 0.3
    assert [e.id for e in guard.store.recent_events()] != []
