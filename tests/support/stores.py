"""The state the runtime hands a collector, on a real full disk, for collector tests."""

from __future__ import annotations

import time

import pytest

from agent.contracts.collector import JSONValue
from agent.runtime.state import StateStore
from agent.runtime.store_guard import CollectorState, StoreGuard
from tests.support.disk import SmallDisk


class StateOnDisk:
    """What the runtime hands a collector as `deps.state` (a CollectorState over the runtime's
    StoreGuard), over a real StateStore on a SmallDisk that a test fills and frees."""

    def __init__(self, disk: SmallDisk) -> None:
        self.disk = disk
        self.store = StateStore.open(disk.path / "state")
        assert self.store.durable
        self.guard = StoreGuard(self.store, disk.path)
        self.state = CollectorState(self.guard)

    def seed(self, namespace: str, key: str, value: JSONValue) -> None:
        """Stored before the disk filled up (what an earlier run saved)."""
        self.store.put(namespace, key, value)

    def fill(self) -> None:
        self.disk.fill(self.store)

    def end_round(self) -> bool:
        """What the runtime does after a round: the round's values to the guard, then a
        write of what waits. True when it was all written."""
        self.state.release()
        return self.guard.flush(outbox=False)


def slow_store(monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    """Every store flush takes `delay` seconds longer (in the store writer's thread): a disk
    that stalls, or a loaded machine. `pytest --slow-store SECONDS` (tests/conftest.py)."""
    flush = StoreGuard.flush

    def slow_flush(self: StoreGuard, outbox: bool) -> bool:
        time.sleep(delay)
        return flush(self, outbox)

    monkeypatch.setattr(StoreGuard, "flush", slow_flush)
