"""`gpuwarden diag -o` on a real disk that is full or read-only: the bundle already there is
kept whole, and no temp file stays (tests/test_diag.py fakes the error; here the kernel's)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from agent.program.diagnose.bundle import write_atomically
from tests.support.disk import SmallDisk

OLD = b"the previous bundle, whole"


def fill_two_mib(handle: IO[bytes]) -> None:
    """More than the disk has room for (1 MiB), as a bundle with a large --include is."""
    handle.write(os.urandom(2 << 20))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with SmallDisk(tmp_path / "out", size=1 << 20) as small:
        yield small


@pytest.mark.parametrize(
    ("fault", "code", "says"),
    [("full", errno.ENOSPC, "No space left"), ("read-only", errno.EROFS, "Read-only")],
)
def test_a_bundle_the_disk_refuses_leaves_the_old_one_whole(
    disk: SmallDisk, fault: str, code: int, says: str
) -> None:
    final = disk.path / "bundle.tar.gz"
    final.write_bytes(OLD)
    if fault == "full":
        disk.fill()
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(disk.path)], check=True)
    with pytest.raises(OSError, match=says) as refused:
        write_atomically(final, fill_two_mib)
    assert refused.value.errno == code
    assert final.read_bytes() == OLD
    assert sorted(p.name for p in disk.path.iterdir() if p.name != ".filler") == [final.name]
