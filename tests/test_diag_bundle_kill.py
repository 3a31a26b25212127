"""`gpuwarden diag -o` killed (SIGKILL) while it writes the bundle: no temp file stays.

A kill -9 (a health check's timeout, the OOM killer, an operator's Ctrl-\\ on a stuck
`diag`) runs no `finally`. A temp file that has a name by then stays beside the bundle, as
large as the bundle had grown, after every kill. What must hold at every point: the bundle
already there is whole, the directory holds nothing else of the killed write, and the file
system has its bytes back; where the file system refuses unnamed files (NFS, FUSE), the next
bundle written there sweeps up the killed one's temp file. The disk is a real tmpfs; the kill
is a real one from outside, at a point the child says it has reached.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from agent.program.diagnose.bundle import write_atomically
from tests.support.disk import SmallDisk
from tests.support.kill_points import kill_at

MIB = 1 << 20
OLD = b"the previous bundle, whole"

CHILD = """
import os, sys
from pathlib import Path
from agent.program.diagnose import bundle

final, kind = Path(sys.argv[1]), sys.argv[2]
if kind == "named":
    refuse_unnamed_files()

real_fsync = os.fsync
def fsync(fd):
    real_fsync(fd)
    reached("synced")
    os.fsync = real_fsync  # the directory's fsync after the rename is not a point
os.fsync = fsync

def write(handle):
    handle.write(os.urandom(1 << 20))
    handle.flush()
    reached("mid-write")
    handle.write(os.urandom(1 << 20))

bundle.write_atomically(final, write)
print("finished", flush=True)
"""

POINTS = ["mid-write", "synced"]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with SmallDisk(tmp_path / "out", size=16 * MIB) as small:
        yield small


def writing(data: bytes) -> Callable[[IO[bytes]], None]:
    def write(handle: IO[bytes]) -> None:
        handle.write(data)

    return write


def others(directory: Path, final: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != final.name)


@pytest.mark.parametrize("old", [True, False], ids=["over-a-bundle", "new-file"])
@pytest.mark.parametrize("point", POINTS)
def test_a_write_killed_leaves_no_temp_file_and_no_used_space(
    disk: SmallDisk, point: str, old: bool
) -> None:
    final = disk.path / "bundle.tar.gz"
    if old:
        final.write_bytes(OLD)
    before = disk.available()
    kill_at(CHILD, [str(final), "unnamed"], point)
    assert others(disk.path, final) == [], f"killed at {point}: the temp file stayed"
    assert disk.available() == before, f"killed at {point}: the write's bytes stayed in use"
    if old:
        assert final.read_bytes() == OLD
    else:
        assert not final.exists()


@pytest.mark.parametrize("point", POINTS)
def test_without_unnamed_files_the_next_bundle_sweeps_the_killed_ones_temp(
    disk: SmallDisk, point: str
) -> None:
    final = disk.path / "bundle.tar.gz"
    final.write_bytes(OLD)
    before = disk.available()
    kill_at(CHILD, [str(final), "named"], point)
    assert final.read_bytes() == OLD
    write_atomically(final, writing(b"the next bundle"))
    assert final.read_bytes() == b"the next bundle"
    assert others(disk.path, final) == [], f"killed at {point}: the temp file stayed"
    assert disk.available() == before


def test_a_live_writers_temp_is_not_swept(disk: SmallDisk) -> None:
    """Two `diag -o` into one directory at once: the second must not take the first's file."""
    final = disk.path / "bundle.tar.gz"
    theirs = disk.path / f".{final.name}.{os.getppid()}.x1y2z3.partial"
    theirs.write_bytes(b"another diag's bundle, being written")
    write_atomically(final, writing(b"ours"))
    assert theirs.read_bytes() == b"another diag's bundle, being written"
    assert final.read_bytes() == b"ours"
