"""Moving a store that started in memory onto the disk, in batches: writes run between them,
and a move cut short (a disk full again, a kill -9) leaves nothing half-moved.

`StateStore.adopt` used to move everything in one transaction: 4 s of the store thread for a
full outbox (100k entries, 64 MiB: bench/state_adopt.py), every event write waiting behind it.
It now moves in batches, each its own transaction, the copied rows marked until the last one
commits. What must hold:

- whatever memory writes between batches (new entries, entries delivered, values, a heartbeat
  replaced) is on the disk after the move exactly as memory has it: no entry twice, none lost,
  each under the number a sink knows it by;
- a disk that fills part-way through fails the move: memory keeps everything, the store stays
  in memory, the disk is as it was, and the next move, once there is room, stores each entry
  once (an entry there twice would be delivered twice);
- a kill -9 anywhere in the move leaves the disk either as it was or with the whole move, and
  never loses an entry the disk held.

The disks are real (a small tmpfs), the kills real (a child process doing the move on a real
SQLite file).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, Severity
from agent.runtime import moving
from agent.runtime.core import Runtime
from agent.runtime.salvage import salvage
from agent.runtime.state import DB_NAME, StateStore
from tests.support.agent_proc import REPO, pythonpath
from tests.support.clock import WallClock
from tests.support.collectors import scripted_runtime
from tests.support.disk import MIB, SmallDisk
from tests.support.waiting import announced

DAY = 86400.0
ATTEMPT_BOUND = 20.0
"""Seconds an attempt to open the disk may take at most here: a hang guard."""


def event(n: int, pad: int = 0) -> Event:
    return Event(
        source="test",
        kind="probe",
        severity=Severity.WARNING,
        message=f"probe {n} {'x' * pad}",
    )


def in_use_on_disk(store: StateStore) -> bool:
    """`store.durable`, read anew (it changes under the test: mypy must not narrow it)."""
    return store.durable


def kinds(runtime: Runtime, kind: str) -> list[Event]:
    return [e for e in runtime.recent_events if e.kind == kind]


def attempt_disk(store: StateStore) -> StateStore:
    attempt = store.disk_attempt()
    assert attempt is not None
    return attempt.future.result(ATTEMPT_BOUND)


Outbox = list[tuple[int, str]]


def read_db(path: Path) -> tuple[Outbox, set[str], dict[str, str], bool]:
    """(outbox (seq, key) in order, event ids, kv, whether a move's marks are left) as a
    reader of the file finds them."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        outbox = [
            (int(s), str(k)) for s, k in db.execute("SELECT seq, key FROM outbox ORDER BY seq")
        ]
        ids = [str(i) for (i,) in db.execute("SELECT id FROM events")]
        kv = {
            f"{ns}/{k}": str(v) for ns, k, v in db.execute("SELECT namespace, key, value FROM kv")
        }
        marks = moving.in_progress(db)
    assert len(ids) == len(set(ids))
    return outbox, set(ids), kv, marks


def memory_state(store: StateStore) -> tuple[Outbox, set[str], dict[str, str]]:
    with store._lock:
        conn = store._conn
        outbox = [
            (int(s), str(k)) for s, k in conn.execute("SELECT seq, key FROM outbox ORDER BY seq")
        ]
        ids = {str(i) for (i,) in conn.execute("SELECT id FROM events")}
        kv = {
            f"{ns}/{k}": str(v) for ns, k, v in conn.execute("SELECT namespace, key, value FROM kv")
        }
    return outbox, ids, kv


def as_the_next_life_opens_it(state_dir: Path) -> tuple[Outbox, set[str], dict[str, str]]:
    store = StateStore.open(state_dir)
    try:
        assert in_use_on_disk(store)
        state = memory_state(store)  # the same reads, on its connection
    finally:
        store.close()
    assert not read_db(state_dir / DB_NAME)[3]  # no marks left
    return state


def disk_with_own_entries(state_dir: Path, count: int) -> list[Event]:
    """A database on the disk that already holds entries of its own (a last life's)."""
    own = [event(1000 + n) for n in range(count)]
    last = StateStore.open(state_dir)
    last.record_events(own, outbox=True)
    last.put("counters", "last_life", 1)
    last.close()
    return own


# -- writes between the batches -----------------------------------------------------------------


class TestWritesBetweenBatches:
    """Whatever memory does between two steps of the move is what the disk has after it."""

    @pytest.mark.parametrize("batch_rows", [1, 7, 1000])
    @pytest.mark.parametrize("seed", range(4))
    def test_the_disk_ends_as_memory_is(self, tmp_path: Path, batch_rows: int, seed: int) -> None:
        rng = random.Random(seed)
        state_dir = tmp_path / "state"
        own = disk_with_own_entries(state_dir, 3)
        # Memory read back two of the disk's entries at start (as it does for a disk gone
        # read-only); the third it never saw.
        found = salvage(state_dir / DB_NAME)
        found.rows["outbox"] = found.rows["outbox"][:2]
        store = StateStore.in_memory([], found, state_dir=state_dir)
        mine = [event(n) for n in range(40)]
        store.record_events(mine, outbox=True)
        store.put("kernel_log", "cursor", 1)
        disk = attempt_disk(store)
        move = store.moving_into(disk, batch_rows)
        n = 100
        while True:
            for _ in range(rng.randrange(0, 4)):
                n += 1
                op = rng.choice(["event", "ack", "ack_first", "kv", "heartbeat", "again", "del"])
                entries = store.outbox_peek(1000)
                if op == "event":
                    store.record_event(event(n), outbox=True)
                elif op == "ack" and entries:
                    store.outbox_ack([rng.choice(entries).seq])
                elif op == "ack_first" and entries:  # a read-back or early entry, delivered
                    store.outbox_ack([entries[0].seq])
                elif op == "kv":
                    store.put("kernel_log", "cursor", n)
                elif op == "heartbeat":
                    store.outbox_replace("heartbeat", "hb", f"beat {n}".encode())
                elif op == "again":  # an event made again with the same id: stored once
                    store.record_event(rng.choice(mine), outbox=True)
                elif op == "del":
                    store.delete("counters", "last_life")
            if move.step():
                break
        expected = memory_state(store)
        expected_usage = store.outbox_usage()
        moved = move.finish()
        assert store.durable
        outbox, ids, kv, marks = read_db(state_dir / DB_NAME)
        assert not marks
        # Memory's entries under their own numbers, then the one it never saw, after them.
        assert outbox[: len(expected[0])] == expected[0]
        assert [key for _, key in outbox[len(expected[0]) :]] == [own[2].id]
        assert outbox[-1][0] > max([0, *(seq for seq, _ in expected[0])])
        assert len({key for _, key in outbox}) == len(outbox)
        assert ids == expected[1] | {e.id for e in own}
        assert kv == expected[2]
        assert moved["outbox_renumbered"] == 1
        # What the store counts is what the table holds.
        count, size = expected_usage
        assert store.outbox_usage() == (count + 1, size + len(own[2].to_json().encode()))
        counted = store._count_outbox().values()
        assert store.outbox_usage() == (sum(c for c, _ in counted), sum(s for _, s in counted))
        store.close()

    def test_a_clock_step_during_the_move_moves_the_copied_stamps_too(
        self, tmp_path: Path, wall: WallClock
    ) -> None:
        """Memory moves its stamps by a step of the wall clock (the outbox's age bound counts
        real time); the copies a step made before it must not stay on the old clock."""
        store = StateStore.in_memory(state_dir=tmp_path / "state")
        store.record_events([event(n) for n in range(30)], outbox=True)
        move = store.moving_into(attempt_disk(store), 5)
        for _ in range(4):
            assert not move.step()
        wall.offset += 8 * DAY
        store.record_event(event(99), outbox=True)  # the first write after the step
        assert store.clock_steps
        while not move.step():
            pass
        with store._lock:
            expected = store._conn.execute(
                "SELECT seq, created FROM outbox ORDER BY seq"
            ).fetchall()
            times = dict(store._conn.execute("SELECT id, time FROM events").fetchall())
        move.finish()
        with store._lock:
            assert (
                store._conn.execute("SELECT seq, created FROM outbox ORDER BY seq").fetchall()
                == expected
            )
            assert dict(store._conn.execute("SELECT id, time FROM events").fetchall()) == times
        store.close()


# -- a disk full again in the middle of the move --------------------------------------------


def grow(disk: SmallDisk, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk.path)], check=True)


class TestDiskFullDuringTheMove:
    """A tmpfs big enough to open the database and start the move, too small for all of it:
    the move fails part-way (at each size, at another point), and nothing is lost or doubled."""

    # Where each size fills up (of 40 batches of 200: 20 of the outbox, 20 of the events), as
    # measured here: 1536 KiB after 6, 4096 after 18 (both in the outbox), 6144 after 26,
    # 8192 after 34, 9216 after 39 (in the events); 10 MiB takes the whole move.
    @pytest.mark.parametrize("size_kib", [1536, 4096, 6144, 8192, 9216])
    def test_memory_keeps_everything_and_the_next_move_stores_each_entry_once(
        self, tmp_path: Path, size_kib: int
    ) -> None:
        if os.geteuid() != 0:
            pytest.skip("a tmpfs is mounted as root")
        with SmallDisk(tmp_path / "disk", size=size_kib * 1024) as disk:
            state_dir = disk.path / "state"
            own = disk_with_own_entries(state_dir, 5)
            before_disk = read_db(state_dir / DB_NAME)
            store = StateStore.in_memory(state_dir=state_dir)  # memory never saw the disk's
            try:
                mine = [event(n, pad=600) for n in range(4000)]
                for start in range(0, len(mine), 500):
                    store.record_events(mine[start : start + 500], outbox=True)
                store.put("kernel_log", "cursor", 4000)
                held = memory_state(store)
                disk_store = attempt_disk(store)
                with pytest.raises(StateStoreError, match="cannot move the state"):
                    store.adopt(disk_store, batch_rows=200)
                # Memory has everything, still; the store stays there and says why.
                assert not in_use_on_disk(store)
                assert memory_state(store) == held
                # The disk is as it was for the next life: undone at once where the full disk
                # let it, else marked, and left out by a reader of it (salvage: the disk
                # still unusable at the next start) ...
                found = salvage(state_dir / DB_NAME)
                assert [(int(r[0]), str(r[2])) for r in found.rows["outbox"]] == before_disk[0]
                assert {str(r[0]) for r in found.rows["events"]} == before_disk[1]
                grow(disk, 64 * MIB)
                # ... and undone by an open with room.
                assert as_the_next_life_opens_it(state_dir) == before_disk[:3]
                # The next move stores each entry once.
                moved = store.adopt(attempt_disk(store), batch_rows=200)
                assert in_use_on_disk(store)
                assert moved["outbox_moved"] == len(mine)
            finally:
                store.close()
            outbox, ids, kv, marks = read_db(state_dir / DB_NAME)
            assert not marks
            keys = [key for _, key in outbox]
            assert keys == [*(e.id for e in mine), *(e.id for e in own)]
            assert ids == {e.id for e in [*mine, *own]}
            assert kv["kernel_log/cursor"] == "4000"


# -- kill -9 in the middle of the move ------------------------------------------------------

CHILD = """
import json, sys
from pathlib import Path
from agent.contracts.model import Event, Severity
from agent.runtime.state import StateStore

state_dir, entries, batch_rows, pause = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "pause"
store = StateStore.in_memory(state_dir=state_dir)
mine = [
    Event(source="test", kind="probe", severity=Severity.WARNING, message=f"moved {n} " + "y" * 400)
    for n in range(entries)
]
for start in range(0, entries, 500):
    store.record_events(mine[start : start + 500], outbox=True)
store.put("kernel_log", "cursor", entries)
(state_dir.parent / "memory.json").write_text(json.dumps([e.id for e in mine]))
move = store.moving_into(store.disk_attempt().future.result(20), batch_rows)
step = 0
while True:
    done = move.step()
    print(f"step {step}", flush=True)
    step += 1
    if pause:
        sys.stdin.readline()
    if done:
        break
print("finishing", flush=True)
move.finish()
print("finished", flush=True)
"""

ENTRIES = 1500
BATCH = 100


def start_child(state_dir: Path, pause: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            str(state_dir),
            str(ENTRIES),
            str(BATCH),
            "pause" if pause else "run",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def kill_at(child: subprocess.Popen[str], line: str, pause: bool) -> None:
    assert child.stdout is not None and child.stdin is not None
    while True:
        got = child.stdout.readline().strip()
        assert got, "the child ended before the kill point"
        if got in (line, "finished"):
            break
        if pause:
            child.stdin.write("\n")
            child.stdin.flush()
    child.send_signal(signal.SIGKILL)
    child.wait(20)


@pytest.fixture
def killed_dir(tmp_path: Path) -> tuple[Path, list[Event]]:
    state_dir = tmp_path / "state"
    own = disk_with_own_entries(state_dir, 4)
    return state_dir, own


# Each step's line: 0 is the first transaction (the marks, the disk's own entries set aside),
# 1..15 the outbox in batches of 100, 16..30 the events, then the last transaction.
KILL_POINTS = [
    "step 0",
    "step 1",
    "step 7",
    "step 15",
    "step 16",
    "step 23",
    "step 30",
    "finishing",
]


class TestKilledDuringTheMove:
    @pytest.mark.parametrize("pause", [True, False], ids=["between_steps", "within_a_step"])
    @pytest.mark.parametrize("point", KILL_POINTS)
    def test_the_disk_is_as_it_was_or_has_the_whole_move(
        self, killed_dir: tuple[Path, list[Event]], point: str, pause: bool
    ) -> None:
        state_dir, own = killed_dir
        before = read_db(state_dir / DB_NAME)
        child = start_child(state_dir, pause)
        kill_at(child, point, pause)
        assert child.returncode == -signal.SIGKILL
        whole_ids = json.loads((state_dir.parent / "memory.json").read_text())
        # The next life opens it.
        store = StateStore.open(state_dir)
        try:
            assert store.durable and store.problems == []
            with store._lock:
                assert store._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            keys = [e.key for e in store.outbox_peek(10_000)]
            entries, _ = store.outbox_usage()
        finally:
            store.close()
        outbox, ids, kv, marks = read_db(state_dir / DB_NAME)
        assert not marks
        assert entries == len(keys)
        if keys == [key for _, key in before[0]]:  # as it was, under its own numbers too
            assert outbox == before[0]
            assert (ids, kv) == (before[1], before[2])
            assert point != "finished"
        else:  # the whole move, the disk's own entries after memory's
            assert keys == [*whole_ids, *(e.id for e in own)], f"partial after {point}"
            assert ids == set(whole_ids) | {e.id for e in own}
            assert kv["kernel_log/cursor"] == str(ENTRIES)

    def test_kill_between_steps_leaves_marks_that_the_next_open_undoes(
        self, killed_dir: tuple[Path, list[Event]]
    ) -> None:
        """The kill really lands in a half-done move (the marks and copied rows are there
        before the next open), and a reader that does not open it for writing (salvage, a
        state dir unusable at the next start) sees the database as it was too."""
        state_dir, own = killed_dir
        before = read_db(state_dir / DB_NAME)
        child = start_child(state_dir, pause=True)
        kill_at(child, "step 20", pause=True)
        outbox, _, _, marks = read_db(state_dir / DB_NAME)
        assert marks
        assert len(outbox) == len(own) + ENTRIES  # every entry copied, not yet the move
        found = salvage(state_dir / DB_NAME)
        assert [(int(r[0]), str(r[2])) for r in found.rows["outbox"]] == before[0]
        assert {str(r[0]) for r in found.rows["events"]} == before[1]


# -- the runtime: an event says so, and it goes on trying ---------------------------------------


class TestRuntimeSaysSo:
    async def test_a_move_that_fills_the_disk_is_an_event_and_is_retried(
        self, tmp_path: Path
    ) -> None:
        if os.geteuid() != 0:
            pytest.skip("a tmpfs is mounted as root")
        with SmallDisk(tmp_path / "disk", size=2 * MIB) as disk:
            state_dir = disk.path / "state"
            store = StateStore.in_memory(state_dir=state_dir)
            mine = [event(n, pad=600) for n in range(4000)]
            for start in range(0, len(mine), 500):
                store.record_events(mine[start : start + 500], outbox=True)
            runtime, _ = scripted_runtime(
                {}, store=store, core={"state_dir": str(state_dir), "state_retry_interval": 1.0}
            )
            await runtime.start()
            try:
                failed = await announced(runtime, "state_store_move_failed", timeout=30)
                assert len(failed) == 1 and "memory still holds everything" in failed[0].message
                assert not in_use_on_disk(store)
                assert "state store is in memory" in " ".join(runtime.health().problems)
                assert any("moving the state there" in p.message for p in store.problems)
                await asyncio.sleep(2.5)  # a retry or two, failing too: said once
                assert len(kinds(runtime, "state_store_move_failed")) == 1
                grow(disk, 64 * MIB)
                durable = await announced(runtime, "state_store_durable", timeout=30)
                assert "state_store_move_failed" in durable[0].clears
                assert in_use_on_disk(store)
                keys = [e.key for e in store.outbox_peek(10_000) if e.kind == "event"]
                assert len(keys) == len(set(keys))
                assert {e.id for e in mine} <= set(keys)
            finally:
                await runtime.stop()
                store.close()
