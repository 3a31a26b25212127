"""The state store: one SQLite database (WAL) in state_dir.

It holds the event history, the outbox that the MQTT sink drains, and a small key-value area
(last counter values, kernel-log cursors, baselines, the MQTT birth number). The schema version
is `PRAGMA user_version` and migrates forward step by step.

A corrupt database is moved aside (`state.db.corrupt-<time>`) and a new one started; a state dir
that cannot be written falls back to an in-memory database. Either way the store reports what
happened in `problems` (the runtime turns them into events and a metric), and the agent keeps
collecting and serving.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from agent.contracts.collector import JSONValue
from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, Severity
from agent.contracts.sink import OutboxEntry

log = structlog.get_logger(component="state")

DB_NAME = "state.db"

# Each entry migrates from version i to i+1. Never edit a released step; append a new one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE events (
        id TEXT PRIMARY KEY,
        time REAL NOT NULL,
        severity INTEGER NOT NULL,
        source TEXT NOT NULL,
        kind TEXT NOT NULL,
        subject TEXT NOT NULL,
        body TEXT NOT NULL
    );
    CREATE INDEX events_time ON events(time);
    CREATE TABLE outbox (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        kind TEXT NOT NULL,          -- event | heartbeat | metrics | status
        key TEXT NOT NULL,           -- event id, or a name for snapshots
        created REAL NOT NULL,
        payload BLOB NOT NULL
    );
    CREATE INDEX outbox_kind ON outbox(kind, seq);
    CREATE TABLE kv (
        namespace TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        updated REAL NOT NULL,
        PRIMARY KEY (namespace, key)
    );
    """,
    # 1 -> 2: the outbox's age bound scans by creation time; without an index every check
    # read the whole table (about 78 ms a second with 100k entries queued).
    """
    CREATE INDEX outbox_created ON outbox(created);
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True, slots=True)
class StoreProblem:
    kind: str  # state_store_corrupt | state_store_unwritable | state_store_write_failed
    message: str
    action: str


def _migrate(conn: sqlite3.Connection) -> int:
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise StateStoreError(
            f"the state database has schema version {version}, newer than this gpuwarden "
            f"understands ({SCHEMA_VERSION}); was it written by a newer release?"
        )
    while version < SCHEMA_VERSION:
        conn.executescript(
            f"BEGIN;\n{MIGRATIONS[version]}\nPRAGMA user_version = {version + 1};\nCOMMIT;"
        )
        version += 1
    return version


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=5.0, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode: durable across a killed process, at most the last transactions lost
    # on power failure; FULL would fsync every outbox write.
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


def _make_private_dir(path: Path, mode: int = 0o700) -> None:
    """mkdir -p: `path` owner-only, the parents it has to make 0755, whatever the umask (a
    umask only removes bits: under 000 they would come out world-writable). A directory that
    exists is left as it is: under systemd, StateDirectoryMode= decides."""
    if path.exists():
        return
    _make_private_dir(path.parent, 0o755)
    try:
        path.mkdir(mode)
    except FileExistsError:  # made meanwhile by someone else: theirs
        return
    path.chmod(mode)


def _create_private(path: Path) -> None:
    """Create the database file 0600 before SQLite does: SQLite makes it 0644 less the umask
    (world-readable outside systemd), and gives the -wal and -shm files the database's mode.
    An empty file is an empty database."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _open_checked(path: Path) -> sqlite3.Connection:
    _create_private(path)
    conn = _connect(str(path))
    try:
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {check}")
        _migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


class StateStore:
    """Thread-safe: one connection behind a lock (writes are small and rare)."""

    def __init__(
        self, conn: sqlite3.Connection, path: Path | None, problems: Sequence[StoreProblem]
    ):
        self._conn = conn
        self._lock = threading.Lock()
        self.path = path
        self.problems: list[StoreProblem] = list(problems)
        self.write_failures = 0
        self.last_write_failure: tuple[float, str] | None = None
        """(time, error) of the latest failed write: a full disk shows here first."""

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, state_dir: Path) -> StateStore:
        problems: list[StoreProblem] = []
        path = state_dir / DB_NAME
        try:
            _make_private_dir(state_dir)
            try:
                conn = _open_checked(path)
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError):
                    raise  # cannot open or write: not corruption
                aside = path.with_name(f"{DB_NAME}.corrupt-{int(time.time())}")
                for suffix in ("", "-wal", "-shm"):
                    part = Path(str(path) + suffix)
                    if part.exists():
                        part.rename(Path(str(aside) + suffix))
                problems.append(
                    StoreProblem(
                        "state_store_corrupt",
                        f"state database {path} was unreadable ({exc}); moved to {aside} and "
                        "started a new one: counters, cursors and the outbox start empty",
                        f"keep {aside} for support; check the disk of {state_dir} for errors",
                    )
                )
                log.error("state database corrupt, moved aside", path=str(path), aside=str(aside))
                conn = _open_checked(path)
            conn.execute("CREATE TABLE IF NOT EXISTS _probe (x)")
            conn.execute("DROP TABLE _probe")
            return cls(conn, path, problems)
        except (OSError, sqlite3.Error, StateStoreError) as exc:
            problems.append(
                StoreProblem(
                    "state_store_unwritable",
                    f"cannot use the state database in {state_dir} ({exc}); keeping state in "
                    "memory: events, counters and the outbox will not survive a restart",
                    f"make {state_dir} writable by the gpuwarden user, or set state_dir",
                )
            )
            log.error(
                "state store unusable, using memory", state_dir=str(state_dir), error=str(exc)
            )
            return cls.in_memory(problems)

    @classmethod
    def in_memory(cls, problems: Sequence[StoreProblem] = ()) -> StateStore:
        conn = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        _migrate(conn)
        return cls(conn, None, problems)

    @property
    def durable(self) -> bool:
        return self.path is not None

    def close(self) -> None:
        with self._lock:
            if self.path is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._conn.close()

    def _write_failed(self, exc: sqlite3.Error) -> None:
        self.write_failures += 1
        self.last_write_failure = (time.time(), str(exc))

    # -- plumbing ---------------------------------------------------------------------------

    def _write(self, sql: str, params: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._lock:
            try:
                return self._conn.execute(sql, tuple(params))
            except sqlite3.Error as exc:
                self._write_failed(exc)
                raise StateStoreError(f"state store write failed: {exc}") from exc

    def _read(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._conn.execute(sql, tuple(params)).fetchall()
            except sqlite3.Error as exc:
                raise StateStoreError(f"state store read failed: {exc}") from exc

    def schema_version(self) -> int:
        return int(self._read("PRAGMA user_version")[0][0])

    # -- key-value --------------------------------------------------------------------------

    def get(self, namespace: str, key: str) -> JSONValue | None:
        rows = self._read("SELECT value FROM kv WHERE namespace=? AND key=?", (namespace, key))
        return json.loads(rows[0][0]) if rows else None

    def put(self, namespace: str, key: str, value: JSONValue) -> None:
        self._write(
            "INSERT INTO kv(namespace, key, value, updated) VALUES (?,?,?,?) "
            "ON CONFLICT(namespace, key) DO UPDATE SET value=excluded.value, updated=excluded.updated",
            (namespace, key, json.dumps(value), time.time()),
        )

    def items(self, namespace: str) -> dict[str, JSONValue]:
        rows = self._read("SELECT key, value FROM kv WHERE namespace=?", (namespace,))
        return {k: json.loads(v) for k, v in rows}

    def delete(self, namespace: str, key: str) -> None:
        self._write("DELETE FROM kv WHERE namespace=? AND key=?", (namespace, key))

    # -- events and outbox ------------------------------------------------------------------

    def record_event(self, event: Event, *, outbox: bool) -> None:
        """Store the event, and queue it for delivery, in one transaction."""
        self.record_events([event], outbox=outbox)

    def record_events(self, events: Sequence[Event], *, outbox: bool) -> None:
        """Store events, and queue them for delivery, in one transaction (a burst of events
        costs one commit, not one each)."""
        rows = [
            (e.id, e.time, int(e.severity), e.source, e.kind, e.subject, e.to_json())
            for e in events
        ]
        queued = time.time()
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.executemany(
                    "INSERT OR IGNORE INTO events(id, time, severity, source, kind, subject, body)"
                    " VALUES (?,?,?,?,?,?,?)",
                    rows,
                )
                if outbox:
                    self._conn.executemany(
                        "INSERT INTO outbox(kind, key, created, payload) VALUES ('event',?,?,?)",
                        # created: when it was queued, not when it happened: the outbox's age
                        # bound must not expire a kernel-log event of last week on arrival.
                        [(row[0], queued, row[6].encode()) for row in rows],
                    )
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._write_failed(exc)
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                ids = ", ".join(e.id for e in events[:3])
                raise StateStoreError(
                    f"cannot store {len(events)} event(s) ({ids}...): {exc}"
                ) from exc

    def recent_events(
        self, limit: int = 100, min_severity: Severity = Severity.INFO
    ) -> list[Event]:
        rows = self._read(
            "SELECT body FROM events WHERE severity >= ? ORDER BY time DESC LIMIT ?",
            (int(min_severity), limit),
        )
        return [Event.from_dict(json.loads(body)) for (body,) in rows]

    def prune_events(self, older_than: float) -> int:
        return self._write("DELETE FROM events WHERE time < ?", (older_than,)).rowcount

    def outbox_put(self, kind: str, key: str, payload: bytes, created: float | None = None) -> int:
        cursor = self._write(
            "INSERT INTO outbox(kind, key, created, payload) VALUES (?,?,?,?)",
            (kind, key, time.time() if created is None else created, payload),
        )
        return int(cursor.lastrowid or 0)

    def outbox_peek(self, limit: int = 100, after_seq: int = 0) -> list[OutboxEntry]:
        rows = self._read(
            "SELECT seq, kind, key, created, payload FROM outbox WHERE seq > ? ORDER BY seq LIMIT ?",
            (after_seq, limit),
        )
        return [
            OutboxEntry(int(s), str(k), str(key), float(c), bytes(p)) for s, k, key, c, p in rows
        ]

    def outbox_ack(self, seqs: Sequence[int]) -> None:
        if seqs:
            marks = ",".join("?" * len(seqs))
            self._write(f"DELETE FROM outbox WHERE seq IN ({marks})", seqs)  # noqa: S608

    def outbox_depth(self) -> dict[str, int]:
        rows = self._read("SELECT kind, COUNT(*) FROM outbox GROUP BY kind")
        return {str(kind): int(count) for kind, count in rows}

    # -- outbox bounds (the MQTT sink's exporters/outbox.py decides what to drop) -----------

    def outbox_usage(self) -> tuple[int, int]:
        """(entries, payload bytes) in the outbox."""
        ((count, size),) = self._read(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM outbox"
        )
        return int(count), int(size)

    def outbox_oldest(self, kind: str, limit: int, skip_newest: int = 0) -> list[tuple[int, int]]:
        """(seq, payload bytes) of the oldest entries of one kind, leaving the newest
        `skip_newest` of that kind out."""
        rows = self._read(
            "SELECT seq, LENGTH(payload) FROM outbox WHERE kind=? AND seq NOT IN "
            "(SELECT seq FROM outbox WHERE kind=? ORDER BY seq DESC LIMIT ?) ORDER BY seq LIMIT ?",
            (kind, kind, skip_newest, limit),
        )
        return [(int(seq), int(size)) for seq, size in rows]

    def outbox_expire(self, created_before: float) -> dict[str, int]:
        """Delete entries created before the given time; how many of each kind went."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                rows = self._conn.execute(
                    "SELECT kind, COUNT(*) FROM outbox WHERE created < ? GROUP BY kind",
                    (created_before,),
                ).fetchall()
                self._conn.execute("DELETE FROM outbox WHERE created < ?", (created_before,))
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._write_failed(exc)
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                raise StateStoreError(f"cannot expire outbox entries: {exc}") from exc
        return {str(kind): int(count) for kind, count in rows}
