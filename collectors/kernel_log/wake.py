"""Waking on a followed file: inotify through libc, so a line appended is read at once.

/dev/kmsg's own descriptor polls readable when a record arrives; a regular file always polls
readable (epoll refuses it), so a followed file is watched with inotify(7) instead. The
standard library has no binding; the three calls go through ctypes. Where inotify is not to
be had (no libc symbol, the per-user instance limit reached), `FileWatch.open` returns None
and the collector reads on its interval, as before: slower, never wrong.

The watch is on the path, renewed on every read (`renew`): a log rotated to a new inode is
watched again by the next round, which reads the new file from its start anyway. The folder
is watched too, for files created or moved into it: between the rename of a rotation and the
creation of the new file there is no file to watch, and its creation must still wake us.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import weakref
from pathlib import Path
from typing import Final

import structlog

log = structlog.get_logger(component="kernel_log")

IN_MODIFY: Final = 0x00000002
IN_ATTRIB: Final = 0x00000004
IN_CLOSE_WRITE: Final = 0x00000008
IN_MOVE_SELF: Final = 0x00000800
IN_DELETE_SELF: Final = 0x00000400
IN_MOVED_TO: Final = 0x00000080
IN_CREATE: Final = 0x00000100
IN_NONBLOCK: Final = os.O_NONBLOCK
IN_CLOEXEC: Final = os.O_CLOEXEC
WATCHED: Final = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVE_SELF | IN_DELETE_SELF
"""Appended, truncated (attrib/modify), replaced or removed: each a reason to read again."""
WATCHED_DIRECTORY: Final = IN_CREATE | IN_MOVED_TO
"""A file created or moved into the log's folder: perhaps the log, anew after a rotation."""


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "inotify_init1") or not hasattr(libc, "inotify_add_watch"):
        return None
    return libc


class FileWatch:
    """An inotify descriptor watching one path. Blocking calls (`renew`, `close`) belong in
    the collector's call pool or its close; `drain` is one non-blocking read."""

    def __init__(self, libc: ctypes.CDLL, fd: int, path: Path) -> None:
        self._libc = libc
        self.fd = fd
        self.path = path
        # A reader dropped without close() (a failed start, a test) must not keep its inotify
        # instance: they are few per user (fs.inotify.max_user_instances, 128 by default), and
        # once they run out every later watch falls back to the interval.
        self._release = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: Path) -> FileWatch | None:
        libc = _libc()
        if libc is None:
            return None
        fd = int(libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        if fd < 0:
            error = ctypes.get_errno()
            log.warning(
                "no inotify for the followed kernel log: it is read on the collector's interval",
                path=str(path),
                error=os.strerror(error),
            )
            return None
        return cls(libc, fd, path)

    def renew(self) -> bool:
        """Watch the path (again): the same inode keeps its watch, a new one gets one. False
        when the path cannot be watched now (missing); the next read tries again."""
        folder = os.fsencode(self.path.parent)
        self._libc.inotify_add_watch(self.fd, folder, WATCHED_DIRECTORY)
        wd = int(self._libc.inotify_add_watch(self.fd, os.fsencode(self.path), WATCHED))
        return wd >= 0

    def drain(self) -> None:
        """Read away the notifications that woke us (what changed is read from the file)."""
        while True:
            try:
                if not os.read(self.fd, 65536):
                    return
            except OSError:  # EAGAIN: all read
                return

    def close(self) -> None:
        self._release()  # closes the descriptor once, however often close() is called
