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

from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors.io_probe import MIB, PROBE_PREFIX
from tests.support.disk import SmallDisk
from tests.support.kill_points import kill_at

SIZE_MIB = 8

CHILD = """
import os, sys
from collectors import io_probe

directory, kind, size_mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "named":
    refuse_unnamed_files()

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
    kill_at(CHILD, [str(disk.path), kind, str(SIZE_MIB)], point)
    assert probe_files(disk.path) == [], f"killed at {point}: the probe file stayed"
    assert disk.available() == before, f"killed at {point}: the probe's bytes stayed in use"
