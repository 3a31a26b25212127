"""A state store on a real full disk, for the tests of everything that writes state."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from agent.contracts.collector import JSONValue
from agent.runtime.state import StateStore
from agent.runtime.store_guard import CollectorState, StoreGuard

MIB = 1 << 20


class SmallDisk:
    """A real, small file system (tmpfs, mounted here: the tests run as root) that a test
    can fill up and free again: the state store on it gets SQLite's own SQLITE_FULL.

    Used as a context manager; `fill()` takes every free byte with a filler file, `free()`
    removes it.
    """

    def __init__(self, path: Path, size: int = 4 * MIB) -> None:
        self.path = path
        self.size = size
        self._filler = path / ".filler"

    def __enter__(self) -> SmallDisk:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        return self

    def __exit__(self, *_exc: object) -> None:
        # Lazy: a store a failing test left open must not turn the failure into EBUSY.
        subprocess.run(["umount", "-l", str(self.path)], check=False)

    def available(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def fill(self, store: StateStore | None = None) -> None:
        """Write until the file system refuses (ENOSPC), down to the last byte. With `store`,
        its WAL is checkpointed and emptied first: SQLite would otherwise go on writing into
        the space its WAL file already holds, and the disk would not look full to it yet."""
        if store is not None:
            with store._lock:
                store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        chunk = 1 << 16
        with self._filler.open("ab", buffering=0) as filler:
            while chunk:
                try:
                    filler.write(b"\0" * chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    chunk //= 2
        assert self.available() == 0

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)

    def file_size(self, name: str) -> int:
        part = self.path / name
        return part.stat().st_size if part.exists() else 0


class StateOnDisk:
    """What the runtime hands a collector as `deps.state` (a CollectorState over the runtime's
    StoreGuard), over a real StateStore on a SmallDisk that a test fills and frees."""

    def __init__(self, disk: SmallDisk) -> None:
        self.disk = disk
        self.store = StateStore.open(disk.path / "state")
        assert self.store.durable
        self.guard = StoreGuard(self.store, disk.path)
        self.state = CollectorState(self.guard)

    def seed(self, namespace: str, key: str, value: JSONValue) -> None:
        """Stored before the disk filled up (what an earlier run saved)."""
        self.store.put(namespace, key, value)

    def fill(self) -> None:
        self.disk.fill(self.store)

    def end_round(self) -> bool:
        """What the runtime does after a round: the round's values to the guard, then a
        write of what waits. True when it was all written."""
        self.state.release()
        return self.guard.flush(outbox=False)
