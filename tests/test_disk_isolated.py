"""statvfs in helper processes (collectors/disk/isolated.py): real answers and errors, a stuck
helper is that mount's alone, a dead helper is replaced, close() waits for nothing."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.contracts.settings import build
from collectors.disk.collector import DiskCollector, DiskSettings
from collectors.disk.isolated import COMMAND, StatvfsHelpers
from tests.support.host import ProcTree, make_deps, pooled_caller, run_round, values
from tests.support.waiting import wait_until

STUCK_CHILD = """
import json, os, sys, time
for line in sys.stdin:
    path = json.loads(line)
    if path.startswith("/stuck"):
        time.sleep(3600)  # a server that never answers
    print(json.dumps({"v": list(os.statvfs(path))}), flush=True)
"""


@pytest.fixture
def helpers() -> StatvfsHelpers:
    return StatvfsHelpers(COMMAND)


class TestAnswers:
    def test_same_figures_as_statvfs_and_one_helper_reused(
        self, helpers: StatvfsHelpers, tmp_path: Path
    ) -> None:
        try:
            for _ in range(3):
                got = helpers.statvfs(str(tmp_path))
                want = os.statvfs(tmp_path)
                assert (got.f_frsize, got.f_blocks, got.f_namemax) == (
                    want.f_frsize,
                    want.f_blocks,
                    want.f_namemax,
                )
            assert helpers.started == 1
            assert helpers.pids() != [os.getpid()]
        finally:
            helpers.close()

    def test_errors_are_the_mounts_own(self, helpers: StatvfsHelpers, tmp_path: Path) -> None:
        """ENOENT is FileNotFoundError as from os.statvfs (the collector leaves such a mount
        out), and the helper stays for the next call."""
        missing = tmp_path / "gone"
        try:
            with pytest.raises(FileNotFoundError) as caught:
                helpers.statvfs(str(missing))
            assert caught.value.filename == str(missing)
            (tmp_path / "file").write_text("x")
            with pytest.raises(NotADirectoryError):
                helpers.statvfs(str(tmp_path / "file" / "below"))
            assert helpers.statvfs(str(tmp_path)).f_blocks > 0
            assert helpers.started == 1
        finally:
            helpers.close()

    def test_a_path_with_a_newline_and_spaces(
        self, helpers: StatvfsHelpers, tmp_path: Path
    ) -> None:
        odd = tmp_path / "a b\nc"
        odd.mkdir()
        try:
            assert helpers.statvfs(str(odd)).f_blocks == os.statvfs(odd).f_blocks
        finally:
            helpers.close()


class TestStuckAndDead:
    def test_a_stuck_helper_blocks_only_its_mount_and_close_waits_for_nothing(self) -> None:
        helpers = StatvfsHelpers((sys.executable, "-c", STUCK_CHILD))
        outcome: list[BaseException | None] = []

        def stuck_call() -> None:
            try:
                helpers.statvfs("/stuck/nfs")
                outcome.append(None)
            except BaseException as exc:  # recorded for the assertion
                outcome.append(exc)

        thread = threading.Thread(target=stuck_call, daemon=True)
        thread.start()
        wait_until(lambda: helpers.started == 1, what="the stuck helper")
        # Another mount meanwhile: a second helper answers it.
        assert helpers.statvfs("/").f_blocks > 0
        assert helpers.started == 2
        began = time.monotonic()
        helpers.close()
        assert time.monotonic() - began < 2.0  # gross: close never waits on a stuck helper
        thread.join(10)
        assert not thread.is_alive()
        [error] = outcome
        assert isinstance(error, OSError)  # the stuck call ends once its helper is killed
        assert helpers.started == 0

    def test_a_killed_helper_is_replaced(self, helpers: StatvfsHelpers) -> None:
        try:
            helpers.statvfs("/")
            [pid] = helpers.pids()
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not Path(f"/proc/{pid}/cmdline").read_bytes(), what="dead")
            assert helpers.statvfs("/").f_blocks > 0
            assert helpers.pids() != [pid]
        finally:
            helpers.close()


class TestDiskCollector:
    """Which mounts the real collector hands to helpers: `isolated_fs_types`, nothing else."""

    @pytest.mark.parametrize(("isolated", "helpers_started"), [(None, 1), ([], 0)])
    async def test_network_mounts_go_to_a_helper(
        self, tmp_path: Path, isolated: list[str] | None, helpers_started: int
    ) -> None:
        root = tmp_path / "root"
        for directory in ("data", "mnt/nfs"):
            (root / directory).mkdir(parents=True)
        tree = ProcTree(tmp_path / "proc")
        tree.set_mountinfo(
            "27 1 259:2 / /data rw - ext4 /dev/sda1 rw\n"
            "30 27 0:45 / /mnt/nfs rw - nfs4 storage01:/export rw,hard\n"
        )
        changes: dict[str, object] = {"proc_root": str(tree.root), "rootfs": str(root)}
        if isolated is not None:
            changes["isolated_fs_types"] = isolated
        collector = DiskCollector(build(DiskSettings, changes), make_deps())
        assert collector.helpers is not None
        try:
            with pooled_caller() as caller:
                collection = await run_round(collector, caller)
            sizes = values(collection, "gpuwarden_filesystem_size_bytes")
            want = os.statvfs(root)
            assert sizes[("/mnt/nfs", "storage01:/export", "nfs4")] == want.f_blocks * want.f_frsize
            assert ("/data", "/dev/sda1", "ext4") in sizes
            assert collector.helpers.started == helpers_started
        finally:
            await collector.close()
        assert collector.helpers.started == 0
