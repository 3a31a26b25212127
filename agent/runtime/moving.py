"""The marks of a move into the database on the disk that has not finished (StateStore.adopt).

A store that started in memory moves its rows onto the disk in batches, each its own
transaction, so that the store thread is not held for the whole outbox at once (100k entries
held it for 3-4 s in one transaction: bench/state_adopt.py). Until the move's last transaction
commits, what it wrote is marked:

- the outbox entries and events it copied are listed in two tables of their own
  (`STAGED_OUTBOX` by sequence number, `STAGED_EVENTS` by id): the database's own rows are
  never listed;
- the database's own outbox entries that memory never saw are set aside, out of the way of
  memory's numbers, at their number less `SET_ASIDE` (negative, in their order).

The last transaction drops the marks with the rest of the move. A move cut short (the process
killed, the disk full again) is undone by `undo`, which every open of the database runs first:
the rows it lists go, the ones set aside get their numbers back, and the database is what it
was before the move. What reads the database without opening it for writing (salvage.py) leaves
the listed rows out the same way (`unstaged`).
"""

from __future__ import annotations

import sqlite3
from typing import Any

STAGED_OUTBOX = "move_staged_outbox"
STAGED_EVENTS = "move_staged_events"
SET_ASIDE = 1 << 62
"""Subtracted from the number of a database's own outbox entry during a move: negative, below
every number memory gives, and added back by the move's end or its undo."""


def begin(conn: sqlite3.Connection) -> None:
    """In the move's first transaction: the tables that list what it copies."""
    conn.execute(f"CREATE TABLE {STAGED_OUTBOX} (seq INTEGER PRIMARY KEY)")
    conn.execute(f"CREATE TABLE {STAGED_EVENTS} (id TEXT PRIMARY KEY)")


def in_progress(conn: sqlite3.Connection) -> bool:
    row = conn.execute(
        "SELECT COUNT(*) FROM sqlite_master WHERE type='table' AND name IN (?, ?)",
        (STAGED_OUTBOX, STAGED_EVENTS),
    ).fetchone()
    return bool(row[0])


def drop(conn: sqlite3.Connection) -> None:
    """In the move's last transaction (or its undo): the marks go."""
    conn.execute(f"DROP TABLE IF EXISTS {STAGED_OUTBOX}")
    conn.execute(f"DROP TABLE IF EXISTS {STAGED_EVENTS}")


def undo(conn: sqlite3.Connection) -> bool:
    """A move that did not finish, undone in one transaction: the database as before it.
    True when there was one. Raises sqlite3.Error (a disk too full to write even that)."""
    if not in_progress(conn):
        return False
    conn.execute("BEGIN IMMEDIATE")
    try:
        # A move killed before its tables were both made (it makes them in one transaction)
        # leaves neither: both are there.
        conn.execute(f"DELETE FROM outbox WHERE seq IN (SELECT seq FROM {STAGED_OUTBOX})")  # noqa: S608
        conn.execute(f"DELETE FROM events WHERE id IN (SELECT id FROM {STAGED_EVENTS})")  # noqa: S608
        conn.execute("UPDATE outbox SET seq = seq + ? WHERE seq < 0", (SET_ASIDE,))
        drop(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return True


def unstaged(
    conn: sqlite3.Connection, rows: dict[str, list[tuple[Any, ...]]]
) -> dict[str, list[tuple[Any, ...]]]:
    """Rows read from a database (outbox rows seq first, events id first) as `undo` would
    leave them: a read-only reader's view of the database before an unfinished move."""
    try:
        if not in_progress(conn):
            return rows
        seqs = {int(s) for (s,) in conn.execute(f"SELECT seq FROM {STAGED_OUTBOX}")}  # noqa: S608
        ids = {str(i) for (i,) in conn.execute(f"SELECT id FROM {STAGED_EVENTS}")}  # noqa: S608
    except sqlite3.Error:
        return rows
    kept = dict(rows)
    if "outbox" in kept:
        outbox = [
            (int(row[0]) + SET_ASIDE if int(row[0]) < 0 else row[0], *row[1:])
            for row in kept["outbox"]
            if int(row[0]) not in seqs
        ]
        kept["outbox"] = sorted(outbox, key=lambda row: int(row[0]))
    if "events" in kept:
        kept["events"] = [row for row in kept["events"] if str(row[0]) not in ids]
    return {table: found for table, found in kept.items() if found}
