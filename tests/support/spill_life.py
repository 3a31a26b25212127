"""A last life that spills, or a start that adopts, killed (SIGKILL) at a named point.

`python -m tests.support.spill_life spill STATE_DIR RUNTIME_DIR SOURCE POINT PLAN`: a store
whose state must be spilled (`guard`: on a disk that is full, the events and values waiting
in the store guard; `memory`: a store in memory that read the disk's database back and has
delivered one of its entries since), then `spill.write`, killed at POINT ("" : not killed).
PLAN gets, before the spill, what the state holds: the outbox ids to be delivered, the
values, the key deleted. `... adopt STATE_DIR RUNTIME_DIR - POINT -`: `spill.adopt_all`
killed at POINT. `... live ...`: the spill kept while the agent runs (`live_life`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
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


MORE = 3
"""Events the live spill's second write holds (the first holds the WAITING ones)."""


def live_life(state_dir: Path, runtime_dir: Path, source: str, point: str, plan: Path) -> None:
    """`LiveSpill` while the store cannot take the state (`source` as for `last_life`): a
    first spill written whole, then more events and a second spill killed at `point` (""
    or "stored": not killed while written). "stored" (a full disk only): the disk has room
    again, a newer cursor is stored with all the spill held, and the life is killed before
    the spill is removed. PLAN gets {"first": ..., "all": ...}: the outbox ids and cursor
    each spill holds."""
    store, guard, expected = _unsaved(state_dir, source)
    armed, targeted = threading.Event(), threading.Event()
    aimed: dict[str, bool] = {"now": False}

    def hook(at: str) -> None:
        if at == "start":  # a write begun once armed holds all that was queued before
            aimed["now"] = armed.is_set()
        if aimed["now"] and at == point:
            os.kill(os.getpid(), signal.SIGKILL)
        if aimed["now"] and at == "renamed":
            targeted.set()

    live = spill.LiveSpill(store, guard, runtime_dir, boot_id=BOOT, outbox=lambda: True, hook=hook)
    live.start()
    waiting = [event(ON_DISK + n) for n in range(WAITING)]
    for n, found in enumerate(waiting):
        guard.queue(found, {("test", "cursor"): json.dumps(2 + n)})
    guard.delete("test", "gone")
    assert guard.flush(outbox=True) is (source == "memory")
    held = sorted(expected | {e.id for e in waiting})
    first = {"outbox": held, "cursor": 1 + WAITING}
    _wait(lambda: {e.id for e in waiting} <= spilled_ids(runtime_dir))
    if point == "stored":
        assert source == "guard"
        assert live.stop()  # killed before it removes the spill
        (state_dir / "fill" / "filler").unlink()
        later = event(99)  # the cursor moves with an event (a value of its own would not)
        guard.queue(later, {("test", "cursor"): json.dumps(100)})
        assert guard.flush(outbox=True)
        stored = {"outbox": sorted({*held, later.id}), "cursor": 100}
        plan.write_text(json.dumps({"first": first, "all": stored}))
        os.kill(os.getpid(), signal.SIGKILL)
    more = [event(ON_DISK + WAITING + n) for n in range(MORE)]
    for n, found in enumerate(more):
        guard.queue(found, {("test", "cursor"): json.dumps(2 + WAITING + n)})
    guard.flush(outbox=True)
    every = sorted({*held, *(e.id for e in more)})
    plan.write_text(json.dumps({"first": first, "all": {"outbox": every, "cursor": 4 + WAITING}}))
    armed.set()
    guard.hold({("test", "poke"): json.dumps(1)})  # a change after arming: a write follows
    _wait(targeted.is_set)
    assert live.stop()


def spilled_ids(runtime_dir: Path) -> set[str]:
    """The outbox event ids of the spills in `runtime_dir` now."""
    ids: set[str] = set()
    for path in runtime_dir.glob(
        f"{spill.PREFIX}*{spill.SUFFIX}"
    ):  # not found(): it removes a spill being written
        with (
            contextlib.suppress(sqlite3.Error),
            contextlib.closing(
                sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1)
            ) as db,
        ):
            ids.update(str(k) for (k,) in db.execute("SELECT key FROM outbox WHERE kind='event'"))
    return ids


def _wait(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the live spill did not write"
        time.sleep(0.01)


def _unsaved(state_dir: Path, source: str) -> tuple[StateStore, StoreGuard, set[str]]:
    """A store whose state must be spilled (see `last_life`), and the outbox ids it holds."""
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
        return store, StoreGuard(store, state_dir), {e.id for e in stored[1:]}
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
    return store, StoreGuard(store, state_dir), {e.id for e in stored}


def adopt(state_dir: Path, runtime_dir: Path, point: str) -> None:
    store = StateStore.open(state_dir)
    spill.adopt_all(store, runtime_dir, boot_id=BOOT, hook=killer(point))
    store.close()


if __name__ == "__main__":
    phase, state, runtime, source, point, plan = sys.argv[1:7]
    if phase == "spill":
        last_life(Path(state), Path(runtime), source, point, Path(plan))
    elif phase == "live":
        live_life(Path(state), Path(runtime), source, point, Path(plan))
    else:
        adopt(Path(state), Path(runtime), point)
