"""What a clean stop could not store, kept in the runtime dir until the next start adopts it.

A store that cannot write (a full state disk: events and values wait in the store guard's
queue) or that runs in memory (its state dir unusable at start) holds, at a clean stop
(SIGTERM: systemd's stop or restart, a package upgrade), what exists nowhere else:
undelivered events, the counters (`gpuwarden_events_total`, the Xid counts) and the cursors
that go with them. `write` puts it into a spill: a StateStore database of its own in the
runtime dir (`runtime_dir`: systemd's `RuntimeDirectory=`, a tmpfs that outlives a restart of
the agent and not a reboot), written under a temporary name, fsynced and renamed, so that a
kill -9 while it is written leaves either no spill or the whole of it.

At start, before the runtime is made (before any collector runs), `adopt_all` merges every
spill found into the store in one transaction each and removes it:

- its outbox's events are queued again unless the store holds the event already (by id, in
  its history or its outbox), so that none is delivered twice; other outbox kinds are
  snapshots the new life replaces;
- its history events are kept once by id;
- its values are the latest (the store could not take them), so they win, on the same boot;
  a spill of another boot adds only the keys the store lacks (per-boot values follow the
  store's own rules: a count of another boot is not carried);
- what its store removed of what the database on the disk still holds (entries delivered,
  values deleted) is removed there too;
- a marker (the spill's id, in the same transaction) makes adoption happen once: a kill -9
  after the commit and before the file is removed, and the spill is found again and skipped.
  Adopted into memory, the spill stays (`StateStore.held_files`) until the store is durable
  or a newer spill holds it: a kill -9 meanwhile finds it again at the next start (what was
  delivered of it since goes again, under the same id and payload, rather than being lost).

A store on a disk too full to take the merge goes to memory, starting from all its database
holds (`StateStore.to_memory`), and adopts the spill there; it moves back to the disk once
there is room (the runtime's `_back_to_disk`), and a clean stop before that spills again. A
spill that cannot be read as one (corrupt, foreign) gives what salvage still reads of its
events and is moved aside (`.corrupt-<time>`), reported, never a failed start.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, RepairAction, Severity
from agent.runtime.salvage import COLUMNS, salvage
from agent.runtime.state import StateStore, _migrate, _new_events
from agent.runtime.store_guard import SPILLED_NAMESPACE, Queued, StoreGuard

log = structlog.get_logger(component="state")

PREFIX, SUFFIX = "spill-", ".db"
"""A spill's file name: `spill-<time>-<pid>.db`; anything else in the runtime dir is not one."""
TEMPORARY = ".spill-"
"""The prefix of a spill being written; one left by a kill -9 is removed."""
ADOPTED_NAMESPACE = SPILLED_NAMESPACE
"""The key-value namespace of the adopted spills' ids (the marker); a flush that stores all
a spill written while the store could not take it marks that spill there too."""
META = "spill_meta"
GONE = "spill_gone"
DELETED = "spill_deleted"

Hook = Callable[[str], None]
"""Called at named points of a write or an adoption (tests kill the process there)."""


def _nothing(_point: str) -> None:
    return None


@dataclass(frozen=True)
class Spilled:
    """What a clean stop left in memory, and where it went."""

    path: Path | None
    """The spill written; None when there was nothing to spill or it could not be written."""
    events: int = 0
    """Events queued in the store guard (not stored)."""
    values: int = 0
    """State values queued in the store guard."""
    outbox: int = 0
    """Outbox entries of a store in memory (undelivered)."""
    error: str | None = None
    """Why it could not be written: then all of the above is lost."""


@dataclass
class Adopted:
    """One spill found at start."""

    path: Path
    counts: dict[str, int] = field(default_factory=dict)
    boot: str = ""
    written: float = 0.0
    aside: Path | None = None
    """Where an unreadable spill was moved."""
    error: str | None = None

    def event(self, node_subject: str) -> Event:
        if self.error is not None:
            return Event(
                source="state",
                kind="state_spill_unreadable",
                severity=Severity.WARNING,
                repair_action=RepairAction.NONE,
                subject=node_subject,
                message=f"a spill of unsaved state in {self.path.parent} could not be read "
                f"({self.error}); moved to {self.aside}; "
                f"{self.counts.get('outbox_adopted', 0)} readable events of it are queued, "
                "its counters and cursors are lost",
                action=f"keep {self.aside} for support",
                attributes={"path": str(self.aside), "error": self.error, **self.counts},
            )
        return Event(
            source="state",
            kind="state_spill_adopted",
            severity=Severity.INFO,
            repair_action=RepairAction.NONE,
            subject=node_subject,
            message=f"the state the last clean stop could not store (spilled to "
            f"{self.path.parent}) is adopted into the state store: "
            f"{self.counts.get('outbox_adopted', 0)} undelivered events queued, "
            f"{self.counts.get('values_adopted', 0)} counters and cursors carried",
            attributes={"boot_id": self.boot, "written": self.written, **self.counts},
        )


# -- the stop ------------------------------------------------------------------------------


def needed(store: StateStore, guard: StoreGuard) -> bool:
    """Whether a stop leaves anything only in memory."""
    return guard.pending or not store.durable


def write(
    store: StateStore,
    guard: StoreGuard,
    runtime_dir: Path,
    *,
    boot_id: str,
    outbox: bool,
    hook: Hook = _nothing,
) -> Spilled:
    """At a clean stop, after the last flush: what the store could not take (the guard's
    queue, and for a store in memory all it holds) into a spill in `runtime_dir`. Never
    raises for the disk: a runtime dir that cannot take it is one error log line, naming
    the path and what is lost."""
    if not needed(store, guard):
        return Spilled(None)
    done = _spill(store, guard, runtime_dir, boot_id=boot_id, outbox=outbox, hook=hook, live=False)
    if done.error is not None:
        log.error(
            "unsaved state not spilled; it is lost with this stop",
            runtime_dir=str(runtime_dir),
            error=done.error,
            events_lost=done.events,
            values_lost=done.values,
            outbox_entries_lost=done.outbox,
            store="disk" if store.durable else "memory",
        )
        return done
    log.warning(
        "state_spilled: what the state store could not take is kept in the runtime dir "
        "until the next start adopts it",
        kind="state_spilled",
        path=str(done.path),
        events=done.events,
        values=done.values,
        outbox_entries=done.outbox,
        store="disk" if store.durable else "memory",
    )
    return done


def _spill(
    store: StateStore,
    guard: StoreGuard,
    runtime_dir: Path,
    *,
    boot_id: str,
    outbox: bool,
    hook: Hook,
    live: bool,
    spill_id: str | None = None,
) -> Spilled:
    """One spill file, written under a temporary name, fsynced, renamed; then the spills it
    replaces (`StateStore.held_files`) are removed and it is held in their place. `live`:
    written while the agent runs, from a snapshot of the guard's queue (which keeps it),
    not from a flush (which empties it, at the stop)."""
    hook("start")
    events, values = guard.queued_events, guard.queued_values
    entries = 0 if store.durable else sum(store.outbox_depth().values())
    spill_id = spill_id or uuid.uuid4().hex
    name = f"{PREFIX}{time.time_ns()}-{os.getpid()}{SUFFIX}"
    temporary = runtime_dir / f"{TEMPORARY}{name}"
    try:
        if not runtime_dir.is_dir():
            runtime_dir.mkdir(mode=0o700)  # outside systemd; its parent (/run) must be there
        _write_file(
            store,
            guard,
            temporary,
            boot_id=boot_id,
            outbox=outbox,
            hook=hook,
            spill_id=spill_id,
            live=live,
        )
        hook("synced")
        final = runtime_dir / name
        temporary.rename(final)
        hook("renamed")
        _sync_dir(runtime_dir)
        store.drop_held_files()  # the spills this store adopted or wrote: this one holds them
        if live:
            store.held_files.append(final)
    except (OSError, sqlite3.Error, StateStoreError) as exc:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        return Spilled(None, events, values, entries, str(exc) or type(exc).__name__)
    return Spilled(final, events, values, entries)


def _write_file(
    store: StateStore,
    guard: StoreGuard,
    path: Path,
    *,
    boot_id: str,
    outbox: bool,
    hook: Hook,
    spill_id: str,
    live: bool,
) -> None:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        os.chmod(path, 0o600)
        conn.execute("PRAGMA journal_mode=MEMORY")  # atomic by the rename, not by a journal
        gone: Sequence[tuple[int, str]] = ()
        deleted: set[tuple[str, str]] = set()
        queued: Queued | None = None
        if store.durable:
            _migrate(conn)
            if live:
                queued = guard.snapshot(spill_id)
        else:
            # No flush between the queue's snapshot and the store's copy: what moves from
            # the one to the other meanwhile would be in neither.
            with guard.writing if live else contextlib.nullcontext():
                if live:
                    queued = guard.snapshot(spill_id)
                store.copy_into(conn)
                gone, removed = store.unsaved_removals()
            deleted.update(removed)
        hook("begun")
        spill = StateStore(conn, None, [])
        if queued is not None:
            deleted.update(queued.deletes)
            queued.into(spill, outbox)
        else:
            deleted.update(guard.pending_deletes())
            if guard.pending and not guard.flush_into(spill, outbox):
                raise StateStoreError(f"cannot write the queued state into {path}: {guard.failing}")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(f"CREATE TABLE {META} (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute(f"CREATE TABLE {GONE} (seq INTEGER NOT NULL, key TEXT NOT NULL)")
        conn.execute(f"CREATE TABLE {DELETED} (namespace TEXT NOT NULL, key TEXT NOT NULL)")
        meta = {
            "id": spill_id,
            "boot_id": boot_id,
            "written": repr(time.time()),
            "store": "disk" if store.durable else "memory",
        }
        conn.executemany(f"INSERT INTO {META} VALUES (?, ?)", meta.items())  # noqa: S608
        conn.executemany(f"INSERT INTO {GONE} VALUES (?, ?)", gone)  # noqa: S608
        kept = {(str(n), str(k)) for n, k in conn.execute("SELECT namespace, key FROM kv")}
        conn.executemany(f"INSERT INTO {DELETED} VALUES (?, ?)", sorted(deleted - kept))  # noqa: S608
        hook("written")
        conn.execute("COMMIT")
    finally:
        conn.close()
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- while the agent runs ---------------------------------------------------------------

EVENT_DELAY = 0.2
"""Seconds from an event queued while the store cannot take it to the spill that holds it:
a burst within it is one write."""
VALUE_DELAY = 1.0
"""Seconds from a value (a cursor, a count) changed while the store cannot take it to the
spill that holds it."""
MAX_SHARE = 0.1
"""The share of one CPU the spill takes at most: after a write of c seconds the next waits
c * (1 / MAX_SHARE - 1) seconds (bench/state_spill.py measures c)."""
CHECK_EVERY = 0.5
"""Seconds between looks at the store while nothing is said to have changed (a write
refused, a store moved onto the disk)."""
RETRY_EVERY = 5.0
"""Seconds between attempts while the runtime dir refuses the spill."""


class LiveSpill:
    """While the store is not durable (in memory, or its disk refuses the writes and the
    guard queues them), a spill in `runtime_dir` kept up to date, so that a kill -9 loses
    only what changed within the last EVENT_DELAY (an event) or VALUE_DELAY (a value).

    A thread of its own (never the event loop: a spill copies the whole backlog). The guard
    says what changed (`StoreGuard.changed`); a burst is one write; each write replaces the
    one before (whole or not at all, as at the stop) and is marked by the flush that stores
    all of it, so that, left behind by a kill -9, it is not adopted over newer values. Once
    the store is durable and holds all of it, the spill is removed. A runtime dir that
    refuses it is one log line and a health problem naming what is at risk."""

    def __init__(
        self,
        store: StateStore,
        guard: StoreGuard,
        runtime_dir: Path,
        *,
        boot_id: str,
        outbox: Callable[[], bool],
        hook: Hook = _nothing,
    ) -> None:
        self.store, self.guard, self.runtime_dir = store, guard, runtime_dir
        self.boot_id, self._outbox, self._hook = boot_id, outbox, hook
        self.writes = 0
        self.seconds = 0.0
        """Time spent writing spills, in all."""
        self.last_cost = 0.0
        self.error: str | None = None
        """Why the latest spill could not be written; None once one is."""
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._event_at: float | None = None
        self._value_at: float | None = None
        self._not_before = 0.0
        self._at_risk = False
        self._current: str | None = None
        """The id of the spill written last (held by the store)."""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.guard.changed = self._changed
        self._thread = threading.Thread(target=self._run, name="state-live-spill", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the thread (a write under way ends first, within `timeout`). False when it
        is still writing (the runtime dir hangs)."""
        self.guard.changed = None
        self._stopping.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _changed(self, event: bool) -> None:
        now = time.monotonic()
        with self._lock:
            if event and self._event_at is None:
                self._event_at = now
            elif not event and self._value_at is None:
                self._value_at = now
        self._wake.set()

    def at_risk(self) -> bool:
        """What exists only in this process's memory: a store in memory, or a queue the
        store refuses."""
        if not self.store.durable:
            return True
        return self.guard.pending and self.guard.failing is not None

    def problems(self) -> list[str]:
        if self.error is None or not self.at_risk():
            return []
        return [
            f"unsaved state cannot be spilled to {self.runtime_dir} ({self.error}): a kill "
            f"loses {self.guard.queued_events} events and {self.guard.queued_values} state "
            "values waiting in memory"
            + ("" if self.store.durable else ", and all the state store holds in memory")
        ]

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._timeout())
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self._step()
            except Exception:  # a bug must not end the spills for good
                log.exception("the live spill failed; retrying")
                self._not_before = time.monotonic() + RETRY_EVERY

    def _due(self) -> float | None:
        with self._lock:
            said = ((self._event_at, EVENT_DELAY), (self._value_at, VALUE_DELAY))
        times = [at + delay for at, delay in said if at is not None]
        return max(min(times), self._not_before) if times else None

    def _timeout(self) -> float:
        due = self._due()
        if due is None:
            return CHECK_EVERY
        return min(CHECK_EVERY, max(0.0, due - time.monotonic()))

    def _step(self) -> None:
        risk = self.at_risk()
        if not risk:
            # What was told is the store's already: nothing is due (a due time left set
            # would make every wait 0, and the thread spin, holding the GIL from the loop).
            with self._lock:
                self._event_at = self._value_at = None
            if self._at_risk or self.store.held_files:
                self._settle()
            return
        if not self._at_risk:  # what waits now was said before it was at risk
            self._at_risk = True
            self._changed(self.guard.queued_events > 0)
        due = self._due()
        if due is None or time.monotonic() < due:
            return
        with self._lock:
            self._event_at = self._value_at = None
        self.write_now()

    def _settle(self) -> None:
        """Durable, holding all: the spill goes (marked already by the flush that stored it)."""
        if not self.store.durable or self.guard.pending:
            return
        self._at_risk = False
        with self._lock:
            self._event_at = self._value_at = None
        if self.store.held_files:
            log.info(
                "the state store holds all a spill held; removed",
                paths=[str(p) for p in self.store.held_files],
            )
            self.store.drop_held_files()
        if self._current is not None:
            self.guard.forget_spill(self._current)
            self._current = None
        self.error = None

    def write_now(self) -> None:
        """One write, as the thread makes it (bench/state_spill.py times it)."""
        began = time.monotonic()
        cpu = time.thread_time()
        spill_id = uuid.uuid4().hex
        done = _spill(
            self.store,
            self.guard,
            self.runtime_dir,
            boot_id=self.boot_id,
            outbox=self._outbox(),
            hook=self._hook,
            live=True,
            spill_id=spill_id,
        )
        cost = max(time.thread_time() - cpu, 0.0)
        self.last_cost = time.monotonic() - began
        self.seconds += self.last_cost
        if done.error is not None:
            self.guard.forget_spill(spill_id)
            if self.error is None:
                log.error(
                    "unsaved state cannot be spilled to the runtime dir; a kill loses it",
                    runtime_dir=str(self.runtime_dir),
                    error=done.error,
                    events_at_risk=done.events,
                    values_at_risk=done.values,
                    outbox_entries_at_risk=done.outbox,
                    store="disk" if self.store.durable else "memory",
                )
            self.error = done.error
            self._not_before = time.monotonic() + RETRY_EVERY
            self._changed(True)  # tried again then
            return
        if self.error is not None:
            log.warning("unsaved state is spilled to the runtime dir again", path=str(done.path))
        self.error = None
        self.writes += 1
        if self._current is not None:
            self.guard.forget_spill(self._current)  # its file is replaced by this one
        self._current = spill_id
        # The next write no sooner than its own cost allows: at most MAX_SHARE of a CPU.
        self._not_before = time.monotonic() + max(cost, self.last_cost) * (1 / MAX_SHARE - 1)
        log.debug("state spilled while running", path=str(done.path), events=done.events)


# -- the start -----------------------------------------------------------------------------


@dataclass
class _Contents:
    spill_id: str
    boot: str
    written: float
    outbox: list[tuple[Any, ...]]
    events: list[tuple[Any, ...]]
    kv: list[tuple[Any, ...]]
    gone: list[tuple[int, str]]
    deleted: list[tuple[str, str]]


def found(runtime_dir: Path) -> list[Path]:
    """The spills in `runtime_dir`, oldest first; a half-written one (a kill -9 in `write`)
    is removed."""
    try:
        names = sorted(os.listdir(runtime_dir))
    except OSError:
        return []
    for name in names:
        if name.startswith(TEMPORARY):
            with contextlib.suppress(OSError):
                (runtime_dir / name).unlink()
    spills = [n for n in names if n.startswith(PREFIX) and n.endswith(SUFFIX)]
    return sorted((runtime_dir / n for n in spills), key=_written_ns)


def _written_ns(path: Path) -> int:
    try:
        return int(path.name[len(PREFIX) :].split("-", 1)[0])
    except ValueError:
        return 0


def adopt_all(
    store: StateStore, runtime_dir: Path, *, boot_id: str, hook: Hook = _nothing
) -> tuple[StateStore, list[Adopted]]:
    """Every spill in `runtime_dir` merged into `store` and removed, oldest first. Returns
    the store to use from now on (in memory, where the disk could not take the merge) and
    what each spill gave. Never raises for a spill or the runtime dir."""
    reports: list[Adopted] = []
    for path in found(runtime_dir):
        report = Adopted(path)
        try:
            contents = _read(path)
        except (OSError, sqlite3.Error, ValueError) as exc:
            contents = _salvaged(path)
            report.error = str(exc) or type(exc).__name__
        hook("read")
        if store.durable and store.write_error is not None:
            store = store.to_memory(f"no room for the spill of the last stop ({store.write_error})")
        try:
            report.counts = _merge(store, contents, same_boot=contents.boot == boot_id, hook=hook)
        except StateStoreError as exc:
            if not store.durable:  # memory refused it: nothing more to try
                log.error("a spill could not be adopted", path=str(path), error=str(exc))
                continue
            log.warning("the state disk cannot take the spill; the store goes to memory")
            store = store.to_memory(str(exc))
            try:
                report.counts = _merge(store, contents, same_boot=contents.boot == boot_id)
            except StateStoreError as again:
                log.error("a spill could not be adopted", path=str(path), error=str(again))
                continue
        hook("merged")
        report.boot, report.written = contents.boot, contents.written
        if report.error is not None:
            report.aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            try:
                path.rename(report.aside)
            except OSError as exc:
                log.error("an unreadable spill could not be moved aside", error=str(exc))
            log.error(
                "a spill could not be read; moved aside",
                path=str(path),
                aside=str(report.aside),
                error=report.error,
                **report.counts,
            )
        else:
            # Into memory, it stays until the store is durable or a newer spill holds it: a
            # kill -9 meanwhile would lose it, and the kernel log, read again from the disk's
            # older cursor, would deliver its findings again under a changed payload.
            store.held_files.append(path)
            if store.durable:
                store.drop_held_files()
            log.warning(
                "state_spill_adopted: the state the last stop spilled is in the store",
                kind="state_spill_adopted",
                path=str(path),
                same_boot=contents.boot == boot_id,
                durable=store.durable,
                **report.counts,
            )
        reports.append(report)
    return store, reports


def _read(path: Path) -> _Contents:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
    try:
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {check}")
        meta = dict(conn.execute(f"SELECT key, value FROM {META}").fetchall())  # noqa: S608
        if "id" not in meta:
            raise ValueError("not a spill of gpuwarden (no id)")

        def rows(table: str) -> list[tuple[Any, ...]]:
            sql = f"SELECT {COLUMNS[table]} FROM {table} ORDER BY rowid"  # noqa: S608
            return [tuple(row) for row in conn.execute(sql)]

        return _Contents(
            spill_id=str(meta["id"]),
            boot=str(meta.get("boot_id", "")),
            written=float(meta.get("written", 0.0)),
            outbox=rows("outbox"),
            events=rows("events"),
            kv=rows("kv"),
            gone=[(int(s), str(k)) for s, k in conn.execute(f"SELECT seq, key FROM {GONE}")],  # noqa: S608
            deleted=[
                (str(n), str(k))
                for n, k in conn.execute(f"SELECT namespace, key FROM {DELETED}")  # noqa: S608
            ],
        )
    finally:
        conn.close()


def _salvaged(path: Path) -> _Contents:
    """What salvage still reads of an unreadable spill: its events only (a counter or a
    cursor read from a damaged file could be wrong; an event is checked against its id)."""
    rows = salvage(path).rows
    return _Contents("", "", 0.0, rows.get("outbox", []), rows.get("events", []), [], [], [])


def _merge(
    store: StateStore, spill: _Contents, *, same_boot: bool, hook: Hook = _nothing
) -> dict[str, int]:
    """One transaction: the spill's outbox events the store does not hold, its history
    events, its values, its removals, its marker."""
    counts = {"outbox_adopted": 0, "outbox_held": 0, "events_adopted": 0, "values_adopted": 0}
    with store.transaction("cannot adopt the spill") as conn:
        marker = (ADOPTED_NAMESPACE, spill.spill_id)
        if (
            spill.spill_id
            and conn.execute("SELECT 1 FROM kv WHERE namespace=? AND key=?", marker).fetchone()
        ):
            return {"already_adopted": 1}
        held = _held_ids(conn, [str(row[2]) for row in spill.outbox if row[1] == "event"])
        queued: list[tuple[Any, ...]] = []
        for _seq, kind, key, created, payload in spill.outbox:
            if kind != "event":
                continue  # a snapshot (metrics, status): the new life sends its own
            if key in held:
                counts["outbox_held"] += 1
                continue
            held.add(key)
            queued.append((kind, key, created, payload))
        conn.executemany("INSERT INTO outbox(kind, key, created, payload) VALUES (?,?,?,?)", queued)
        counts["outbox_adopted"] = len(queued)
        events = _new_events(conn, spill.events)
        conn.executemany(
            "INSERT INTO events(id, time, severity, source, kind, subject, body) "
            "VALUES (?,?,?,?,?,?,?)",
            events,
        )
        counts["events_adopted"] = len(events)
        for seq, key in spill.gone:
            conn.execute("DELETE FROM outbox WHERE seq=? AND key=?", (seq, key))
        values = [row for row in spill.kv if row[0] != ADOPTED_NAMESPACE]
        upsert = (
            "ON CONFLICT(namespace, key) DO UPDATE SET value=excluded.value, "
            "updated=excluded.updated"
            if same_boot
            else "ON CONFLICT(namespace, key) DO NOTHING"
        )
        before = conn.total_changes
        conn.executemany(
            f"INSERT INTO kv(namespace, key, value, updated) VALUES (?,?,?,?) {upsert}",  # noqa: S608
            values,
        )
        counts["values_adopted"] = conn.total_changes - before
        if same_boot:
            conn.executemany("DELETE FROM kv WHERE namespace=? AND key=?", spill.deleted)
        if spill.spill_id:
            conn.execute(
                "INSERT INTO kv(namespace, key, value, updated) VALUES (?,?,?,?)",
                (*marker, json.dumps(time.time()), time.time()),
            )
        hook("in_transaction")
    return counts


def _held_ids(conn: sqlite3.Connection, ids: Sequence[str]) -> set[str]:
    """Of `ids`, the events the store holds already: in its history or queued."""
    held: set[str] = set()
    for start in range(0, len(ids), 400):
        chunk = ids[start : start + 400]
        marks = ",".join("?" * len(chunk))
        held.update(
            str(i)
            for (i,) in conn.execute(f"SELECT id FROM events WHERE id IN ({marks})", chunk)  # noqa: S608
        )
        held.update(
            str(k)
            for (k,) in conn.execute(
                f"SELECT key FROM outbox WHERE kind='event' AND key IN ({marks})",  # noqa: S608
                chunk,
            )
        )
    return held
