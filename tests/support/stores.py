"""A state store on a full disk, for the tests of every collector that writes state."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from agent.contracts.collector import JSONValue, MemoryKeyValueStore
from agent.contracts.errors import StateStoreError

FULL_DISK = "state store write failed: database or disk is full"
"""What agent.state raises when SQLite reports SQLITE_FULL."""
MIB = 1 << 20


class FullDiskStore(MemoryKeyValueStore):
    """Writes raise StateStoreError while `full` is set, and for the next `fail` writes.

    Reads answer from what is stored; `seed` stores without the refusal (what an earlier run
    saved before the disk filled up).
    """

    def __init__(self, *, full: bool = True) -> None:
        super().__init__()
        self.full = full
        self.fail = 0

    def _refuse(self) -> None:
        if self.fail > 0:
            self.fail -= 1
            raise StateStoreError(FULL_DISK)
        if self.full:
            raise StateStoreError(FULL_DISK)

    def seed(self, namespace: str, key: str, value: JSONValue) -> None:
        super().put(namespace, key, value)

    def put(self, namespace: str, key: str, value: JSONValue) -> None:
        self._refuse()
        super().put(namespace, key, value)

    def delete(self, namespace: str, key: str) -> None:
        self._refuse()
        super().delete(namespace, key)


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

    def fill(self) -> None:
        """Write until the file system refuses (ENOSPC), down to the last byte."""
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
