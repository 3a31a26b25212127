"""Reading the kernel log: /dev/kmsg live, or a file of saved lines, from where we left off.

/dev/kmsg semantics (Documentation/ABI/testing/dev-kmsg, and measured on the H200, see
docs/MEASUREMENTS.md): each read() returns exactly one record and needs a buffer large enough for it
(8 KiB is the kernel's limit for one record; a short buffer fails with EINVAL); EAGAIN on a
non-blocking descriptor means no more records; EPIPE means records were overwritten in the ring
buffer before we read them (the next read continues with the oldest one left). A fresh
descriptor starts at the oldest record still in the buffer, so a restart would replay old Xids:
the reader keeps a cursor (boot id + last sequence number processed) in the state store and
skips what it already handled on this boot. All methods here block: call them via ctx.call.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

import structlog

from agent.contracts.collector import KeyValueStore
from agent.contracts.errors import GpuwardenError
from collectors.kernel_log import lines, stamps
from collectors.kernel_log.parse import (
    UNKNOWN_RECORD,
    LogRecord,
    MalformedLine,
    ParseStats,
    last_record_lines,
    parse_kmsg_record,
    parse_lines,
)
from collectors.kernel_log.wake import FileWatch

log = structlog.get_logger(component="kernel_log")

READ_SIZE: Final = 8192
"""The kernel's largest record (CONSOLE_EXT_LOG_MAX); a smaller buffer can fail with EINVAL."""
STATE_NAMESPACE: Final = "kernel_log"
KMSG_CURSOR_KEY: Final = "kmsg_cursor"
FILE_CURSOR_KEY: Final = "file_cursor"
MAX_RECORDS_PER_READ: Final = 50_000
"""Bounds one round's work; the ring buffer rarely holds more (a few MiB of short records)."""
FILE_READ_BYTES: Final = 4 * 1024 * 1024
"""Bounds one round's read of a saved-lines file (its memory and its time, so a round ends
well inside the call timeout): a 300 MiB backlog is read over many rounds, never whole."""


class KernelLogError(GpuwardenError):
    """The kernel log cannot be read as configured; the message says why, `action` what to do."""

    def __init__(self, message: str, action: str = "") -> None:
        super().__init__(message)
        self.action = action


class KmsgIO(Protocol):
    """The three system calls the reader makes: real ones, or a test double with the same
    semantics (one record per read, EINVAL on a short buffer, EAGAIN at the end, EPIPE)."""

    def open(self, path: str) -> int: ...

    def read(self, fd: int, size: int) -> bytes: ...

    def close(self, fd: int) -> None: ...


class OsKmsgIO:
    def open(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)

    def read(self, fd: int, size: int) -> bytes:
        return os.read(fd, size)

    def close(self, fd: int) -> None:
        os.close(fd)


@dataclass
class ReadBatch:
    """What one read round produced. `predates_agent`: the records were already in the log
    when this agent process started reading it (the first batch)."""

    records: list[LogRecord] = field(default_factory=list)
    predates_agent: bool = False
    malformed: int = 0
    lost: int = 0
    """Records overwritten before they were read (sequence gaps after EPIPE or a restart)."""
    overruns: int = 0
    """EPIPE answers: the reader fell behind the ring buffer."""
    skipped: int = 0
    """Records already processed before a restart on this boot, skipped."""
    cursor: dict[str, object] | None = None
    """The cursor to persist once the batch is processed (see `commit`)."""
    more: bool = False
    """The read stopped at its bound, not at the end of what the log holds: read again at once
    (the next round does not wait)."""
    open_record: LogRecord | None = None
    """Saved lines: the record that indented lines at the start of the next read continue."""


@dataclass
class HandedOn:
    """How far this process's readers of /dev/kmsg have handed records on (`commit`): shared
    by the readers one process makes one after the other (a reload makes the collector, and
    its reader, again). A new descriptor starts at the oldest record in the ring, so the next
    reader reads again what an earlier one handed on; those records were counted when they
    were read, and are passed over uncounted: neither skipped (that is a restart's replay)
    nor, for a record that does not parse, malformed a second time."""

    boot_id: str = ""
    seq: int = -1


_KMSG_SEQ = re.compile(rb"\d{1,4},(\d{1,20})[,;]")
"""A record's sequence number, read from a header that does not parse as a whole."""


def _seq_of(data: bytes) -> int | None:
    match = _KMSG_SEQ.match(data)
    return int(match[1]) if match is not None else None


def read_boot_id(path: Path) -> str:
    try:
        boot_id = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise KernelLogError(
            f"cannot read the boot id from {path}: {exc}; without it a restart cannot tell "
            "old kernel-log records from new ones (set boot_id_path)"
        ) from exc
    if not boot_id:
        raise KernelLogError(f"{path} is empty; expected the kernel's boot id")
    return boot_id


class KmsgReader:
    """/dev/kmsg (or any character device with its semantics), read without replay."""

    def __init__(
        self,
        path: Path,
        boot_id_path: Path,
        state: KeyValueStore,
        *,
        io: KmsgIO | None = None,
        read_size: int = READ_SIZE,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        backlog: bool = True,
        handed_on: HandedOn | None = None,
    ) -> None:
        """`backlog`: the first records read predate the agent (False for a reader made
        again by a configuration reload in the same process). `handed_on`: the process's
        (`HandedOn`); None, this reader's own."""
        self.path = path
        self.handed_on = HandedOn() if handed_on is None else handed_on
        self.boot_id_path = boot_id_path
        self.state = state
        self.io = io or OsKmsgIO()
        self.read_size = read_size
        self._clock, self._monotonic = clock, monotonic
        self._fd: int | None = None
        self._boot_id = ""
        self._last_seq = -1
        self._committed: dict[str, object] | None = None
        self._first_batch = backlog

    def _open(self) -> int:
        self._boot_id = read_boot_id(self.boot_id_path)
        saved = self.state.get(STATE_NAMESPACE, KMSG_CURSOR_KEY)
        if isinstance(saved, dict) and saved.get("boot_id") == self._boot_id:
            self._last_seq = int(saved.get("seq", -1))
        else:
            self._last_seq = -1  # a new boot: everything in the buffer is new to us
        self._committed = {"boot_id": self._boot_id, "seq": self._last_seq}
        try:
            return self.io.open(str(self.path))
        except OSError as exc:
            raise KernelLogError(
                f"cannot open {self.path}: {exc.strerror or exc}",
                "run the agent as root or with CAP_SYSLOG (the packaged gpuwarden.service "
                "does; ProtectKernelLogs= must stay off); the other collectors run meanwhile",
            ) from exc

    def _read_one(self, fd: int) -> bytes | None:
        """One record's bytes; None at the end (EAGAIN); b"" after an overrun (EPIPE)."""
        while True:
            try:
                return self.io.read(fd, self.read_size)
            except InterruptedError:
                continue
            except BlockingIOError:
                return None
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    return b""
                if exc.errno == errno.EINVAL:
                    raise KernelLogError(
                        f"{self.path}: a record did not fit a {self.read_size}-byte read "
                        "(EINVAL); /dev/kmsg needs one read of up to 8 KiB per record"
                    ) from exc
                raise KernelLogError(f"reading {self.path}: {exc.strerror or exc}") from exc

    def _descriptor(self) -> int:
        """The descriptor to read on. A batch read and never committed (its round failed, or
        its call timed out and the answer was dropped) is read again: a descriptor reads on
        where it stopped, so that one is given up and a new one reads the ring again from
        the cursor (what this reader handed on passes uncounted, `HandedOn`)."""
        committed = self._committed
        if self._fd is not None and committed is not None and committed["seq"] != self._last_seq:
            self.close()
        if self._fd is None:
            self._fd = self._open()
        return self._fd

    def read(self) -> ReadBatch:
        """Every record written since the last batch committed (or since the cursor, at
        start)."""
        fd = self._descriptor()  # close() may run meanwhile (a stop); this read keeps its fd
        batch = ReadBatch(predates_agent=self._first_batch)
        expected = self._last_seq + 1 if self._last_seq >= 0 else None
        mine = self.handed_on
        handed = mine.seq if mine.boot_id == self._boot_id else -1
        while len(batch.records) < MAX_RECORDS_PER_READ:
            data = self._read_one(fd)
            if data is None:
                # The backlog ends at the first EAGAIN (which may be several rounds in when
                # the ring held more than one round's worth), once that batch is committed.
                break
            if not data:
                batch.overruns += 1
                continue
            try:
                record: LogRecord | None = parse_kmsg_record(data)
            except MalformedLine:
                record = None
            # A record that does not parse still has its number, as a rule: it is in its
            # place in the sequence (no gap: none lost), and the cursor moves past it.
            known = _seq_of(data) if record is None else record.seq
            seq = known if known is not None else -1
            if known is not None and seq <= handed:
                continue  # this process read and counted it already (before a reload)
            if known is not None and seq <= self._last_seq:
                batch.skipped += 1
                continue
            if known is not None:
                if expected is not None and seq > expected:
                    batch.lost += seq - expected
                expected = seq + 1
                self._last_seq = seq
            if record is None:
                batch.malformed += 1
                continue
            batch.records.append(record)
        else:
            batch.more = True  # stopped at the bound, not at the end of the ring
        batch.cursor = {"boot_id": self._boot_id, "seq": self._last_seq}
        return batch

    def origin(self, record: LogRecord) -> tuple[str, str]:
        """Where the record is, stable across restarts: this boot and its sequence number."""
        return (f"kmsg:{self._boot_id}", str(record.seq if record.seq is not None else -1))

    def wake_fd(self) -> int | None:
        """The descriptor to poll for new records: /dev/kmsg polls readable when one arrives
        (devkmsg_poll). None for a test double's pretend descriptor, or before the open."""
        return self._fd if isinstance(self.io, OsKmsgIO) else None

    def woken(self) -> None:
        return None

    def record_time(self, record: LogRecord) -> float:
        """Wall-clock time of a record: boot time plus the kernel's stamp (seconds since boot)."""
        now = self._clock()
        if record.monotonic_usec is None:
            return now
        boot = now - self._monotonic()
        return min(now, boot + record.monotonic_usec / 1e6)

    def commit(self, batch: ReadBatch) -> None:
        """Persist the cursor once the batch's findings are handed on (events, correlator).

        Compared with the last cursor saved, not with "the batch has records": after a failed
        commit (a full disk) the next one saves the cursor even if no record came since."""
        if not batch.more:
            self._first_batch = False  # a batch read again is read as it was the first time
        if batch.cursor is not None:
            seq = batch.cursor.get("seq")
            if isinstance(seq, int):
                self.handed_on.boot_id, self.handed_on.seq = self._boot_id, seq
        if batch.cursor is not None and batch.cursor != self._committed:
            self.state.put(STATE_NAMESPACE, KMSG_CURSOR_KEY, batch.cursor)
            self._committed = batch.cursor

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self.io.close(fd)


_FILE_CURSOR_FIELDS: Final = ("inode", "offset", "line", "skipping")


def _hold_back_last_record(
    data: bytes, lines: list[str | None], consumed: int
) -> tuple[list[str | None], int]:
    """A read that stopped at its bound ends before its last record, whose indented lines
    (raw ` KEY=value` fields, a message's further lines, which carry its facility) may be in
    the next read: that read starts at the record's first line."""
    held = last_record_lines(lines)
    if held == 0 or held == len(lines):
        return lines, consumed
    end = consumed - 1  # the "\n" ending the last line kept so far
    for _ in range(held):
        end = data.rindex(b"\n", 0, end)
    return lines[:-held], end + 1


def _file_cursor(cursor: dict[str, object]) -> dict[str, int]:
    out = {}
    for key in _FILE_CURSOR_FIELDS:
        value = cursor[key]
        if not isinstance(value, int):
            raise TypeError(f"file cursor {key}={value!r}: expected an integer")
        out[key] = value
    return out


class FileLogReader:
    """A file of saved lines, read like `tail -f`: new complete lines since the last offset.

    The cursor (inode, offset, line number, and whether the offset is inside a line too long
    to keep) persists, so a restart does not replay the file; a file replaced (new inode) or
    truncated is read again from its start. Each read takes at most FILE_READ_BYTES and
    MAX_RECORDS_PER_READ lines, so memory stays flat and a round stays short on a log of any
    size. The reader moves on only at `commit`: a batch read but never handed on (the call
    timed out and its result was dropped, the round failed) is read again, not lost.
    """

    def __init__(
        self,
        path: Path,
        state: KeyValueStore,
        clock: Callable[[], float] = time.time,
        backlog: bool = True,
    ) -> None:
        self.path = path
        self.state = state
        self._clock = clock
        self._cursor: dict[str, int] | None = None
        self._committed: dict[str, object] | None = None
        self._backlog = backlog
        self._open_record: LogRecord | None = None
        self._read_inode = -1
        """The inode of the file the last read came from (origin() names records by it)."""
        self._watch: FileWatch | None = None
        self._watch_tried = False
        self.skewed_stamps = 0
        """Lines read live whose stamp lay more than stamps.LIVE_SKEW before the read."""

    def _load(self) -> dict[str, int]:
        saved = self.state.get(STATE_NAMESPACE, FILE_CURSOR_KEY)
        if isinstance(saved, dict) and saved.get("path") == str(self.path):
            cursor = {k: int(saved[k]) for k in ("inode", "offset", "line")}
            # Cursors saved before long lines were skipped have no "skipping".
            return {**cursor, "skipping": int(saved.get("skipping", 0))}
        return {"inode": -1, "offset": 0, "line": 0, "skipping": 0}

    def read(self) -> ReadBatch:
        # Watched before the read: a line appended between the read and the next wait wakes
        # that wait at once instead of waiting out the interval.
        self._renew_watch()
        if self._cursor is None:
            self._cursor = self._load()
            # Restarted inside the file: what the first lines continue is not known.
            self._open_record = UNKNOWN_RECORD if self._cursor["offset"] else None
        cursor, previous = self._cursor, self._open_record
        try:
            with self.path.open("rb") as handle:
                info = os.fstat(handle.fileno())
                if info.st_ino != cursor["inode"] or info.st_size < cursor["offset"]:
                    cursor = {"inode": info.st_ino, "offset": 0, "line": 0, "skipping": 0}
                    previous = None
                handle.seek(cursor["offset"])
                data = handle.read(FILE_READ_BYTES)
                self._read_inode = info.st_ino
        except OSError as exc:
            raise KernelLogError(
                f"cannot read the kernel log file {self.path}: {exc.strerror or exc}"
            ) from exc
        split = lines.split_lines(
            data,
            skipping=bool(cursor["skipping"]),
            max_lines=MAX_RECORDS_PER_READ,
            # A line that cannot fit one read would be read again forever: it is too long.
            max_line=min(lines.MAX_LINE_BYTES, FILE_READ_BYTES - 1),
        )
        more = split.cut or len(data) == FILE_READ_BYTES
        kept, consumed = split.lines, split.consumed
        if more and not split.skipping:
            kept, consumed = _hold_back_last_record(data, kept, consumed)
        stats = ParseStats()
        records = list(parse_lines(kept, stats, cursor["line"] + 1, previous))
        after = {
            "inode": cursor["inode"],
            "offset": cursor["offset"] + consumed,
            "line": cursor["line"] + len(kept),
            "skipping": int(split.skipping),
        }
        return ReadBatch(
            records=records,
            predates_agent=self._backlog,
            malformed=stats.malformed,
            cursor={"path": str(self.path), **after},
            more=more,
            open_record=stats.open_record,
        )

    def _renew_watch(self) -> None:
        if self._watch is None and not self._watch_tried:
            self._watch_tried = True
            self._watch = FileWatch.open(self.path)
        if self._watch is not None:
            self._watch.renew()

    def origin(self, record: LogRecord) -> tuple[str, str]:
        """Where the line is, stable across restarts: the file (path and inode) and its line."""
        return (f"file:{self.path}:{self._read_inode}", str(record.line))

    def wake_fd(self) -> int | None:
        return self._watch.fd if self._watch is not None else None

    def woken(self) -> None:
        if self._watch is not None:
            self._watch.drain()

    def record_time(self, record: LogRecord) -> float:
        """The time the line's stamp says (collectors/kernel_log/stamps.py), never after the
        reader's clock; the read's time for a line whose stamp says no wall time, and for a
        line read live (past the backlog) stamped far before the read: its writer's zone or
        clock is not the agent's (said once in the log, and counted: `skewed_stamps`)."""
        now = self._clock()
        live = not self._backlog
        when = stamps.line_time(record, now, live=live)
        if live and when == now:
            skew = stamps.stamp_skew(record, now)
            if skew is not None and skew > stamps.LIVE_SKEW:
                self.skewed_stamps += 1
                if self.skewed_stamps == 1:
                    log.warning(
                        "the followed kernel-log file's stamps are far behind the agent's "
                        "clock for lines written just now: its writer runs in another time "
                        "zone (or on another clock); those findings get the time of the read",
                        path=str(self.path),
                        behind_s=round(skew),
                    )
        return when

    def commit(self, batch: ReadBatch) -> None:
        """Move past `batch` (it was handed on), then persist the cursor. In memory first: a
        failed write must not make the next round read the batch again (its findings would
        be raised twice); the next commit saves the newer cursor."""
        if batch.cursor is not None:
            self._cursor = _file_cursor(batch.cursor)
            self._open_record = batch.open_record
            if not batch.more:
                self._backlog = False  # the backlog ends where a read first reached the end
        if batch.cursor is not None and batch.cursor != self._committed:
            self.state.put(STATE_NAMESPACE, FILE_CURSOR_KEY, batch.cursor)
            self._committed = batch.cursor

    def close(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()


class LogReader(Protocol):
    def read(self) -> ReadBatch: ...

    def origin(self, record: LogRecord) -> tuple[str, ...]:
        """Where a record of the last read is, the same when it is read again after a crash:
        the event made from it keeps its id."""
        ...

    def wake_fd(self) -> int | None:
        """A descriptor that polls readable when there is more to read; None: none to wait on."""
        ...

    def woken(self) -> None:
        """The wait on `wake_fd` ended: clear what woke it (non-blocking)."""
        ...

    def record_time(self, record: LogRecord) -> float: ...

    def commit(self, batch: ReadBatch) -> None: ...

    def close(self) -> None: ...


def is_character_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(path.stat().st_mode)
    except OSError:
        return False
