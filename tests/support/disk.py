"""A real file system that fills up: a small tmpfs for a state store on a full disk."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from agent.runtime.state import StateStore

MIB = 1 << 20


class SmallDisk:
    """A real, small file system (tmpfs, mounted here: the tests run as root) that a test
    can fill up and free again: the state store on it gets SQLite's own SQLITE_FULL.

    Used as a context manager; `fill()` takes every free byte with a filler file, `free()`
    removes it.
    """

    def __init__(self, path: Path, size: int = 4 * MIB, inodes: int | None = None) -> None:
        self.path = path
        self.size = size
        self.inodes = inodes
        """nr_inodes: a file system that runs out of inodes before blocks."""
        self._filler = path / ".filler"

    def __enter__(self) -> SmallDisk:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", self._options(), "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        return self

    def _options(self) -> str:
        options = f"size={self.size},mode=0700"
        return options if self.inodes is None else f"{options},nr_inodes={self.inodes}"

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
