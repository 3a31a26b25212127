"""A real FUSE file system whose statfs never answers (a dead file server), and a launcher that
runs a command beside it in a private mount namespace.

    unshare -m --propagation private python -m tests.support.fuse_hang MOUNTPOINT STATE [--lookups] -- CMD...

The launcher forks the FUSE daemon (fusepy over libfuse2), waits until the mount is there, writes
the daemon's pid to STATE.pid and execs CMD: CMD keeps the launcher's pid and sees the mount,
and no process outside the namespace can trip over it (a `df` elsewhere would hang too). Each
statfs the daemon receives is one line in STATE; none is ever answered, so a process that asked
and is then killed waits in the kernel (D state) until the daemon dies. With `--lookups`, a look-up
of anything in it (a getattr of any path but the root: opening or creating a file there) hangs
too, and is a `getattr <path>` line in STATE.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fuse import FUSE, FuseOSError, Operations

FS_TYPE = "fuse.hang"


class HangingFs(Operations):  # type: ignore[misc]
    def __init__(self, state: Path, lookups: bool = False) -> None:
        self.state = state
        self.lookups = lookups

    def getattr(self, path: str, fh: Any = None) -> dict[str, int]:
        if path != "/" and self.lookups:
            with self.state.open("a") as log:
                log.write(f"getattr {path}\n")
            threading.Event().wait()  # never answers
        if path != "/":
            raise FuseOSError(errno.ENOENT)
        return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", ".."]

    def statfs(self, path: str) -> dict[str, int]:
        with self.state.open("a") as log:
            log.write("statfs\n")
        threading.Event().wait()  # never answers
        return {}


def mounted(mountpoint: Path) -> bool:
    with open("/proc/self/mountinfo") as mountinfo:
        return any(line.split()[4] == str(mountpoint) for line in mountinfo)


def main(argv: list[str]) -> None:
    mountpoint, state = Path(argv[0]).resolve(), Path(argv[1])
    command = argv[argv.index("--") + 1 :]
    lookups = "--lookups" in argv[2 : argv.index("--")]
    state.write_text("")
    daemon = os.fork()
    if daemon == 0:
        FUSE(
            HangingFs(state, lookups),
            str(mountpoint),
            foreground=True,
            fsname="hang-server",
            subtype="hang",
        )
        os._exit(0)
    deadline = time.monotonic() + 10
    while not mounted(mountpoint):
        if time.monotonic() > deadline:
            os.kill(daemon, 9)
            sys.exit(f"fuse_hang: {mountpoint} was not mounted within 10 s")
        time.sleep(0.02)
    Path(f"{state}.pid").write_text(str(daemon))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
