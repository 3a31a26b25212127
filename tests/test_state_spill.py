"""A spill of what a clean stop could not store: written whole or not at all, adopted once.

At a clean stop the state the store could not take (the store guard's queue on a full disk,
or a store in memory with all it holds) goes into a spill in the runtime dir
(agent/runtime/spill.py); the next start adopts it into the store and removes it. What must
hold, whatever point a kill -9 hits in the spill's writing or its adoption: every event to be
delivered is queued exactly once (none lost once the spill is whole, none twice), the values
are the newest (a cursor, a count never lower), what the last life deleted stays deleted and
what it delivered is not queued again. A spill of another boot still delivers its events; a
spill that is not one (garbage, a foreign database, a file cut short) is moved aside and
reported, never a failed start; a runtime dir that cannot take the spill is a log line
naming it and what is lost, never an exception.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import structlog

from agent.contracts.model import Event, Severity
from agent.runtime import spill
from agent.runtime.state import StateStore
from agent.runtime.store_guard import StoreGuard
from tests.support.agent_proc import REPO, pythonpath
from tests.support.disk import MIB, SmallDisk
from tests.support.spill_life import BOOT

WRITE_POINTS = ["begun", "written", "synced", "renamed", ""]
ADOPT_POINTS = ["read", "in_transaction", "merged", ""]


def life(*args: str) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.spill_life", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, -signal.SIGKILL), done.stderr
    return done.returncode


class Spilled(NamedTuple):
    state_dir: Path
    runtime_dir: Path
    wanted: dict[str, Any]
    """What the life meant to spill: its outbox ids and its cursor."""
    code: int
    """The spilling life's exit: 0 when it ran to its end, else killed (-SIGKILL)."""


@contextlib.contextmanager
def spilled(tmp_path: Path, source: str, point: str) -> Iterator[Spilled]:
    """A life on a full disk whose stop spills `source`'s state, killed at `point` (none:
    ""); yields once the disk has room again, as the next start finds it."""
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir()
    plan = tmp_path / "plan.json"
    with SmallDisk(tmp_path / "disk", size=4 * MIB) as disk:
        state_dir = disk.path / "state"
        code = life("spill", str(state_dir), str(runtime_dir), source, point, str(plan))
        (state_dir / "fill" / "filler").unlink(missing_ok=True)
        yield Spilled(state_dir, runtime_dir, json.loads(plan.read_text()), code)


def outbox_ids(store: StateStore) -> Counter[str]:
    return Counter(entry.key for entry in store.outbox_peek(10_000) if entry.kind == "event")


@pytest.mark.parametrize("source", ["guard", "memory"])
@pytest.mark.parametrize("point", WRITE_POINTS, ids=lambda p: p or "whole")
def test_a_spill_killed_while_written_is_all_or_nothing(
    tmp_path: Path, source: str, point: str
) -> None:
    with spilled(tmp_path, source, point) as done:
        state_dir, runtime_dir, wanted, code = done
        store = StateStore.open(state_dir)
        try:
            store, adopted = spill.adopt_all(store, runtime_dir, boot_id=BOOT)
            ids = outbox_ids(store)
            assert all(n == 1 for n in ids.values()), f"queued twice: {ids}"
            whole = point in ("renamed", "") or code == 0
            if whole:  # the spill was complete: nothing of it lost
                assert len(adopted) == 1 and adopted[0].error is None
                assert set(ids) == set(wanted["outbox"]), (ids, wanted)
                assert store.get("test", "cursor") == wanted["cursor"]
                assert store.get("test", "gone") is None
            else:  # killed before the rename: no spill, nothing half of one
                assert adopted == []
                assert store.get("test", "cursor") == 1  # as the disk had it
            assert os.listdir(runtime_dir) == []  # adopted and removed, or the half one gone
        finally:
            store.close()


@pytest.mark.parametrize("source", ["guard", "memory"])
@pytest.mark.parametrize("point", ADOPT_POINTS, ids=lambda p: p or "whole")
def test_an_adoption_killed_anywhere_adopts_once_at_the_next_start(
    tmp_path: Path, source: str, point: str
) -> None:
    with spilled(tmp_path, source, "") as done:
        state_dir, runtime_dir, wanted, code = done
        assert code == 0
        life("adopt", str(state_dir), str(runtime_dir), "-", point, "-")
        store = StateStore.open(state_dir)  # the next start: adopts what is left, if anything
        try:
            store, _ = spill.adopt_all(store, runtime_dir, boot_id=BOOT)
            ids = outbox_ids(store)
            assert all(n == 1 for n in ids.values()), f"queued twice: {ids}"
            assert set(ids) == set(wanted["outbox"]), (ids, wanted)
            assert store.get("test", "cursor") == wanted["cursor"]
            assert store.get("test", "gone") is None
            assert os.listdir(runtime_dir) == []
        finally:
            store.close()


def event(n: int) -> Event:
    return Event(source="test", kind="probe", severity=Severity.WARNING, message=f"late {n}")


def memory_spill(runtime_dir: Path, boot: str, count: int = 3) -> list[str]:
    store = StateStore.in_memory()
    events = [event(n) for n in range(count)]
    store.record_events(events, outbox=True)
    store.put("events_total", "probe", {"boot": boot, "count": count})
    done = spill.write(
        store, StoreGuard(store, runtime_dir), runtime_dir, boot_id=boot, outbox=True
    )
    assert done.path is not None and done.outbox == count
    store.close()
    return [e.id for e in events]


class TestAnotherBoot:
    def test_its_events_are_delivered_and_the_values_of_this_boot_stay(
        self, tmp_path: Path
    ) -> None:
        runtime_dir = tmp_path / "run"
        runtime_dir.mkdir()
        ids = memory_spill(runtime_dir, "boot-old")
        store = StateStore.open(tmp_path / "state")
        store.put("events_total", "probe", {"boot": "boot-new", "count": 7})
        try:
            store, adopted = spill.adopt_all(store, runtime_dir, boot_id="boot-new")
            assert [a.error for a in adopted] == [None]
            assert set(outbox_ids(store)) == set(ids)
            assert store.get("events_total", "probe") == {"boot": "boot-new", "count": 7}
        finally:
            store.close()


def foreign(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript("CREATE TABLE t(x); INSERT INTO t VALUES (1);")


GARBAGE: dict[str, Callable[[Path], object]] = {
    "garbage": lambda path: path.write_bytes(os.urandom(8192)),
    "empty": lambda path: path.write_bytes(b""),
    "foreign": foreign,
}


class TestNotASpill:
    @pytest.mark.parametrize("shape", sorted(GARBAGE))
    def test_moved_aside_and_reported(self, tmp_path: Path, shape: str) -> None:
        runtime_dir = tmp_path / "run"
        runtime_dir.mkdir()
        bad = runtime_dir / f"{spill.PREFIX}1-1{spill.SUFFIX}"
        GARBAGE[shape](bad)
        store = StateStore.open(tmp_path / "state")
        try:
            store, adopted = spill.adopt_all(store, runtime_dir, boot_id=BOOT)
            assert len(adopted) == 1 and adopted[0].error
            assert adopted[0].event("x").kind == "state_spill_unreadable"
            assert not bad.exists() and adopted[0].aside is not None and adopted[0].aside.exists()
            assert store.durable
        finally:
            store.close()

    def test_a_spill_cut_short_gives_what_is_readable(self, tmp_path: Path) -> None:
        runtime_dir = tmp_path / "run"
        runtime_dir.mkdir()
        ids = memory_spill(runtime_dir, BOOT, count=200)
        (path,) = spill.found(runtime_dir)
        with path.open("r+b") as handle:  # its last pages lost
            handle.truncate(path.stat().st_size - 4096)
        store = StateStore.open(tmp_path / "state")
        try:
            store, adopted = spill.adopt_all(store, runtime_dir, boot_id=BOOT)
            assert len(adopted) == 1
            queued = outbox_ids(store)
            assert set(queued) <= set(ids) and all(n == 1 for n in queued.values())
            if adopted[0].error is not None:
                assert adopted[0].aside is not None and adopted[0].aside.exists()
            else:
                assert set(queued) == set(ids)
        finally:
            store.close()


def read_only(disk: SmallDisk) -> Path:
    path = disk.path / "run"
    path.mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(disk.path)], check=True)
    return path


def full(disk: SmallDisk) -> Path:
    path = disk.path / "run"
    path.mkdir()
    disk.fill()
    return path


def missing(disk: SmallDisk) -> Path:
    return disk.path / "gone" / "run"  # its parent is missing too: it cannot be made


UNUSABLE = {"read_only": read_only, "full": full, "missing": missing}


@pytest.mark.parametrize("fault", sorted(UNUSABLE))
def test_an_unusable_runtime_dir_is_a_log_line_naming_what_is_lost(
    tmp_path: Path, fault: str
) -> None:
    with SmallDisk(tmp_path / "disk", size=1 * MIB) as disk:
        runtime_dir = UNUSABLE[fault](disk)
        store = StateStore.in_memory()
        store.record_events([event(n) for n in range(5)], outbox=True)
        guard = StoreGuard(store, tmp_path)
        guard.put("test", "cursor", 3)
        with structlog.testing.capture_logs() as logs:
            done = spill.write(store, guard, runtime_dir, boot_id=BOOT, outbox=True)
        store.close()
        assert done.path is None and done.error
        lines = [line for line in logs if line["log_level"] == "error"]
        assert len(lines) == 1, logs
        assert lines[0]["runtime_dir"] == str(runtime_dir)
        assert lines[0]["outbox_entries_lost"] == 5 and lines[0]["values_lost"] == 1
        if fault != "missing":
            assert [n for n in os.listdir(runtime_dir) if n != ".filler"] == []


def test_a_spill_adopted_into_memory_stays_until_the_store_is_durable(tmp_path: Path) -> None:
    """A kill -9 of the life that adopted a spill into memory (the disk still full) must not
    lose it: the next start finds it again; once the store is on the disk it goes."""
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir()
    ids = memory_spill(runtime_dir, BOOT)
    with SmallDisk(tmp_path / "disk", size=1 * MIB) as disk:
        state_dir = disk.path / "state"
        StateStore.open(state_dir).close()
        disk.fill()
        store, adopted = spill.adopt_all(StateStore.open(state_dir), runtime_dir, boot_id=BOOT)
        assert not store.durable and [a.error for a in adopted] == [None]
        assert set(outbox_ids(store)) == set(ids)
        store.outbox_ack([entry.seq for entry in store.outbox_peek(1)])  # one delivered
        store.close()  # and the life killed: nothing of memory survives
        store, adopted = spill.adopt_all(StateStore.open(state_dir), runtime_dir, boot_id=BOOT)
        assert set(outbox_ids(store)) == set(ids)  # found again: none lost
        disk.free()
        attempt = store.disk_attempt()
        assert attempt is not None
        store.adopt(attempt.future.result(20))
        assert store.durable and spill.found(runtime_dir) == []
        store.close()
        store = StateStore.open(state_dir)
        try:
            assert set(outbox_ids(store)) == set(ids)
            assert spill.adopt_all(store, runtime_dir, boot_id=BOOT)[1] == []
        finally:
            store.close()


@contextlib.contextmanager
def spilled_live(tmp_path: Path, source: str, point: str) -> Iterator[Spilled]:
    """A life on a full disk (or a store in memory) whose spill kept while it runs holds a
    first batch, then a second write with more is killed at `point` ("": not killed;
    "stored": the disk had room again and all was stored, killed before the spill went)."""
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir()
    plan = tmp_path / "plan.json"
    with SmallDisk(tmp_path / "disk", size=4 * MIB) as disk:
        state_dir = disk.path / "state"
        code = life("live", str(state_dir), str(runtime_dir), source, point, str(plan))
        (state_dir / "fill" / "filler").unlink(missing_ok=True)
        yield Spilled(state_dir, runtime_dir, json.loads(plan.read_text()), code)


LIVE_CASES = [
    *((source, point) for source in ("guard", "memory") for point in ["start", *WRITE_POINTS]),
    ("guard", "stored"),
]


@pytest.mark.parametrize(("source", "point"), LIVE_CASES, ids=lambda p: p or "whole")
def test_a_kill_9_while_running_keeps_the_last_whole_live_spill(
    tmp_path: Path, source: str, point: str
) -> None:
    """The spill kept while the store cannot take the state: a kill -9 anywhere in a write
    leaves the one before it (or this one, whole); the next start queues each event once
    and takes the newest values it holds. One the store holds all of (it was marked by the
    flush that stored it) is not adopted over the store's newer values."""
    with spilled_live(tmp_path, source, point) as done:
        state_dir, runtime_dir, wanted, code = done
        assert code == -signal.SIGKILL or point == "", code
        store = StateStore.open(state_dir)
        try:
            store, adopted = spill.adopt_all(store, runtime_dir, boot_id=BOOT)
            ids = outbox_ids(store)
            assert all(n == 1 for n in ids.values()), f"queued twice: {ids}"
            held = wanted["all"] if point in ("renamed", "", "stored") else wanted["first"]
            assert set(ids) == set(held["outbox"]), (sorted(ids), held)
            assert store.get("test", "cursor") == held["cursor"]
            assert store.get("test", "gone") is None
            assert len(adopted) <= 2 and all(a.error is None for a in adopted)
            assert os.listdir(runtime_dir) == []
        finally:
            store.close()
