"""A damaged state database gives back what can still be read before it is moved aside.

A page of garbage (a bad sector, a torn write under power loss) fails SQLite's quick_check, and
the store used to move the whole database aside and start an empty one: the outbox entries
queued there (Xids not yet delivered), the kernel-log cursors, the counter baselines and the
repair ledger were all gone, though a plain SELECT still read them. The class under test: a
page of garbage on any one index or table page; every row that is not on the damaged page
must be in the new database, and the problem says how much came back.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.runtime.state import DB_NAME, StateStore
from tests.support.disk import MIB, SmallDisk

QUEUED = 300
VALUES = {("kernel_log", "file_cursor"): {"inode": 7, "offset": 4096}, ("repairs", "held"): [1]}
PAGE = 4096


def queued(count: int, first: int = 0) -> list[Event]:
    return [
        Event(
            source="kernel_log",
            kind="xid",
            severity=Severity.CRITICAL,
            message=f"queued Xid {i} " + "x" * 200,
        )
        for i in range(first, first + count)
    ]


def page_map(store: StateStore) -> dict[str, list[tuple[int, int]]]:
    """Table or index -> (page number, cells on it), root first."""
    with store._lock:
        rows = store._conn.execute("SELECT name, pageno, ncell FROM dbstat ORDER BY path")
        found: dict[str, list[tuple[int, int]]] = {}
        for name, page, cells in rows.fetchall():
            found.setdefault(str(name), []).append((int(page), int(cells)))
    return found


def make_store(
    state_dir: Path, ended: str = "closed"
) -> tuple[list[str], dict[str, list[tuple[int, int]]]]:
    """A store that QUEUED events were queued in and VALUES saved, then closed (or `killed`:
    its files as a SIGKILL leaves them, WAL and index beside the database): the queued
    events' ids, and the pages of each table and index."""
    live = state_dir.with_name(state_dir.name + ".live")
    store = StateStore.open(live)
    events = queued(QUEUED)
    store.record_events(events, outbox=True)
    for (namespace, key), value in VALUES.items():
        store.put(namespace, key, value)
    pages = page_map(store)
    state_dir.mkdir(parents=True, exist_ok=True)
    if ended == "killed":
        for part in live.iterdir():  # open, not checkpointed
            shutil.copyfile(part, state_dir / part.name)
    store.close()
    if ended == "closed":
        shutil.copyfile(live / DB_NAME, state_dir / DB_NAME)
    shutil.rmtree(live)
    return [e.id for e in events], pages


def damage(path: Path, page: int) -> None:
    """One page of garbage (not zeros: a zeroed page can read as an empty one)."""
    with path.open("r+b") as handle:
        handle.seek((page - 1) * PAGE)
        handle.write(bytes((i * 37 + 11) % 256 for i in range(PAGE)))


# (what is damaged, which page of it, the outbox rows on that page are lost)
SHAPES = [
    ("sqlite_autoindex_events_1", 0, False),  # an index: nothing is lost
    ("outbox_kind", 0, False),
    ("outbox_created", -1, False),
    ("events", 1, False),  # the history: not the outbox
    ("outbox", 3, True),  # a leaf of the outbox: only its rows
    ("outbox", -1, True),  # the last leaf: the newest entries
]


@pytest.mark.parametrize(("name", "which", "loses_rows"), SHAPES)
def test_readable_rows_survive_a_damaged_page(
    tmp_path: Path, name: str, which: int, loses_rows: bool
) -> None:
    ids, pages = make_store(tmp_path)
    path = tmp_path / DB_NAME
    page, cells = pages[name][which]
    damage(path, page)

    store = StateStore.open(tmp_path)
    try:
        assert store.durable
        [problem] = store.problems
        assert problem.kind == "state_store_corrupt"
        kept = [entry.key for entry in store.outbox_peek(QUEUED + 1)]
        assert set(kept) <= set(ids)  # nothing made up
        lost = cells if loses_rows else 0
        assert len(kept) == QUEUED - lost, problem.message
        assert kept == [i for i in ids if i in set(kept)]  # in their order
        for entry in store.outbox_peek(QUEUED + 1):
            assert Event.from_dict(json.loads(entry.payload)).id == entry.key
        for (namespace, key), value in VALUES.items():
            assert store.get(namespace, key) == value
        assert store.outbox_depth() == {"event": len(kept)}
        assert f"{len(kept)} queued" in problem.message
        # The new database is whole, and the next store starts from the same seq.
        store.record_event(
            Event(source="t", kind="after", severity=Severity.INFO, message="new"), outbox=True
        )
        seqs = [entry.seq for entry in store.outbox_peek(QUEUED + 2)]
        assert seqs == sorted(set(seqs))
    finally:
        store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    assert list(tmp_path.glob(f"{DB_NAME}.corrupt-*")), "the damaged file is kept for support"


def test_a_killed_agents_wal_is_read_back_too(tmp_path: Path) -> None:
    """The last life was killed: its newest entries and values are only in the WAL, beside a
    database file with a damaged page. They come back with the rest."""
    live = tmp_path / "live"
    store = StateStore.open(live)
    old = queued(QUEUED)
    store.record_events(old, outbox=True)
    store.checkpoint()  # the old entries in the database file, the WAL empty
    page, cells = page_map(store)["outbox"][3]  # a leaf of old entries, not written again
    new = queued(10, first=QUEUED)
    store.record_events(new, outbox=True)
    for (namespace, key), value in VALUES.items():
        store.put(namespace, key, value)
    assert Path(f"{live / DB_NAME}-wal").stat().st_size > 0
    for part in live.iterdir():  # the files as a SIGKILL leaves them: open, not checkpointed
        shutil.copyfile(part, tmp_path / part.name)
    store.close()
    damage(tmp_path / DB_NAME, page)

    store = StateStore.open(tmp_path)
    try:
        [problem] = store.problems
        assert problem.kind == "state_store_corrupt"
        kept = [entry.key for entry in store.outbox_peek(QUEUED + 20)]
        assert [e.id for e in new] == kept[-len(new) :], problem.message
        assert len(kept) == QUEUED + len(new) - cells
        for (namespace, key), value in VALUES.items():
            assert store.get(namespace, key) == value
    finally:
        store.close()


# -- a database that can be read but not used: the store in memory starts from it -------------


def no_inodes(disk: SmallDisk) -> None:
    """Every inode taken: the WAL cannot be created, blocks are left."""
    for i in range(100_000):
        try:
            (disk.path / f"inode-{i}").touch()
        except OSError:
            return


def read_only(disk: SmallDisk) -> None:
    """The file system remounted read-only (what ext4 does after an I/O error)."""
    subprocess.run(["mount", "-o", "remount,ro", str(disk.path)], check=True)


@pytest.mark.parametrize(
    ("harm", "ended"),
    [(no_inodes, "closed"), (read_only, "closed"), (read_only, "killed")],
    ids=["no inodes", "read-only", "read-only, killed"],
)
def test_a_readable_database_that_cannot_be_used_is_read_into_memory(
    tmp_path: Path, harm: Callable[[SmallDisk], None], ended: str
) -> None:
    """The state dir holds a whole database the agent cannot open for writing: the store in
    memory that it falls back to starts with its outbox, values and history, so that what
    was queued is delivered and the cursors hold (no replay of the whole kernel log)."""
    with SmallDisk(tmp_path / "disk", size=4 * MIB, inodes=64) as disk:
        state_dir = disk.path / "state"
        ids, _ = make_store(state_dir, ended)
        harm(disk)
        store = StateStore.open(state_dir)
        assert not store.durable
        [problem] = store.problems
        assert problem.kind == "state_store_unwritable"
        assert [entry.key for entry in store.outbox_peek(QUEUED + 1)] == ids
        assert store.outbox_depth() == {"event": QUEUED}
        for (namespace, key), value in VALUES.items():
            assert store.get(namespace, key) == value
        assert f"{QUEUED} queued" in problem.message, problem.message
        assert len(store.recent_events(limit=QUEUED + 1)) == QUEUED
        store.close()
