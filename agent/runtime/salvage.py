"""What can still be read from a damaged state database, for the new one that replaces it.

A page of garbage (a bad sector, a write torn by a power loss) fails SQLite's quick_check, yet
most rows are usually on other pages and a plain SELECT still reads them. Before the store moves
a damaged database aside, it reads back the outbox (undelivered events), the key-value area
(cursors, counter baselines, the repair ledger) and the event history (which keeps a finding
made again from the same record from being delivered twice under a new entry).

Each table is read in rowid order from both ends, not through an index (an index may be the
damaged page): a damaged leaf stops a scan, and the scan from the other end reads the rows
past it. A row that does not read as what the agent wrote (an event that does not parse, a
value that is not JSON) is left out.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.contracts.model import Event
from agent.runtime.moving import unstaged

COLUMNS: dict[str, str] = {
    "outbox": "seq, kind, key, created, payload",
    "kv": "namespace, key, value, updated",
    "events": "id, time, severity, source, kind, subject, body",
}
"""The tables read back, with their columns in the order of their INSERTs."""


@dataclass
class Salvage:
    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    """Table -> the rows read back, in rowid order."""
    left_out: int = 0
    """Rows that were read but are not what the agent wrote."""

    def count(self, table: str) -> int:
        return len(self.rows.get(table, []))

    def summary(self) -> str:
        text = (
            f"{self.count('outbox')} queued outbox entries, {self.count('kv')} state values "
            f"and {self.count('events')} history events were read back from it"
        )
        if self.left_out:
            text += f" ({self.left_out} damaged rows left out)"
        return text


def _connect_read_only(path: Path) -> sqlite3.Connection:
    # With a WAL beside it the database is only whole with it: read it (mode=ro). Without one,
    # immutable: no lock taken, nothing created.
    mode = "mode=ro" if Path(f"{path}-wal").exists() else "immutable=1"
    return sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True, timeout=1.0)


def _scan(conn: sqlite3.Connection, table: str, ascending: bool) -> Iterator[tuple[Any, ...]]:
    """Rows (rowid first) from one end until the damage. Python's cursor steps one row ahead
    of the one it returns, so a scan that meets a damaged page loses the last row before it:
    that row, and any more, are then read one query at a time."""
    order, past = ("ASC", ">") if ascending else ("DESC", "<")
    select = f"SELECT rowid, {COLUMNS[table]} FROM {table} NOT INDEXED"  # noqa: S608
    last: int | None = None
    try:
        for row in conn.execute(f"{select} ORDER BY rowid {order}"):
            last = int(row[0])
            yield tuple(row)
        return
    except sqlite3.Error:
        pass
    while True:
        where = "" if last is None else f"WHERE rowid {past} {last}"
        try:
            row = conn.execute(f"{select} {where} ORDER BY rowid {order} LIMIT 1").fetchone()
        except sqlite3.Error:
            return  # the damaged page: the scan from the other end reads what lies past it
        if row is None:
            return
        last = int(row[0])
        yield tuple(row)


def _valid(table: str, row: tuple[Any, ...]) -> bool:
    try:
        if table == "outbox":
            _seq, kind, key, _created, payload = row
            if not isinstance(payload, bytes) or not isinstance(key, str):
                return False
            if kind == "event":
                return Event.from_dict(json.loads(payload)).id == key
            return isinstance(kind, str)
        if table == "kv":
            json.loads(row[2])
            return isinstance(row[0], str) and isinstance(row[1], str)
        return bool(Event.from_dict(json.loads(row[6])).id == row[0])
    except (ValueError, TypeError, KeyError, AttributeError):  # ModelError is a ValueError
        return False


def salvage(path: Path) -> Salvage:
    """What `path` still gives back; an empty Salvage if it cannot be read at all."""
    found = Salvage()
    try:
        conn = _connect_read_only(path)
    except sqlite3.Error:
        return found
    with contextlib.closing(conn):
        for table in COLUMNS:
            by_rowid = {row[0]: row[1:] for row in _scan(conn, table, ascending=True)}
            by_rowid.update((row[0], row[1:]) for row in _scan(conn, table, ascending=False))
            rows = [by_rowid[rowid] for rowid in sorted(by_rowid)]
            kept = [row for row in rows if _valid(table, row)]
            found.left_out += len(rows) - len(kept)
            if kept:
                found.rows[table] = kept
        # A move into this database that did not finish: not what the database holds.
        found.rows = unstaged(conn, found.rows)
    return found


def restore(conn: sqlite3.Connection, found: Salvage) -> None:
    """Write what was read back into a new, empty database, in one transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table, rows in found.rows.items():
            marks = ",".join("?" * len(rows[0]))
            conn.executemany(
                f"INSERT OR IGNORE INTO {table}({COLUMNS[table]}) VALUES ({marks})",  # noqa: S608
                rows,
            )
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
