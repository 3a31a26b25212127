"""The store guard's own rules: a round's values are written with or after its events, the
newest value wins, a drop never takes an event being written, every event is accounted for."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, Severity
from agent.runtime.state import StateStore
from agent.runtime.store_guard import (
    EVENTS_PER_TRANSACTION,
    QUEUE_FULL,
    CollectorState,
    StoreGuard,
)

Batch = tuple[list[str], dict[tuple[str, str], str | None]]


def event(i: int) -> Event:
    return Event(source="test", kind="probe", severity=Severity.INFO, message=f"event {i}")


class Recorder:
    """Wraps a store's write_batch: records each transaction; `before` runs first and may
    raise (a full disk) or queue more events (emits that arrive during a write)."""

    def __init__(self, store: StateStore) -> None:
        self.batches: list[Batch] = []
        self.before: Callable[[], None] = lambda: None
        self._write = store.write_batch
        store.write_batch = self  # type: ignore[method-assign]

    def __call__(
        self,
        events: Sequence[Event],
        values: Mapping[tuple[str, str], str | None],
        *,
        outbox: bool,
    ) -> None:
        self.before()
        self._write(events, values, outbox=outbox)
        self.batches.append(([e.id for e in events], dict(values)))


def full_disk() -> None:
    raise StateStoreError("state store write failed: database or disk is full")


@pytest.fixture
def store() -> StateStore:
    return StateStore.in_memory()


@pytest.fixture
def guard(store: StateStore) -> StoreGuard:
    return StoreGuard(store, Path("/var/lib/gpuwarden"))


class TestOrder:
    """What a collector writes in a round reaches the store with or after the round's events."""

    def test_held_until_released_then_written_with_the_events(
        self, store: StateStore, guard: StoreGuard
    ) -> None:
        recorder = Recorder(store)
        state = CollectorState(guard)
        state.put("kmsg", "cursor", 7)  # the round moved past its records
        assert guard.flush(outbox=True)  # a flush during the round: not the cursor yet
        assert store.get("kmsg", "cursor") is None
        assert state.get("kmsg", "cursor") == 7  # the collector reads its own write
        found = event(1)
        guard.queue(found)  # the runtime queues the round's events...
        state.release()  # ...then releases its values
        assert guard.flush(outbox=True)
        assert recorder.batches[-1] == ([found.id], {("kmsg", "cursor"): "7"})
        assert store.get("kmsg", "cursor") == 7
        assert store.outbox_depth() == {"event": 1}

    def test_a_long_backlog_takes_several_transactions_values_with_the_last(
        self, store: StateStore, guard: StoreGuard
    ) -> None:
        recorder = Recorder(store)
        events = [event(i) for i in range(EVENTS_PER_TRANSACTION * 2 + 10)]
        for e in events:
            guard.queue(e)
        guard.put("mqtt", "bdseq", 3)
        assert guard.flush(outbox=True)
        assert [len(ids) for ids, _ in recorder.batches] == [
            EVENTS_PER_TRANSACTION,
            EVENTS_PER_TRANSACTION,
            10,
        ]
        assert [values for _, values in recorder.batches] == [{}, {}, {("mqtt", "bdseq"): "3"}]
        assert [i for ids, _ in recorder.batches for i in ids] == [e.id for e in events]


class TestValues:
    """Held values read like stored ones; the newest wins; a delete is a change too."""

    def test_refused_then_newer_then_written(self, store: StateStore, guard: StoreGuard) -> None:
        store.put("gpu", "old", 1)
        recorder = Recorder(store)
        recorder.before = full_disk
        state = CollectorState(guard)
        state.put("gpu", "a", 1)
        state.delete("gpu", "old")
        state.release()
        assert not guard.flush(outbox=False)
        state.put("gpu", "a", 2)
        state.release()
        assert guard.get("gpu", "a") == 2
        assert guard.items("gpu") == {"a": 2}
        assert store.items("gpu") == {"old": 1}
        assert guard.queued_values == 2
        recorder.before = lambda: None
        assert guard.flush(outbox=False)
        assert store.items("gpu") == {"a": 2}
        assert guard.queued_values == 0


class TestAccounting:
    """Every event is stored, waiting or counted as dropped; never two of these at once."""

    @pytest.mark.parametrize("write_works", [True, False])
    def test_events_arriving_during_a_write(
        self, store: StateStore, guard: StoreGuard, write_works: bool
    ) -> None:
        recorder = Recorder(store)
        guard.max_events = 5
        first = [event(i) for i in range(5)]
        late = [event(i) for i in range(5, 15)]
        for e in first:
            guard.queue(e)

        def arrivals() -> None:
            for e in late:  # emits while the first five are being written
                guard.queue(e)
            if not write_works:
                full_disk()

        recorder.before = arrivals
        assert guard.flush(outbox=False) is write_works
        stored = {e.id for e in store.recent_events(limit=100)}
        waiting = {e.id for e in guard._events}
        every = [e.id for e in first + late]
        assert not stored & waiting
        assert len(stored) + len(waiting) + guard.dropped[QUEUE_FULL] == len(every)
        if write_works:
            assert stored == {e.id for e in first}  # written events are never "dropped"
        else:
            assert {e.id for e in first} <= waiting  # in flight: kept for the retry
        assert late[-1].id in waiting  # the newest stays; the oldest others went


class TestValuesOfAnEvent:
    """Changes queued with an event (what it did to the repair ledger) are written in that
    event's own transaction, whichever of a long backlog's transactions it is in."""

    def test_in_the_events_own_transaction(self, store: StateStore, guard: StoreGuard) -> None:
        recorder = Recorder(store)
        events = [event(i) for i in range(EVENTS_PER_TRANSACTION * 2 + 10)]
        marked = {3: "first", EVENTS_PER_TRANSACTION + 7: "second", len(events) - 1: "third"}
        for i, e in enumerate(events):
            guard.queue(e, {("repairs", marked[i]): '"x"'} if i in marked else None)
        assert guard.flush(outbox=True)
        for ids, values in recorder.batches:
            expected = {
                ("repairs", name): '"x"' for i, name in marked.items() if events[i].id in ids
            }
            assert values == expected

    def test_a_later_events_change_wins_and_an_older_lone_value_loses(
        self, store: StateStore, guard: StoreGuard
    ) -> None:
        key = ("repairs", "reboot_node|kernel_log|xid|GPU-1")
        guard.delete(*key)  # at start: an entry of an earlier boot forgotten
        raised, cleared, again = event(1), event(2), event(3)
        guard.queue(raised, {key: '"raised"'})
        assert guard.flush(outbox=False)
        assert store.get(*key) == "raised"
        guard.queue(cleared, {key: None})
        guard.queue(again, {key: '"again"'})
        assert guard.flush(outbox=False)
        assert store.get(*key) == "again"
        assert guard.queued_values == 0
        assert guard.flush(outbox=False)  # nothing older is written over it later
        assert store.get(*key) == "again"

    def test_a_dropped_events_change_is_still_stored(
        self, store: StateStore, guard: StoreGuard
    ) -> None:
        guard.max_events = 2
        first = event(1)
        guard.queue(first, {("repairs", "a"): '"held"'})
        guard.queue(event(2))
        guard.queue(event(3))  # the queue is full: the oldest event goes...
        assert guard.dropped[QUEUE_FULL] == 1
        assert guard.flush(outbox=False)
        assert first.id not in {e.id for e in store.recent_events()}
        assert store.get("repairs", "a") == "held"  # ...what it did to the ledger stays
