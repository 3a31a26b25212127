"""The state store: one SQLite database (WAL) in state_dir.

It holds the event history, the outbox that the MQTT sink drains, and a small key-value area
(last counter values, kernel-log cursors, baselines, the MQTT birth number). The schema version
is `PRAGMA user_version` and migrates forward step by step.

A corrupt database is moved aside (`state.db.corrupt-<time>`) and a new one started with what
could still be read from it (salvage.py: the outbox, the key-value area, the history); a state dir
that cannot be written falls back to an in-memory database, which starts from what a database
there still gives back. A full disk is not that: the
database is opened (held alone where the disk cannot take its `-shm` index) and read, and its
writes fail until there is room, which the store guard (store_guard.py) handles. Either way the store reports what
happened in `problems` (the runtime turns them into events and a metric), and the agent keeps
collecting and serving.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import structlog

from agent.contracts.clock import StepWatch
from agent.contracts.collector import JSONValue
from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, Severity
from agent.contracts.sink import OutboxEntry
from agent.runtime import moving
from agent.runtime.salvage import COLUMNS, Salvage, restore, salvage

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

WAL_AUTOCHECKPOINT_PAGES = 128
"""Pages (4 KiB) the WAL may hold before SQLite copies it back into the database. SQLite's
default, 1000 pages (about 4 MB), let the WAL alone fill a 4 MiB state disk before its first
checkpoint."""
WAL_SIZE_LIMIT = 512 * 1024
"""Bytes the WAL file is cut back to when it starts over after a checkpoint: without a limit it
keeps the size of its largest burst for good."""
MAX_PARAMETERS = 500
"""Parameters bound to one statement at most: SQLite before 3.32 refuses more than 999."""


@dataclass(frozen=True, slots=True)
class StoreProblem:
    kind: str  # state_store_corrupt | state_store_unwritable | state_store_hung
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


FULL_DISK_ERRORS = frozenset({"SQLITE_FULL", "SQLITE_IOERR_SHMSIZE"})
"""SQLite's names for "no room": a write that needs a page, and the `-shm` index that a WAL
database needs before its first read and that a full disk cannot hold."""


def _disk_full(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorname", "") in FULL_DISK_ERRORS


def _connect(path: str, alone: bool = False) -> sqlite3.Connection:
    """`alone`: this connection holds the database for itself (EXCLUSIVE locking, set before
    the first access), so that SQLite keeps the WAL index in memory and needs no `-shm` file:
    a database on a full disk can be read so, where it otherwise cannot be opened at all."""
    conn = sqlite3.connect(path, timeout=5.0, check_same_thread=False, isolation_level=None)
    try:
        if alone:
            conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: durable across a killed process, at most the last transactions
        # lost on power failure; FULL would fsync every outbox write.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
        conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
    except BaseException:
        conn.close()  # a connection left open keeps its lock: the next attempt is "locked"
        raise
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


def _open_checked(path: Path, alone: bool = False) -> sqlite3.Connection:
    _create_private(path)
    conn = _connect(str(path), alone)
    try:
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {check}")
        _migrate(conn)
        if moving.undo(conn):  # a move from memory cut short: the database as before it
            log.warning("undid a move into the state database that did not finish", path=str(path))
    except BaseException:
        conn.close()
        raise
    return conn


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _odd_files(path: Path) -> list[tuple[Path, str]]:
    """The database's files (itself, -wal, -shm) that are there but are not plain files, each
    with what it is: SQLite's own error names neither ("unable to open database file")."""
    odd: list[tuple[Path, str]] = []
    for suffix in ("", "-wal", "-shm"):
        part = Path(f"{path}{suffix}")
        try:
            link = os.readlink(part) if part.is_symlink() else None
            if link is not None and not part.exists():
                odd.append((part, f"{part} is a symbolic link to {link}, which does not exist"))
                continue
            if not part.exists():
                continue
            mode = part.stat().st_mode
        except OSError:
            continue
        for test, kind in _KINDS:
            if test(mode):
                through = f" (a symbolic link to {link})" if link is not None else ""
                odd.append((part, f"{part} is {kind}{through}"))
    return odd


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False


def _open_or_alone(path: Path) -> sqlite3.Connection:
    """The database, shared with readers (`diag`); on a disk too full for the `-shm` index,
    held alone (`_connect`) rather than not at all: `diag` cannot read it until the agent
    restarts with room."""
    try:
        return _open_checked(path)
    except sqlite3.OperationalError as exc:
        if not _disk_full(exc):
            raise
        log.warning("state disk too full for the WAL index; holding the database alone")
        return _open_checked(path, alone=True)


def _chunks(values: Sequence[int]) -> Iterator[Sequence[int]]:
    for start in range(0, len(values), MAX_PARAMETERS):
        yield values[start : start + MAX_PARAMETERS]


def _marks(count: int) -> str:
    return ",".join("?" * count)


EventRow = tuple[str, float, int, str, str, str, str]


def _new_events(conn: sqlite3.Connection, rows: Sequence[EventRow]) -> list[EventRow]:
    """The rows whose event the store does not hold yet, each id once (its first): an event
    made again from the same record (a stable id, after a crash) is stored once, and so
    queued for delivery once; a second outbox entry would deliver it twice."""
    ids = list(dict.fromkeys(row[0] for row in rows))
    held: set[str] = set()
    for start in range(0, len(ids), MAX_PARAMETERS):
        chunk = ids[start : start + MAX_PARAMETERS]
        sql = f"SELECT id FROM events WHERE id IN ({_marks(len(chunk))})"  # noqa: S608
        held.update(str(i) for (i,) in conn.execute(sql, chunk))
    fresh: list[EventRow] = []
    for row in rows:
        if row[0] not in held:
            held.add(row[0])
            fresh.append(row)
    return fresh


IN_MEMORY_PROBLEMS = frozenset({"state_store_unwritable", "state_store_hung"})
"""The problems of a store in memory for want of its disk: gone once it is durable again."""
RETRY_MIN_FREE = 256 * 1024
"""Bytes free on the state dir's file system below which a retry does not try to open the
database there (the cheap check): a few pages for the database and its WAL, with room."""


def _unusable(
    state_dir: Path,
    exc: BaseException,
    odd: Sequence[tuple[Path, str]],
    found: Salvage | None = None,
) -> StoreProblem:
    read_back = f" ({found.summary()})" if found is not None and found.rows else ""
    odd = odd or _odd_files(state_dir / DB_NAME)
    why = f"{'; '.join(text for _, text in odd)} ({exc})" if odd else f"({exc})"
    action = (
        f"remove or move {', '.join(str(part) for part, _ in odd)} (the database's "
        "files must be plain files), or set state_dir"
        if odd
        else f"make {state_dir} writable by the gpuwarden user (or free space there), or set "
        "state_dir; the agent tries it again every state_retry_interval seconds"
    )
    return StoreProblem(
        "state_store_unwritable",
        f"cannot use the state database in {state_dir}: {why}; keeping state in "
        f"memory{read_back}: events, counters and the outbox will not survive a restart "
        "until the disk can be used again",
        action,
    )


def _hung(state_dir: Path, timeout: float) -> StoreProblem:
    return StoreProblem(
        "state_store_hung",
        f"opening the state database in {state_dir} did not finish within {timeout:g} s: "
        "the state dir hangs (a file server gone, a FUSE daemon that does not answer?); "
        "keeping state in memory: events, counters and the outbox will not survive a restart "
        "until the state dir answers again",
        f"check the mount that holds {state_dir} (findmnt -T {state_dir}; its file server), "
        "or set state_dir to a local disk; the agent tries it again every "
        "state_retry_interval seconds",
    )


def _move_failed(state_dir: Path, error: str) -> StoreProblem:
    return StoreProblem(
        "state_store_unwritable",
        f"the state database in {state_dir} opened again, but moving the state there from "
        f"memory failed ({error}); undone, keeping state in memory: events, counters and the "
        "outbox will not survive a restart until a move works",
        f"free space in {state_dir} (room for what memory holds: the outbox and the history); "
        "the agent tries it again every state_retry_interval seconds",
    )


def _disk_usable(state_dir: Path) -> None:
    """The cheap check before a retry opens the database: the state dir (or the nearest
    directory above it that exists) writable, and some room free. Raises OSError."""
    target = state_dir
    while not target.exists() and target.parent != target:
        target = target.parent
    if not os.access(target, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        raise PermissionError(errno.EACCES, "not writable", str(target))
    room = os.statvfs(target)
    if room.f_bavail * room.f_frsize < RETRY_MIN_FREE:
        raise OSError(errno.ENOSPC, "no room to open the database", str(target))


PROBE = """
import os, sys
os.statvfs(sys.argv[1])
for path in sys.argv[1:]:
    try:
        os.lstat(path)
    except OSError:
        pass
"""
"""The mount probe's program: what opening the database asks of the state dir's mount
first (its statvfs, a look-up of each of the database's files)."""


class MountProbe:
    """Whether the state dir's mount answers, asked in a child process before the agent asks
    it in one of its own threads. A look-up on a mount that hangs waits in the kernel, and
    once the process is being killed the wait is uninterruptible: an agent thread stuck there
    would keep the agent from exiting (SIGTERM, even SIGKILL) until the mount answers. The
    child is killed and given up instead; it ends when the mount answers."""

    def __init__(self, state_dir: Path) -> None:
        paths = [state_dir, *(Path(f"{state_dir / DB_NAME}{s}") for s in ("", "-wal", "-shm"))]
        self.process: subprocess.Popen[bytes] | None = None
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", PROBE, *map(str, paths)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as exc:  # no process to spare: the open's own deadline still holds
            log.warning("cannot start the state dir probe", error=str(exc))

    def answered(self, timeout: float) -> bool:
        if self.process is None:
            return True
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()  # not waited for: it ends when the mount answers
            return False
        return True

    @property
    def stuck(self) -> bool:
        return self.process is not None and self.process.poll() is None


class OpenAttempt:
    """One opening of the state database, in a daemon thread of its own: the caller waits for
    `future` as long as it will. An attempt abandoned (the caller stopped waiting: a mount
    that hangs) keeps nothing it opens: the thread, back from the kernel, closes it, so it
    never writes into a store the agent moved on from."""

    def __init__(self, open_store: Callable[[], StateStore], name: str) -> None:
        self.future: concurrent.futures.Future[StateStore] = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._abandoned = False
        self._open = open_store
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def _run(self) -> None:
        try:
            store = self._open()
        except BaseException as exc:  # handed to the caller, whatever it is
            with self._lock:
                if not self._abandoned:
                    self.future.set_exception(exc)
            return
        with self._lock:
            if not self._abandoned:
                self.future.set_result(store)
                return
        log.warning("an abandoned state store open finished; closing what it opened")
        store.close()

    def abandon(self) -> None:
        """Stop waiting: what the attempt opens, now or later, is closed."""
        with self._lock:
            self._abandoned = True
            done = self.future.done() and self.future.exception() is None
        if done:
            self.future.result().close()


KvChanges = Mapping[tuple[str, str], str | None]
"""(namespace, key) -> the value as JSON text, or None to delete it."""


class StateStore:
    """Thread-safe: one connection behind a lock. The runtime makes its writes from one
    thread of its own (agent/runtime/store_guard.py), never from the event loop."""

    def __init__(
        self, conn: sqlite3.Connection, path: Path | None, problems: Sequence[StoreProblem]
    ):
        self._conn = conn
        self._lock = threading.Lock()
        self.path = path
        self.problems: list[StoreProblem] = list(problems)
        self.state_dir: Path | None = path.parent if path is not None else None
        """Where the database is, or (in memory) where it belongs."""
        self._read_back = Salvage()
        """In memory: what it started from, read back from the disk's database (`adopt`)."""
        self._attempt: OpenAttempt | None = None
        """The latest attempt to open the database on the disk (perhaps stuck there)."""
        self._probe: MountProbe | None = None
        """The latest probe of the state dir's mount (perhaps stuck there)."""
        self.write_failures = 0
        self.last_write_failure: tuple[float, str] | None = None
        """(time, error) of the latest failed write: a full disk shows here first."""
        self.write_error: str | None = None
        """The error of the latest write while writes fail; None once one works again."""
        self.clock_steps: list[float] = []
        """Steps of the wall clock this store moved its stamps by (seconds), in order."""
        self.held_files: list[Path] = []
        """Files whose content this store holds in memory only (spills adopted into it:
        agent/runtime/spill.py): kept, so that a kill -9 loses none of it, and removed once
        the store is durable (`Move.finish`) or a newer spill holds it."""
        self._steps = StepWatch()
        self._epoch = time.monotonic()
        """Since when the stamps this store made are on the wall clock as it reads now."""
        self._usage_lock = threading.Lock()
        self._usage: dict[str, tuple[int, int]] = self._count_outbox()
        """kind -> (entries, payload bytes) in the outbox: counted once here, then kept as
        entries come and go, so that a scrape or a bound check asks the database nothing."""

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, state_dir: Path) -> StateStore:
        problems: list[StoreProblem] = []
        path = state_dir / DB_NAME
        odd = _odd_files(path)  # before SQLite tries: it may remove an odd -wal as it fails
        try:
            return cls._open_on_disk(state_dir, problems)
        except (OSError, sqlite3.Error, StateStoreError) as exc:
            # A whole database it cannot write to (no inode for its WAL, a file system gone
            # read-only) still holds the outbox and the cursors: memory starts from it. Not
            # one of a newer schema: it is whole, and its own release will use it again.
            newer = isinstance(exc, StateStoreError)
            found = salvage(path) if not newer and _is_file(path) else Salvage()
            problems.append(_unusable(state_dir, exc, odd, found))
            log.error(
                "state store unusable, using memory",
                state_dir=str(state_dir),
                error=str(exc),
                **{f"salvaged_{table}": found.count(table) for table in COLUMNS},
            )
            return cls.in_memory(problems, found, state_dir=state_dir)

    @classmethod
    def _open_on_disk(cls, state_dir: Path, problems: list[StoreProblem]) -> StateStore:
        """The store on its database in `state_dir` (a corrupt one moved aside and made
        again, a full disk's held alone), or the error that leaves it in memory."""
        path = state_dir / DB_NAME
        _make_private_dir(state_dir)
        try:
            conn = _open_or_alone(path)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):
                raise  # cannot open or write: not corruption
            found = salvage(path)  # before the move: read with its WAL, where it is
            aside = path.with_name(f"{DB_NAME}.corrupt-{int(time.time())}")
            for suffix in ("", "-wal", "-shm"):
                part = Path(str(path) + suffix)
                if part.exists():
                    part.rename(Path(str(aside) + suffix))
            log.error(
                "state database corrupt, moved aside",
                path=str(path),
                aside=str(aside),
                error=str(exc),
                **{f"salvaged_{table}": found.count(table) for table in COLUMNS},
            )
            conn = _open_checked(path)
            restore(conn, found)
            problems.append(
                StoreProblem(
                    "state_store_corrupt",
                    f"state database {path} was unreadable ({exc}); moved to {aside} and "
                    f"started a new one; {found.summary()}, the rest is lost (counters "
                    "and cursors not read back start over)",
                    f"keep {aside} for support; check the disk of {state_dir} for errors",
                )
            )
        store = cls(conn, path, problems)
        try:
            conn.execute("CREATE TABLE IF NOT EXISTS _probe (x)")
            conn.execute("DROP TABLE _probe")
        except sqlite3.OperationalError as exc:
            if not _disk_full(exc):
                conn.close()
                raise
            # A full disk: what the database holds is read and delivered, what comes
            # waits in memory (store_guard.py) until a write works again.
            store._rollback()
            store._write_failed(exc)
            log.error(
                "state disk full at start; the state store is read, writes wait",
                state_dir=str(state_dir),
                error=str(exc),
            )
        return store

    @classmethod
    def in_memory(
        cls,
        problems: Sequence[StoreProblem] = (),
        found: Salvage | None = None,
        state_dir: Path | None = None,
    ) -> StateStore:
        """`found`: what the database it stands in for still held, to start from.
        `state_dir`: where that database belongs: `disk_attempt` tries it again."""
        conn = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        _migrate(conn)
        if found is not None and found.rows:
            restore(conn, found)
        store = cls(conn, None, problems)
        store.state_dir = state_dir
        if found is not None:
            store._read_back = found
        return store

    @classmethod
    def open_within(cls, state_dir: Path, timeout: float) -> StateStore:
        """`open`, given at most `timeout` seconds: a state dir on a mount that hangs (an NFS
        server gone, a FUSE daemon that never answers) would otherwise hold the agent's start
        for good, with no heartbeat and no metrics. Past the deadline the store is in memory
        (`state_store_hung`); the open that hangs is abandoned: whatever it opens once the
        mount answers is closed, never used."""
        began = time.monotonic()
        probe = MountProbe(state_dir)
        attempt: OpenAttempt | None = None
        if probe.answered(timeout):
            attempt = OpenAttempt(lambda: cls.open(state_dir), f"state-open {state_dir}")
            try:
                # The mount answered the probe: what is left of the deadline, and a moment.
                return attempt.future.result(max(timeout - (time.monotonic() - began), 1.0))
            except concurrent.futures.TimeoutError:
                attempt.abandon()
        log.error("opening the state store hangs; using memory", state_dir=str(state_dir))
        store = cls.in_memory([_hung(state_dir, timeout)], state_dir=state_dir)
        store._probe, store._attempt = probe, attempt
        return store

    # -- back to the disk (a store that started in memory) ----------------------------------

    def disk_attempt(self, timeout: float = 10.0) -> OpenAttempt | None:
        """For a store in memory: open its database on the disk again, in a thread of its
        own, after a cheap check (the mount answers a probe within `timeout`, the directory
        is writable, some room free). None while the last attempt is still running or its
        probe is still stuck on a mount that hangs (one of each waits there at most), or for
        a durable store. The caller waits for `future` as long as it will, abandons an
        attempt it stops waiting for, and hands a store it gets to `adopt`. An attempt that
        fails says why in `problems` (it may have hung before)."""
        state_dir = self.state_dir
        if self.durable or state_dir is None:
            return None
        if self._attempt is not None and self._attempt.running:
            return None
        if self._probe is not None and self._probe.stuck:
            return None

        def attempt() -> StateStore:
            probe = self._probe = MountProbe(state_dir)
            if not probe.answered(timeout):
                self._set_problem(_hung(state_dir, timeout))
                raise StateStoreError(f"the state dir {state_dir} does not answer (it hangs)")
            try:
                _disk_usable(state_dir)
                disk = StateStore._open_on_disk(state_dir, [])
                if disk.write_error is not None:  # read, but the disk is too full to write
                    error = disk.write_error
                    disk.close()
                    raise StateStoreError(f"the state disk is still full ({error})")
            except (OSError, sqlite3.Error, StateStoreError) as exc:
                # Said here, in this thread: what the problem names is looked up on the
                # disk (odd files), never on the caller's event loop.
                self._set_problem(_unusable(state_dir, exc, ()))
                raise
            return disk

        self._attempt = OpenAttempt(attempt, f"state-retry {state_dir}")
        return self._attempt

    def adopt(self, disk: StateStore, batch_rows: int | None = None) -> dict[str, int]:
        """Move what this store holds in memory into `disk` (a store `disk_attempt` opened)
        and carry on there, all at once: `moving_into(disk)`, its steps, its finish. The
        runtime takes the steps one by one instead, so that writes run between them."""
        move = self.moving_into(disk, batch_rows)
        while not move.step():
            pass
        return move.finish()

    def moving_into(self, disk: StateStore, batch_rows: int | None = None) -> Move:
        """A move of what this store holds in memory into `disk` (a store `disk_attempt`
        opened), in transactions of `batch_rows` rows (ADOPT_BATCH_ROWS): see `Move`."""
        if self.durable or disk.path is None:
            raise StateStoreError("adopt: this store is durable already, or that one is not")
        return Move(self, disk, ADOPT_BATCH_ROWS if batch_rows is None else batch_rows)

    def note_move_failed(self, error: str) -> None:
        """A move onto the disk failed part-way: the problem says so (still in memory)."""
        if self.state_dir is not None:
            self._set_problem(_move_failed(self.state_dir, error))

    def note_hung(self, timeout: float) -> None:
        """An attempt to go back to the disk did not finish within `timeout`: the problem
        says the state dir hangs."""
        if self.state_dir is not None:
            self._set_problem(_hung(self.state_dir, timeout))

    def _set_problem(self, problem: StoreProblem) -> None:
        # A new list, never changed in place: the runtime reads it from another thread.
        kept = [p for p in self.problems if p.kind not in IN_MEMORY_PROBLEMS]
        self.problems = [*kept, problem]

    # -- a spill (agent/runtime/spill.py): what a clean stop could not store -------------

    def copy_into(self, conn: sqlite3.Connection) -> None:
        """Everything this store's database holds, its schema included, into `conn` (an
        empty database): SQLite's backup, under the lock."""
        with self._lock:
            self._conn.backup(conn)

    def unsaved_removals(self) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
        """In memory: what it removed of what it read back from its database at start, which
        that database still holds: outbox entries (seq, key) delivered since, and key-value
        keys (namespace, key) deleted since. Nothing for a durable store."""
        with self._lock:
            outbox = {(int(row[0]), str(row[2])) for row in self._read_back.rows.get("outbox", [])}
            kv = {(str(row[0]), str(row[1])) for row in self._read_back.rows.get("kv", [])}
            if not outbox and not kv:
                return [], []
            have = {(int(s), str(k)) for s, k in self._conn.execute("SELECT seq, key FROM outbox")}
            keys = {
                (str(n), str(k)) for n, k in self._conn.execute("SELECT namespace, key FROM kv")
            }
        return sorted(outbox - have), sorted(kv - keys)

    def drop_held_files(self) -> None:
        """Remove `held_files`: what they held is stored elsewhere now."""
        for path in self.held_files:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # its marker keeps it from being adopted again
                log.error("an adopted spill could not be removed", path=str(path), error=str(exc))
        self.held_files = []

    @contextlib.contextmanager
    def transaction(self, failure: str) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock (a spill's adoption); any error rolls it back
        and raises StateStoreError(`failure`: error). The outbox is counted again after it."""
        with self._transaction(failure) as conn:
            yield conn
        usage = self._count_outbox()
        with self._usage_lock:
            self._usage = usage

    def to_memory(self, why: str) -> StateStore:
        """This durable store, whose disk cannot take a write, as a store in memory that
        starts from everything its database holds (read through its own connection: a disk
        too full for the `-shm` index cannot be read otherwise) and goes back there once
        the disk has room (`disk_attempt`, `Move`). This store is closed."""
        state_dir = self.state_dir
        found = Salvage()
        with self._lock:
            for table, columns in COLUMNS.items():
                sql = f"SELECT {columns} FROM {table} ORDER BY rowid"  # noqa: S608
                rows = [tuple(row) for row in self._conn.execute(sql)]
                if rows:
                    found.rows[table] = rows
        self.close()
        problem = _unusable(
            state_dir or Path("."), OSError(errno.ENOSPC, why, str(state_dir)), (), found
        )
        return StateStore.in_memory([*self.problems, problem], found, state_dir=state_dir)

    @property
    def durable(self) -> bool:
        return self.path is not None

    def close(self) -> None:
        with self._lock:
            self._checkpoint()
            self._conn.close()

    def checkpoint(self) -> None:
        """Copy the WAL into the database and cut the WAL file to nothing: the space it held
        goes back to the file system."""
        with self._lock:
            self._checkpoint()

    def _checkpoint(self) -> None:
        if self.path is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _write_failed(self, exc: sqlite3.Error) -> None:
        self.write_failures += 1
        self.last_write_failure = (time.time(), str(exc))
        self.write_error = str(exc)

    def _write_worked(self, changes_before: int) -> None:
        """After a write that committed. One that changed nothing (a delete that matched no
        row) may have written nothing either: it says nothing of a full disk."""
        if self.write_error is not None and self._conn.total_changes > changes_before:
            self.write_error = None
            # The WAL grew while the disk was full and would keep that size: give it back now
            # that there is room to copy it home.
            self._checkpoint()

    # -- the wall clock's steps ------------------------------------------------------------

    def _catch_up(self, conn: sqlite3.Connection) -> float:
        """First in every write, under the lock: when the wall clock stepped since the last
        write (NTP correcting a clock far off at boot, `date -s`), move the stamps this store
        made on the old clock (outbox entries' creation, events' time) by the step, so that
        the outbox's age bound and the history's retention count real time. Returns the
        step to confirm with `_caught_up` once the write committed (0.0: none)."""
        delta = self._steps.pending()
        if not delta:
            return 0.0
        now_old = time.time() - delta
        since_old = now_old - (time.monotonic() - self._epoch) - 1.0
        window = (delta, since_old, now_old + 1.0)
        conn.execute(
            "UPDATE outbox SET created = created + ? WHERE created BETWEEN ? AND ?", window
        )
        conn.execute("UPDATE events SET time = time + ? WHERE time BETWEEN ? AND ?", window)
        return delta

    def _caught_up(self, delta: float) -> None:
        if delta:
            self._steps.confirm(delta)
            self._epoch = time.monotonic()
            self.clock_steps.append(delta)
            log.warning("the wall clock stepped; stored stamps moved with it", seconds=delta)

    # -- plumbing ---------------------------------------------------------------------------

    _step_failing = False
    """The last try to move the stamps after a clock step failed (a full disk)."""

    def _write(self, sql: str, params: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._lock:
            if self._steps.pending():
                self._step_transaction()
            before = self._conn.total_changes
            try:
                cursor = self._conn.execute(sql, tuple(params))
            except sqlite3.Error as exc:
                self._write_failed(exc)
                raise StateStoreError(f"state store write failed: {exc}") from exc
            self._write_worked(before)
            return cursor

    @contextlib.contextmanager
    def _transaction(self, failure: str) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock; any error rolls it back and raises
        StateStoreError(`failure`: error)."""
        with self._lock:
            before = self._conn.total_changes
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                step = self._catch_up(self._conn)
                yield self._conn
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                self._write_failed(exc)
                raise StateStoreError(f"{failure}: {exc}") from exc
            except BaseException:
                self._rollback()
                raise
            self._caught_up(step)
            self._write_worked(before)

    def _step_transaction(self) -> None:
        """Under the lock: the stamps moved for a step, in a transaction of their own (before
        a single-statement write). A failure leaves the step for the next write."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            step = self._catch_up(self._conn)
            self._conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            if not self._step_failing:  # tried again at every write: said once
                log.warning("could not move stored stamps after a clock step", error=str(exc))
            self._step_failing = True
            return
        self._step_failing = False
        self._caught_up(step)

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")

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
        self.write_batch((), {(namespace, key): json.dumps(value)}, outbox=False)

    def items(self, namespace: str) -> dict[str, JSONValue]:
        rows = self._read("SELECT key, value FROM kv WHERE namespace=?", (namespace,))
        return {k: json.loads(v) for k, v in rows}

    def delete(self, namespace: str, key: str) -> None:
        self.write_batch((), {(namespace, key): None}, outbox=False)

    # -- events and outbox ------------------------------------------------------------------

    def record_event(self, event: Event, *, outbox: bool) -> None:
        """Store the event, and queue it for delivery, in one transaction."""
        self.record_events([event], outbox=outbox)

    def record_events(self, events: Sequence[Event], *, outbox: bool) -> None:
        """Store events, and queue them for delivery, in one transaction (a burst of events
        costs one commit, not one each)."""
        self.write_batch(events, {}, outbox=outbox)

    def write_batch(self, events: Sequence[Event], values: KvChanges, *, outbox: bool) -> None:
        """Events (queued for delivery too with `outbox`), then key-value changes, in one
        transaction: a value that depends on an event (a log cursor past it) is never stored
        without the event. An event whose id is stored already is neither stored nor queued
        again (`_new_events`)."""
        rows: Sequence[EventRow] = [
            (e.id, e.time, int(e.severity), e.source, e.kind, e.subject, e.to_json())
            for e in events
        ]
        if events:
            ids = ", ".join(e.id for e in events[:3])
            failure = f"cannot store {len(events)} event(s) ({ids}...)"
        else:
            failure = "state store write failed"
        with self._transaction(failure) as conn:
            queued = time.time()  # after a step is caught up: on the clock as it reads now
            rows = _new_events(conn, rows)
            conn.executemany(
                "INSERT INTO events(id, time, severity, source, kind, subject, body)"
                " VALUES (?,?,?,?,?,?,?)",
                rows,
            )
            if outbox:
                conn.executemany(
                    "INSERT INTO outbox(kind, key, created, payload) VALUES ('event',?,?,?)",
                    # created: when it was queued, not when it happened: the outbox's age
                    # bound must not expire a kernel-log event of last week on arrival.
                    [(row[0], queued, row[6].encode()) for row in rows],
                )
            conn.executemany(
                "INSERT INTO kv(namespace, key, value, updated) VALUES (?,?,?,?) "
                "ON CONFLICT(namespace, key) DO UPDATE SET value=excluded.value, "
                "updated=excluded.updated",
                [(ns, key, text, queued) for (ns, key), text in values.items() if text is not None],
            )
            conn.executemany(
                "DELETE FROM kv WHERE namespace=? AND key=?",
                [(ns, key) for (ns, key), text in values.items() if text is None],
            )
        if outbox and rows:
            self._count("event", len(rows), sum(len(row[6].encode()) for row in rows))

    def recent_events(
        self, limit: int = 100, min_severity: Severity = Severity.INFO
    ) -> list[Event]:
        rows = self._read(
            "SELECT body FROM events WHERE severity >= ? ORDER BY time DESC LIMIT ?",
            (int(min_severity), limit),
        )
        return [Event.from_dict(json.loads(body)) for (body,) in rows]

    def events_since(
        self, source: str, kinds: Sequence[str], since: float, limit: int = 2000
    ) -> list[Event]:
        """The stored events of `source` of `kinds` at or after `since` (their own time), the
        newest `limit`, oldest first: what a collector of a restarted process takes over (the
        Xid correlator's incidents of its last life)."""
        if not kinds:
            return []
        marks = _marks(len(kinds))  # placeholders only: the kinds are parameters
        sql = f"SELECT body FROM events WHERE time >= ? AND source = ? AND kind IN ({marks})"  # noqa: S608
        rows = self._read(sql + " ORDER BY time DESC LIMIT ?", (since, source, *kinds, limit))
        return [Event.from_dict(json.loads(body)) for (body,) in reversed(rows)]

    def prune_events(self, older_than: float) -> int:
        return self._write("DELETE FROM events WHERE time < ?", (older_than,)).rowcount

    def outbox_put(self, kind: str, key: str, payload: bytes, created: float | None = None) -> int:
        cursor = self._write(
            "INSERT INTO outbox(kind, key, created, payload) VALUES (?,?,?,?)",
            (kind, key, time.time() if created is None else created, payload),
        )
        self._count(kind, 1, len(payload))
        return int(cursor.lastrowid or 0)

    def outbox_replace(
        self, kind: str, key: str, payload: bytes, created: float | None = None
    ) -> int:
        """Queue `payload` in place of every undelivered entry of its kind, in one
        transaction (a heartbeat: its topic is retained, only the newest says anything)."""
        with self._transaction("state store write failed") as conn:
            gone = self._usage_of(conn, "kind=?", (kind,))
            conn.execute("DELETE FROM outbox WHERE kind=?", (kind,))
            cursor = conn.execute(
                "INSERT INTO outbox(kind, key, created, payload) VALUES (?,?,?,?)",
                (kind, key, time.time() if created is None else created, payload),
            )
        self._uncount(gone)
        self._count(kind, 1, len(payload))
        return int(cursor.lastrowid or 0)

    def outbox_peek(self, limit: int = 100, after_seq: int = 0) -> list[OutboxEntry]:
        rows = self._read(
            "SELECT seq, kind, key, created, payload FROM outbox WHERE seq > ? ORDER BY seq LIMIT ?",
            (after_seq, limit),
        )
        return [
            OutboxEntry(int(s), str(k), str(key), float(c), bytes(p)) for s, k, key, c, p in rows
        ]

    def outbox_ack(self, seqs: Sequence[int]) -> dict[str, int]:
        """Delete entries by seq (delivered, or dropped by a bound); how many of each kind
        were still there."""
        if not seqs:
            return {}
        gone: dict[str, tuple[int, int]] = {}
        with self._transaction("state store write failed") as conn:
            for chunk in _chunks(seqs):
                marks = _marks(len(chunk))
                for kind, (count, size) in self._usage_of(conn, f"seq IN ({marks})", chunk).items():
                    before = gone.get(kind, (0, 0))
                    gone[kind] = (before[0] + count, before[1] + size)
                conn.execute(f"DELETE FROM outbox WHERE seq IN ({marks})", chunk)  # noqa: S608
        self._uncount(gone)
        return {kind: count for kind, (count, _) in gone.items()}

    def outbox_depth(self) -> dict[str, int]:
        with self._usage_lock:
            return {kind: count for kind, (count, _) in self._usage.items() if count}

    # -- outbox bounds (the MQTT sink's exporters/outbox.py decides what to drop) -----------

    def outbox_usage(self) -> tuple[int, int]:
        """(entries, payload bytes) in the outbox."""
        with self._usage_lock:
            return (
                sum(count for count, _ in self._usage.values()),
                sum(size for _, size in self._usage.values()),
            )

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
        with self._lock:  # asked every second: a read first, a transaction only if needed
            try:
                if not self._usage_of(self._conn, "created < ?", (created_before,)):
                    return {}
            except sqlite3.Error as exc:
                raise StateStoreError(f"cannot expire outbox entries: {exc}") from exc
        with self._transaction("cannot expire outbox entries") as conn:
            gone = self._usage_of(conn, "created < ?", (created_before,))
            if gone:
                conn.execute("DELETE FROM outbox WHERE created < ?", (created_before,))
        self._uncount(gone)
        return {kind: count for kind, (count, _) in gone.items()}

    # -- outbox accounting ------------------------------------------------------------------

    @staticmethod
    def _usage_of(
        conn: sqlite3.Connection, where: str, params: Sequence[Any]
    ) -> dict[str, tuple[int, int]]:
        """kind -> (entries, payload bytes) of the outbox rows matching `where`. LENGTH of a
        blob reads its header only, not the payload."""
        rows = conn.execute(
            "SELECT kind, COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM outbox "  # noqa: S608
            f"WHERE {where} GROUP BY kind",
            tuple(params),
        ).fetchall()
        return {str(kind): (int(count), int(size)) for kind, count, size in rows}

    def _count_outbox(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            return self._usage_of(self._conn, "1", ())

    def _count(self, kind: str, entries: int, size: int) -> None:
        with self._usage_lock:
            count, total = self._usage.get(kind, (0, 0))
            self._usage[kind] = (count + entries, total + size)

    def _uncount(self, gone: Mapping[str, tuple[int, int]]) -> None:
        for kind, (count, size) in gone.items():
            self._count(kind, -count, -size)


ADOPT_BATCH_ROWS = 1000
"""Rows a step of a move from memory to the disk copies in one transaction (`Move`): about
30 ms of the store thread here (bench/state_adopt.py), where one transaction of a full outbox
(100k entries, 64 MiB) held it for 3-4 s."""


class Move:
    """What a store in memory holds, moved into its database on the disk (`StateStore.adopt`).

    `step()` copies one batch of outbox entries, then of events, each in a transaction of its
    own, the memory store's lock held only to read the batch: writes to memory go on between
    steps, and what they add is copied by a later step. `finish()`, under both locks, copies
    the rest, settles what changed in memory meanwhile, moves the key-value area and carries
    on on the disk: this store becomes durable, its startup problem (unwritable, hung) goes,
    `disk` is used up. Until `finish` commits, the copied rows are marked (agent/runtime/
    moving.py): a move cut short, by a kill or a disk full again, is undone at the next open
    (or at once, after a failure), and leaves the database as it was. On failure
    (StateStoreError) nothing has moved and the store stays in memory.

    Nothing is lost or stored twice, and what a sink knows stays true: outbox entries keep
    their sequence numbers (a sink's cursor and its delivered-but-not-deleted list refer to
    them). An entry that memory read back from the disk at start and has since delivered is
    deleted there, and so is one copied and delivered during the move; one that the disk holds
    and memory never saw (unreadable at start) stays, numbered after every number memory
    gave, so that a sink's cursor reaches it. Events are kept once by id; state values are
    memory's where it has them (it started from the disk's and changed them since), a value
    memory read back and deleted is deleted."""

    def __init__(self, memory: StateStore, disk: StateStore, batch_rows: int) -> None:
        self.memory, self.disk = memory, disk
        self.batch_rows = max(1, batch_rows)
        self.batches = 0
        self._began = False
        self._ended = False
        self._outbox_after = 0
        """Memory's outbox is copied up to this sequence number."""
        self._events_after = 0
        """Memory's events are copied up to this rowid."""
        self._outbox_done = False
        self._events_done = False
        self._known: set[int] = set()
        """The disk's entries that memory read back at start (the same number, the same key)."""
        self._set_aside = 0
        self._aside_usage: dict[str, tuple[int, int]] = {}
        """kind -> (entries, payload bytes) of the disk's own entries."""
        self._staged: set[int] = set()
        """The outbox entries a step copied."""
        self._outbox_moved = 0
        self._events_moved = 0
        self._steps = len(memory.clock_steps)

    def step(self) -> bool:
        """One transaction of the move; True once everything there was is copied (`finish`
        next). Raises StateStoreError, after which the move is undone."""
        if self._ended:
            raise StateStoreError("this move has ended")
        try:
            if not self._began:
                self._begin()
            elif not self._outbox_done:
                self._copy_outbox()
            elif not self._events_done:
                self._copy_events()
        except sqlite3.Error as exc:
            self._failed(exc)
        return self._began and self._outbox_done and self._events_done

    def _begin(self) -> None:
        with self.memory._lock:
            rows = self.memory._read_back.rows.get("outbox", [])
            read_back = {int(row[0]): row[2] for row in rows}
        conn = self.disk._conn
        with self.disk._lock:
            moving.undo(conn)  # one left from before (an open undoes it already)
            conn.execute("BEGIN IMMEDIATE")
            moving.begin(conn)
            theirs = conn.execute("SELECT seq, key FROM outbox ORDER BY seq").fetchall()
            self._known = {int(seq) for seq, key in theirs if read_back.get(int(seq)) == key}
            # The disk's own entries, out of the way of memory's numbers until `finish`.
            unknown = [int(seq) for seq, _ in theirs if int(seq) not in self._known]
            for chunk in _chunks(unknown):
                marks = _marks(len(chunk))
                sql = f"UPDATE outbox SET seq = seq - ? WHERE seq IN ({marks})"  # noqa: S608
                conn.execute(sql, (moving.SET_ASIDE, *chunk))
            self._aside_usage = StateStore._usage_of(conn, "seq < 0", ())
            conn.execute("COMMIT")
        self._set_aside = len(unknown)
        self._began = True

    def _outbox_rows(self, limit: int | None) -> list[tuple[Any, ...]]:
        """Under the memory store's lock: its entries not copied yet, `limit` at most."""
        rows = self.memory._conn.execute(
            "SELECT seq, kind, key, created, payload FROM outbox WHERE seq > ? ORDER BY seq "
            "LIMIT ?",
            (self._outbox_after, -1 if limit is None else limit),
        ).fetchall()
        if rows:
            self._outbox_after = int(rows[-1][0])
        return [row for row in rows if int(row[0]) not in self._known]

    def _event_rows(self, limit: int | None) -> list[EventRow]:
        rows = self.memory._conn.execute(
            "SELECT rowid, id, time, severity, source, kind, subject, body FROM events "
            "WHERE rowid > ? ORDER BY rowid LIMIT ?",
            (self._events_after, -1 if limit is None else limit),
        ).fetchall()
        if rows:
            self._events_after = int(rows[-1][0])
        return [tuple(row[1:]) for row in rows]

    def _copy_outbox(self) -> None:
        with self.memory._lock:
            rows = self._outbox_rows(self.batch_rows)
            self._outbox_done = self._outbox_after >= self._memory_top_seq()
        conn = self.disk._conn
        with self.disk._lock:
            conn.execute("BEGIN IMMEDIATE")
            self._insert_outbox(conn, rows, staged=True)
            conn.execute("COMMIT")
        self.batches += 1

    def _copy_events(self) -> None:
        with self.memory._lock:
            rows = self._event_rows(self.batch_rows)
            self._events_done = len(rows) < self.batch_rows
        conn = self.disk._conn
        with self.disk._lock:
            conn.execute("BEGIN IMMEDIATE")
            self._insert_events(conn, rows, staged=True)
            conn.execute("COMMIT")
        self.batches += 1

    def _memory_top_seq(self) -> int:
        row = self.memory._conn.execute("SELECT MAX(seq) FROM outbox").fetchone()
        return int(row[0] or 0)

    def _insert_outbox(
        self, conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]], staged: bool
    ) -> None:
        conn.executemany(
            "INSERT INTO outbox(seq, kind, key, created, payload) VALUES (?,?,?,?,?)", rows
        )
        if staged:
            conn.executemany(
                f"INSERT INTO {moving.STAGED_OUTBOX}(seq) VALUES (?)",  # noqa: S608
                [(row[0],) for row in rows],
            )
            self._staged.update(int(row[0]) for row in rows)
        self._outbox_moved += len(rows)

    def _insert_events(
        self, conn: sqlite3.Connection, rows: Sequence[EventRow], staged: bool
    ) -> None:
        fresh = _new_events(conn, rows)
        conn.executemany(
            "INSERT INTO events(id, time, severity, source, kind, subject, body) "
            "VALUES (?,?,?,?,?,?,?)",
            fresh,
        )
        if staged:
            conn.executemany(
                f"INSERT INTO {moving.STAGED_EVENTS}(id) VALUES (?)",  # noqa: S608
                [(row[0],) for row in fresh],
            )
        self._events_moved += len(fresh)

    def finish(self) -> dict[str, int]:
        """The move's last transaction, under both locks, then the store on the disk.
        Returns how many outbox entries, events and state values moved. Raises
        StateStoreError, after which the move is undone and the store stays in memory."""
        while not self.step():  # the steps not taken yet
            pass
        memory, disk = self.memory, self.disk
        with memory._lock, disk._lock:
            try:
                values = self._settle(memory._conn, disk._conn)
            except sqlite3.Error as exc:
                self._failed(exc)
            self._ended = True
            old, memory._conn = memory._conn, disk._conn
            memory.path = disk.path
            old.close()
            memory._read_back = Salvage()
            memory.write_error = None
            with memory._usage_lock:  # memory's entries, all moved, and the disk's own
                for kind, (count, size) in self._aside_usage.items():
                    before = memory._usage.get(kind, (0, 0))
                    memory._usage[kind] = (before[0] + count, before[1] + size)
        memory.problems = [p for p in memory.problems if p.kind not in IN_MEMORY_PROBLEMS]
        memory.drop_held_files()  # what they held is on the disk now (their markers too)
        moved = {
            "outbox_moved": self._outbox_moved,
            "outbox_renumbered": self._set_aside,
            "events_moved": self._events_moved,
            "values_moved": values,
            "batches": self.batches,
        }
        log.warning("the state store is durable again", path=str(memory.path), **moved)
        return moved

    def _settle(self, mine: sqlite3.Connection, conn: sqlite3.Connection) -> int:
        """Under both locks, in one transaction: what memory wrote since the last step,
        what it deleted since a step copied it, the disk's own entries numbered after
        memory's, the key-value area. Returns how many values moved."""
        conn.execute("BEGIN IMMEDIATE")
        copied = self._known | self._staged
        # Read back at start, or copied by a step, and gone from memory since: delivered or
        # dropped. Counted first: a full outbox that waits for a broker has lost none.
        after = self._outbox_after
        kept = mine.execute("SELECT COUNT(*) FROM outbox WHERE seq <= ?", (after,)).fetchone()
        if int(kept[0]) != len(copied):
            rows = mine.execute("SELECT seq FROM outbox WHERE seq <= ?", (after,)).fetchall()
            gone = copied - {int(seq) for (seq,) in rows}
            for chunk in _chunks(sorted(gone)):
                conn.execute(f"DELETE FROM outbox WHERE seq IN ({_marks(len(chunk))})", chunk)  # noqa: S608
        self._insert_outbox(conn, self._outbox_rows(None), staged=False)
        self._insert_events(conn, self._event_rows(None), staged=False)
        if len(self.memory.clock_steps) != self._steps:
            # The wall clock stepped during the move: memory moved its stamps, the copies
            # of them are on the old clock.
            conn.executemany(
                "UPDATE outbox SET created = ? WHERE seq = ?",
                mine.execute("SELECT created, seq FROM outbox").fetchall(),
            )
            conn.executemany(
                "UPDATE events SET time = ? WHERE id = ?",
                mine.execute("SELECT time, id FROM events").fetchall(),
            )
        # The highest number memory ever gave (its entries delivered since included): a sink
        # may have read up to it, so what the disk gives from now on comes after it.
        counter = mine.execute("SELECT seq FROM sqlite_sequence WHERE name='outbox'").fetchone()
        top_row = conn.execute("SELECT MAX(seq) FROM outbox").fetchone()
        top = max(0, int(top_row[0] or 0), int(counter[0]) if counter else 0)
        aside = [
            int(s) for (s,) in conn.execute("SELECT seq FROM outbox WHERE seq < 0 ORDER BY seq")
        ]
        for seq in aside:
            top += 1
            conn.execute("UPDATE outbox SET seq = ? WHERE seq = ?", (top, seq))
        conn.execute("DELETE FROM sqlite_sequence WHERE name='outbox'")
        conn.execute("INSERT INTO sqlite_sequence(name, seq) VALUES ('outbox', ?)", (top,))
        values = mine.execute("SELECT namespace, key, value, updated FROM kv").fetchall()
        read_kv = {(row[0], row[1]) for row in self.memory._read_back.rows.get("kv", [])}
        deleted = read_kv - {(row[0], row[1]) for row in values}
        conn.executemany("DELETE FROM kv WHERE namespace=? AND key=?", sorted(deleted))
        conn.executemany(
            "INSERT INTO kv(namespace, key, value, updated) VALUES (?,?,?,?) "
            "ON CONFLICT(namespace, key) DO UPDATE SET value=excluded.value, "
            "updated=excluded.updated",
            values,
        )
        moving.drop(conn)
        conn.execute("COMMIT")
        return len(values)

    def _failed(self, exc: sqlite3.Error) -> NoReturn:
        """The move undone (or, where the disk cannot take even that, left for the next
        open to undo), `disk` closed; memory holds everything still."""
        self._ended = True
        conn = self.disk._conn
        with self.disk._lock:
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            with contextlib.suppress(sqlite3.Error):
                moving.undo(conn)
            with contextlib.suppress(sqlite3.Error):
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.close()
        raise StateStoreError(f"cannot move the state into {self.disk.path}: {exc}") from exc

    def abandon(self) -> None:
        """Stop here (the agent stops): the move undone, `disk` closed."""
        if self._ended:
            return
        with contextlib.suppress(StateStoreError):
            self._failed(sqlite3.OperationalError("the move was abandoned"))
