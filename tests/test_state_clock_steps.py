"""A step of the wall clock and what the state store keeps by time.

The outbox's age bound (`outbox_max_age`, 7 days) and the event history's retention (30 days)
compare stored wall-clock stamps with now. A host whose clock was far behind at boot (a dead
RTC battery, a clock set by hand) and that NTP then corrects steps forward by more than those:
the events found at boot, the ones that matter most after a failure, were expired undelivered
and pruned from the history at once. Now the store moves the stamps it made on the old clock
by the step, the first thing in its next write, and says so (`clock_steps`); what was really
old before the step is no younger for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, Severity
from agent.runtime.state import StateStore
from exporters.outbox import Outbox, OutboxLimits
from tests.support.clock import WallClock
from tests.support.disk import SmallDisk

DAY = 86400.0
LIMITS = OutboxLimits(max_entries=10_000, max_bytes=10**8, max_age=7 * DAY)


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path, wall: WallClock) -> Iterator[StateStore]:
    made = (
        StateStore.open(tmp_path / "state") if request.param == "file" else StateStore.in_memory()
    )
    yield made
    made.close()


def found(tag: str) -> Event:
    return Event(source="kernel_log", kind="xid", severity=Severity.CRITICAL, message=tag)


@pytest.mark.parametrize("step", [8 * DAY, 40 * DAY, 26 * 365 * DAY])
def test_a_step_forward_expires_and_prunes_nothing_new(
    step: float, wall: WallClock, store: StateStore
) -> None:
    events = [found(f"at boot {i}") for i in range(5)]
    store.write_batch(events, {}, outbox=True)
    outbox = Outbox(store, LIMITS)
    wall.offset += step
    assert outbox.enforce() == {}, "undelivered events expired by the step"
    assert [e.key for e in outbox.peek(100)] == [e.id for e in events]
    assert all(abs(e.created - time.time()) < 60 for e in outbox.peek(100))
    assert store.prune_events(time.time() - 30 * DAY) == 0
    assert {e.id for e in store.recent_events(100)} == {e.id for e in events}
    assert store.clock_steps and abs(store.clock_steps[-1] - step) < 1.0


@pytest.mark.parametrize("step", [-8 * DAY, -3600.0])
def test_a_step_back_keeps_ages_too(step: float, wall: WallClock, store: StateStore) -> None:
    """Stamps made on a clock that was ahead move back with it: an entry queued a moment
    ago is a moment old after the step, not in the future for a week."""
    store.write_batch([found("ahead")], {}, outbox=True)
    wall.offset += step
    store.put("test", "poke", 1)  # any write catches up
    (entry,) = Outbox(store, LIMITS).peek(10)
    assert abs(entry.created - time.time()) < 60
    assert store.clock_steps and abs(store.clock_steps[-1] - step) < 1.0


def test_what_was_old_before_the_step_stays_old(wall: WallClock, store: StateStore) -> None:
    """A step moves only what this store stamped since it opened (or since the last step):
    an entry queued 8 days ago by an earlier run is still expired."""
    old = store.outbox_put("metrics", "snapshot", b"{}", created=time.time() - 8 * DAY)
    fresh = store.outbox_put("metrics", "snapshot", b"{}")
    wall.offset += 3600.0
    assert Outbox(store, LIMITS).enforce() == {"metrics": 1}
    assert [e.seq for e in store.outbox_peek(10)] == [fresh]
    assert old != fresh


def test_no_step_no_shift(store: StateStore) -> None:
    store.write_batch([found("steady")], {}, outbox=True)
    store.put("test", "poke", 1)
    assert store.clock_steps == []


def test_a_step_on_a_full_disk_is_caught_up_once_there_is_room(
    tmp_path: Path, wall: WallClock
) -> None:
    """The move of the stamps is a write like any other: on a full disk it waits, and the
    first write that works once there is room makes it, before anything is expired."""
    with SmallDisk(tmp_path / "disk") as disk:
        store = StateStore.open(disk.path / "state")
        try:
            events = [found(f"before the step {i}") for i in range(3)]
            store.write_batch(events, {}, outbox=True)
            disk.fill(store)
            wall.offset += 8 * DAY
            for _ in range(3):  # refused, each a try at the move too
                with pytest.raises(StateStoreError):
                    store.write_batch([found("on a full disk")], {}, outbox=True)
            assert store.clock_steps == []
            disk.free()
            assert Outbox(store, LIMITS).enforce() == {}
            assert [e.key for e in store.outbox_peek(10)] == [e.id for e in events]
            assert len(store.clock_steps) == 1
        finally:
            store.close()
