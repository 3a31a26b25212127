"""A round's events and its state values reach the store in one transaction.

The runtime queued a round's events one by one and then released the round's values (a disk
level, a counter baseline, a kernel-log cursor); the store thread may take what waits at any
moment the guard's lock is free, so a transaction could hold the events without the values.
An agent killed after that commit came back with the finding stored and delivered but its
value not: a disk collector that raised `filesystem_space_critical` (an id of its own, not
derived from a record) saw the old level again and raised it again under a new id.

The test makes the store thread win every race it can: each time the runtime's thread lets
go of the guard's lock, a flush runs there and then. Every transaction that holds one of a
round's events must hold that round's values.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import TracebackType

import pytest

from agent.runtime.state import StateStore
from agent.runtime.store_guard import StoreGuard
from tests.support.collectors import scripted_runtime
from tests.test_store_guard import Recorder


class EagerStoreThread:
    """Stands in for the guard's lock: after the runtime's thread releases it, a flush runs
    at once, as if the store thread had been waiting for exactly that moment."""

    def __init__(self, guard: StoreGuard, thread: int) -> None:
        self._lock = threading.Lock()
        self._guard = guard
        self._thread = thread
        self._inside = threading.local()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._lock.__exit__(kind, exc, trace)
        if threading.get_ident() != self._thread or getattr(self._inside, "flushing", False):
            return
        self._inside.flushing = True
        try:
            self._guard.flush(outbox=False)
        finally:
            self._inside.flushing = False


@pytest.fixture
def store() -> Iterator[StateStore]:
    instance = StateStore.in_memory()
    yield instance
    instance.close()


@pytest.mark.parametrize("collectors", [1, 3])
async def test_every_transaction_with_a_rounds_event_has_its_values(
    store: StateStore, collectors: int
) -> None:
    names = [f"c{i}" for i in range(collectors)]
    runtime, made = scripted_runtime(dict.fromkeys(names, "write"), store=store)
    recorder = Recorder(store)
    runtime.guard._lock = EagerStoreThread(runtime.guard, threading.get_ident())  # type: ignore[assignment]
    await runtime.start()
    try:
        for name in names:
            while len(made[name].rounds) < 3:
                await runtime.settle()
        await runtime.settle()
    finally:
        await runtime.stop()
    firsts = {e.id: e.source for e in store.recent_events(limit=100) if e.kind == "first_round"}
    assert set(firsts.values()) == set(names)
    for ids, values in recorder.batches:
        for event_id in ids:
            if event_id in firsts:
                source = firsts[event_id]
                assert values.get(("test", source)) == "1", (source, ids, values)
