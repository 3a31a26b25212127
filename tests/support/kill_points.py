"""A child process killed with SIGKILL at a point it says it has reached.

A kill -9 runs no `finally`: what a write leaves behind then is what the kernel leaves. The
child runs `script` after `PRELUDE`, which gives it `reached(name)` (at the point the test
names, say so and wait to be killed) and `refuse_unnamed_files()` (open(2) with O_TMPFILE
says EOPNOTSUPP, as on NFS and most FUSE file systems).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support.agent_proc import REPO, pythonpath

POINT_ENV = "GPUWARDEN_TEST_KILL_POINT"

PRELUDE = f"""
import errno as _errno, os as _os, sys as _sys

def reached(name):
    if name == _os.environ["{POINT_ENV}"]:
        print(name, flush=True)
        _sys.stdin.readline()  # killed here

def refuse_unnamed_files():
    real_open = _os.open
    def refusing_open(path, flags, *args):
        if flags & _os.O_TMPFILE == _os.O_TMPFILE:
            raise OSError(_errno.EOPNOTSUPP, _os.strerror(_errno.EOPNOTSUPP), path)
        return real_open(path, flags, *args)
    _os.open = refusing_open
"""


def kill_at(script: str, args: list[str], point: str) -> None:
    """Run `script` with `args` (its sys.argv[1:]) and SIGKILL it once it reaches `point`."""
    child = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + script, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath(), POINT_ENV: point},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    try:
        said = child.stdout.readline().strip()
        assert said == point, (said, child.stderr.read() if child.stderr else "")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(20)
    assert child.returncode == -signal.SIGKILL, f"the kill did not land at {point}"
