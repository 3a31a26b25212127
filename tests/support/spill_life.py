"""A last life that spills, or a start that adopts, killed (SIGKILL) at a named point.

`python -m tests.support.spill_life spill STATE_DIR RUNTIME_DIR SOURCE POINT PLAN`: a store
whose state must be spilled (`guard`: on a disk that is full, the events and values waiting
in the store guard; `memory`: a store in memory that read the disk's database back and has
delivered one of its entries since), then `spill.write`, killed at POINT ("" : not killed).
PLAN gets, before the spill, what the state holds: the outbox ids to be delivered, the
values, the key deleted. `... adopt STATE_DIR RUNTIME_DIR - POINT -`: `spill.adopt_all`
killed at POINT.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from agent.contracts.model import Event, Severity
from agent.runtime import spill
from agent.runtime.salvage import salvage
from agent.runtime.state import DB_NAME, StateStore
from agent.runtime.store_guard import StoreGuard

BOOT = "boot-a"
ON_DISK = 3
"""Events stored and queued on the disk before it filled."""
WAITING = 4
"""Events the last life could not store."""


def event(n: int) -> Event:
    return Event(source="test", kind="probe", severity=Severity.WARNING, message=f"probe {n}")


def killer(point: str) -> spill.Hook:
    def hook(at: str) -> None:
        if at == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def last_life(state_dir: Path, runtime_dir: Path, source: str, point: str, plan: Path) -> None:
    store = StateStore.open(state_dir)
    stored = [event(n) for n in range(ON_DISK)]
    store.record_events(stored, outbox=True)
    store.put("test", "cursor", 1)
    store.put("test", "gone", "x")
    if source == "memory":  # unusable at start: memory starts from what the disk holds
        store.close()
        store = StateStore.in_memory([], salvage(state_dir / DB_NAME), state_dir=state_dir)
        delivered = store.outbox_peek(1)[0]
        store.outbox_ack([delivered.seq])
        expected = {e.id for e in stored[1:]}
    else:
        expected = {e.id for e in stored}
    guard = StoreGuard(store, state_dir)
    if source == "guard":
        os.makedirs(state_dir / "fill", exist_ok=True)
        with store._lock:
            store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        with open(state_dir / "fill" / "filler", "wb", buffering=0) as filler:
            chunk = 1 << 16
            while chunk:
                try:
                    filler.write(b"\0" * chunk)
                except OSError:
                    chunk //= 2
    waiting = [event(ON_DISK + n) for n in range(WAITING)]
    for n, found in enumerate(waiting):
        guard.queue(found, {("test", "cursor"): json.dumps(2 + n)})
    guard.delete("test", "gone")
    if source == "guard":
        assert not guard.flush(outbox=True), "the disk should be full"
    else:
        assert guard.flush(outbox=True)  # memory takes it
    expected |= {e.id for e in waiting}
    plan.write_text(json.dumps({"outbox": sorted(expected), "cursor": 1 + WAITING}))
    done = spill.write(store, guard, runtime_dir, boot_id=BOOT, outbox=True, hook=killer(point))
    assert done.path is not None, done.error


def adopt(state_dir: Path, runtime_dir: Path, point: str) -> None:
    store = StateStore.open(state_dir)
    spill.adopt_all(store, runtime_dir, boot_id=BOOT, hook=killer(point))
    store.close()


if __name__ == "__main__":
    phase, state, runtime, source, point, plan = sys.argv[1:7]
    if phase == "spill":
        last_life(Path(state), Path(runtime), source, point, Path(plan))
    else:
        adopt(Path(state), Path(runtime), point)
