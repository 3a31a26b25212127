"""The write probe killed (SIGKILL) at each point of its run: nothing of it stays behind.

The probe writes 64 MiB into a directory the jobs use, in the agent's process (a pool
thread) or in `gpuwarden check --io-test`. A kill -9 (the OOM killer, systemd's watchdog,
a health check's timeout) runs no `finally`: a probe file that has a name by then stays,
and every kill leaves another one of up to size_mib MiB in the jobs' directory. What must
hold: after the kill at any point, the directory holds no probe file and the file system
has every byte back. The disk is a real tmpfs; the kill is a real one from outside, at a
point the child says it has reached.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors.io_probe import MIB, PROBE_PREFIX
from tests.support.agent_proc import REPO, pythonpath
from tests.support.disk import SmallDisk

SIZE_MIB = 8

CHILD = """
import errno, os, sys
from collectors import io_probe

directory, point, kind, size_mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

if kind == "named":  # a file system without O_TMPFILE (NFS, FUSE): open(2) says EOPNOTSUPP
    real_open = os.open
    def refusing_open(path, flags, *args):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP), path)
        return real_open(path, flags, *args)
    os.open = refusing_open

def reached(name):
    if name == point:
        print(name, flush=True)
        sys.stdin.readline()  # killed here

calls = 0
def clock():
    global calls
    calls += 1
    reached(("created", "sync-tested", "burst-started", "synced")[calls - 1])
    return float(calls)

written = 0
real_write = os.write
def write(fd, data):
    global written
    done = real_write(fd, data)
    written += done
    if written >= size_mib * io_probe.MIB // 2:
        reached("mid-burst")
    return done

os.write = write
io_probe.run_write_probe(directory, size_mib, free_margin_bytes=0, clock=clock)
print("finished", flush=True)
"""

POINTS = ["created", "sync-tested", "burst-started", "mid-burst", "synced"]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with SmallDisk(tmp_path / "jobs", size=4 * SIZE_MIB * MIB) as small:
        yield small


def probe_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(PROBE_PREFIX))


@pytest.mark.parametrize("kind", ["unnamed", "named"])
@pytest.mark.parametrize("point", POINTS)
def test_a_probe_killed_leaves_no_file_and_no_used_space(
    disk: SmallDisk, point: str, kind: str
) -> None:
    """`kind`: the file system takes O_TMPFILE (tmpfs, ext4, XFS, btrfs) or refuses it."""
    before = disk.available()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(disk.path), point, kind, str(SIZE_MIB)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath()},
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
    assert child.returncode == -signal.SIGKILL, "the kill did not land in the probe"
    assert probe_files(disk.path) == [], f"killed at {point}: the probe file stayed"
    assert disk.available() == before, f"killed at {point}: the probe's bytes stayed in use"
