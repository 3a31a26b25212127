"""statvfs of network and FUSE mounts in child processes the agent can abandon.

A statvfs on a dead NFS server or a FUSE daemon that never answers waits in the kernel, and
once the process is being killed the wait is uninterruptible: a thread of the agent stuck
there keeps the whole agent from exiting (SIGTERM, and even SIGKILL, leave a process that
cannot be reaped until the mount answers), so `systemctl restart` and upgrades block. Here the
statvfs runs in a small helper process (statvfs_child.py) and the agent's thread only waits on
a pipe, which any signal ends.

Helpers are kept idle for reuse (at most `max_idle`). A call takes an idle helper or starts
one, so a helper stuck on one mount is that mount's alone: the calls for the other mounts get
other helpers, and one dead server blocks nothing else. The caller's timeout and hung-key
bookkeeping (`ctx.call`) stay as they are: a hung mount keeps one waiting thread and one
helper, never more. A helper that answers late goes back to the pool; `close()` kills them
all without waiting (a killed helper stuck in the kernel ends when its mount answers; the
agent does not wait for it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

CHILD_PROGRAM = Path(__file__).with_name("statvfs_child.py")
COMMAND: tuple[str, ...] = (sys.executable, "-I", "-S", str(CHILD_PROGRAM))
"""How a helper is started: isolated mode and no site, so it starts in milliseconds."""
MAX_IDLE = 4
"""Idle helpers kept (the disk collector asks at most 4 mounts at a time)."""

# Network, cluster and FUSE file systems: a server, a peer or a daemon in user space answers
# statvfs, and may never do so. Local block file systems stay in threads.
DEFAULT_ISOLATED_TYPES = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "ncpfs",
    "afs",
    "ceph",
    "glusterfs",
    "lustre",
    "gpfs",
    "beegfs",
    "orangefs",
    "pvfs2",
    "9p",
    "virtiofs",
    "ocfs2",
    "gfs2",
    "davfs",
    "fuse",
    "fuse.*",
    "fuseblk",
)


class HelperLost(OSError):
    """The helper ended or spoke nonsense (not the mount's error)."""


class _Helper:
    def __init__(self, command: Sequence[str]) -> None:
        self.process = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            text=True,
        )

    def ask(self, path: str) -> os.statvfs_result:
        stdin, stdout = self._pipes()
        try:
            stdin.write(json.dumps(path) + "\n")
            stdin.flush()
            line = stdout.readline()  # the wait a dead server makes: on a pipe, not in statvfs
        except (OSError, ValueError) as exc:  # a closed pipe: the helper is gone
            raise HelperLost(errno.EIO, f"statvfs helper lost: {exc}") from None
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise HelperLost(errno.EIO, f"statvfs helper ended or answered {line[:80]!r}")
        values = reply.get("v")
        if isinstance(values, list) and len(values) == 10:
            return os.statvfs_result(tuple(int(v) for v in values))
        raise OSError(int(reply.get("errno") or errno.EIO), str(reply.get("error")), path)

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        stdin, stdout = self.process.stdin, self.process.stdout
        if stdin is None or stdout is None:
            raise HelperLost(errno.EIO, "statvfs helper has no pipes")
        return stdin, stdout

    def kill(self) -> None:
        """Kill and reap without waiting here: a helper stuck in the kernel dies only when
        its mount answers, and a daemon thread waits for that (none is left at exit)."""
        if self.process.poll() is not None:
            return
        self.process.kill()
        threading.Thread(target=self._reap, name="statvfs-helper-reaper", daemon=True).start()

    def _reap(self) -> None:
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a broken pipe to a dead helper
                    pipe.close()


class StatvfsHelpers:
    """`statvfs(path)` in a helper process; thread-safe (called from the collector's pool)."""

    def __init__(self, command: Sequence[str] = COMMAND, max_idle: int = MAX_IDLE) -> None:
        self._command = tuple(command)
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[_Helper] = []
        self._busy: set[_Helper] = set()
        self._closed = False

    @property
    def started(self) -> int:
        """Helpers alive now, idle or busy (a stuck one among them)."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def pids(self) -> list[int]:
        with self._lock:
            return [h.process.pid for h in (*self._idle, *self._busy)]

    def statvfs(self, path: str) -> os.statvfs_result:
        try:
            return self._ask(path)
        except HelperLost:
            return self._ask(path)  # once more with a fresh helper: one may die (OOM killer)

    def _ask(self, path: str) -> os.statvfs_result:
        helper = self._take()
        try:
            result = helper.ask(path)
        except HelperLost:
            self._drop(helper)
            raise
        except OSError:  # the mount's own error: the helper is fine
            self._give_back(helper)
            raise
        except BaseException:  # interrupted mid-exchange: what it says next is not ours
            self._drop(helper)
            raise
        self._give_back(helper)
        return result

    def _take(self) -> _Helper:
        with self._lock:
            if self._closed:
                raise HelperLost(errno.ESHUTDOWN, "the disk collector is closed")
            helper = self._idle.pop() if self._idle else None
        if helper is None:
            helper = _Helper(self._command)
        with self._lock:
            self._busy.add(helper)
        return helper

    def _give_back(self, helper: _Helper) -> None:
        with self._lock:
            self._busy.discard(helper)
            keep = not self._closed and len(self._idle) < self._max_idle
            if keep:
                self._idle.append(helper)
        if not keep:
            helper.kill()

    def _drop(self, helper: _Helper) -> None:
        with self._lock:
            self._busy.discard(helper)
        helper.kill()

    def close(self) -> None:
        """Kill every helper, idle or stuck, without waiting for any."""
        with self._lock:
            self._closed = True
            helpers = [*self._idle, *self._busy]
            self._idle, self._busy = [], set()
        for helper in helpers:
            helper.kill()
