"""The live spill's thread sleeps while the store is durable, whatever it is told.

The store guard tells the live spill (agent/runtime/spill.py `LiveSpill`) of every change it
queues, durable store or not; the spill writes only while the store cannot take them. What
the clean-clone CI run found (tests/test_endpoint_attacks.py: a scraper answered 0 times of
2 under a connection flood, 8 of 12 under slowloris): a change told while the store was
durable left its due time set, the thread's wait went to 0 once it passed, and the thread
spun, holding the GIL away from the event loop for the rest of the process's life. What must
hold: on a durable store, changes of every kind (an event, a value, a refused write that
recovered) wake the thread a bounded number of times, and nothing is written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.runtime import spill
from agent.runtime.state import StateStore
from agent.runtime.store_guard import StoreGuard
from tests.support.spill_life import BOOT

WATCH = 2.0
"""Seconds the thread is watched after the changes."""
MOST_STEPS = int(WATCH / spill.CHECK_EVERY) + 6
"""Its periodic looks in that time, and a few for the changes themselves."""


class Counted(spill.LiveSpill):
    steps = 0

    def _step(self) -> None:
        self.steps += 1
        super()._step()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Counted]:
    store = StateStore.open(tmp_path / "state")
    guard = StoreGuard(store, tmp_path / "state")
    made = Counted(store, guard, tmp_path / "run", boot_id=BOOT, outbox=lambda: True)
    made.start()
    try:
        yield made
    finally:
        assert made.stop()
        store.close()


def an_event(live: Counted) -> None:
    live.guard.queue(
        Event(source="test", kind="probe", severity=Severity.WARNING, message="a change")
    )


def a_value(live: Counted) -> None:
    live.guard.put("test", "cursor", 7)


def both_then_flushed(live: Counted) -> None:
    an_event(live)
    a_value(live)
    assert live.guard.flush(outbox=True)


CHANGES = {"event": an_event, "value": a_value, "flushed": both_then_flushed}


@pytest.mark.parametrize("change", CHANGES)
def test_changes_to_a_durable_store_leave_the_thread_asleep(live: Counted, change: str) -> None:
    CHANGES[change](live)
    began = live.steps
    time.sleep(WATCH)
    steps = live.steps - began
    assert steps <= MOST_STEPS, f"{steps} looks in {WATCH:g} s: the thread spins"
    assert live.writes == 0
    assert not live.runtime_dir.exists() or not list(live.runtime_dir.iterdir())
