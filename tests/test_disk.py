"""The disk collector: mount selection, thresholds with hysteresis, read-only turns, stuck mounts."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.contracts.collector import MemoryKeyValueStore
from agent.contracts.errors import ConfigError
from agent.contracts.model import Severity
from agent.contracts.settings import build
from collectors._procfs import read_mountinfo
from collectors.disk.collector import DiskCollector, DiskSettings, select_mounts
from collectors.disk.levels import Level, Limits
from tests.support.host import (
    FIXTURES,
    GIB,
    HangingStatvfs,
    ProcTree,
    ScriptedStatvfs,
    by_kind,
    fake_statvfs_result,
    make_deps,
    pooled_caller,
    run_round,
    values,
)
from tests.support.stores import StateOnDisk
from tests.support.waiting import until

HOST1 = FIXTURES / "host1"


def _settings(proc_root: Path, **changes: object) -> DiskSettings:
    return build(DiskSettings, {"proc_root": str(proc_root), **changes})


def _healthy(size: int = 100 * GIB, available: int = 50 * GIB) -> os.statvfs_result:
    return fake_statvfs_result(size=size, available=available)


class TestMountSelection:
    """Which mounts are watched by default and with include/exclude settings."""

    def test_defaults_keep_block_and_network_file_systems_only(self) -> None:
        mounts = select_mounts(read_mountinfo(HOST1), _settings(HOST1))
        assert [m.mount_point for m in mounts] == [
            "/",
            "/boot/efi",
            "/data",
            "/mnt/archive",
            "/mnt/lustre",
            "/mnt/nfs",
            "/mnt/scratch space",
        ]

    def test_bind_mount_of_one_file_system_is_reported_once_under_its_root(self) -> None:
        mounts = select_mounts(read_mountinfo(HOST1), _settings(HOST1))
        xfs = [m for m in mounts if m.source == "/dev/nvme1n1"]
        assert [(m.mount_point, m.root) for m in xfs] == [("/data", "/")]

    def test_dedupe_off_keeps_every_bind_mount(self) -> None:
        settings = _settings(HOST1, dedupe_bind_mounts=False)
        points = [m.mount_point for m in select_mounts(read_mountinfo(HOST1), settings)]
        assert "/srv/datasets" in points
        assert "/data" in points

    def test_include_and_exclude_globs(self) -> None:
        settings = _settings(
            HOST1, mountpoints_include=["/mnt/*"], mountpoints_exclude=["/mnt/archive"]
        )
        points = [m.mount_point for m in select_mounts(read_mountinfo(HOST1), settings)]
        assert points == ["/mnt/lustre", "/mnt/nfs", "/mnt/scratch space"]

    def test_fs_type_include_and_a_tmpfs_made_watchable(self) -> None:
        settings = _settings(
            HOST1, fs_types_include=["nfs*", "tmpfs"], fs_types_exclude=[], mountpoints_exclude=[]
        )
        points = [m.mount_point for m in select_mounts(read_mountinfo(HOST1), settings)]
        assert points == ["/dev/shm", "/mnt/nfs", "/run"]

    def test_warning_above_critical_is_a_config_error(self) -> None:
        with pytest.raises(ConfigError, match="space_warning_percent"):
            build(DiskSettings, {"space_warning_percent": 96.0}, "collectors.disk")


class TestLevels:
    """Threshold levels rise at once and clear only past the hysteresis margin."""

    limits = Limits(90.0, 95.0, 0.0, 0.0, 5.0)

    def test_hovering_at_the_line_does_not_flap(self) -> None:
        level = Level.OK
        seen = []
        for used in (89.9, 90.0, 89.0, 90.5, 86.0, 85.1, 89.9, 84.9, 88.0):
            level = self.limits.next_level(level, used, 0)
            seen.append(level)
        assert seen == [
            Level.OK,
            Level.WARNING,
            Level.WARNING,
            Level.WARNING,
            Level.WARNING,
            Level.WARNING,
            Level.WARNING,
            Level.OK,
            Level.OK,
        ]

    def test_critical_steps_down_to_warning_then_ok(self) -> None:
        level = self.limits.next_level(Level.OK, 97.0, 0)
        assert level is Level.CRITICAL
        assert self.limits.next_level(level, 91.0, 0) is Level.CRITICAL  # 95 - 5 = 90 still held
        assert self.limits.next_level(level, 89.0, 0) is Level.WARNING
        assert self.limits.next_level(Level.WARNING, 80.0, 0) is Level.OK

    def test_absolute_threshold_with_margin(self) -> None:
        limits = Limits(0.0, 0.0, 10 * GIB, 0.0, 5.0)
        level = limits.next_level(Level.OK, 10.0, 10 * GIB)
        assert level is Level.WARNING
        assert limits.next_level(level, 10.0, int(10.4 * GIB)) is Level.WARNING
        assert limits.next_level(level, 10.0, int(10.6 * GIB)) is Level.OK

    @given(st.lists(st.floats(0, 100), max_size=60))
    def test_transitions_happen_only_past_the_lines(self, readings: list[float]) -> None:
        level = Level.OK
        for used in readings:
            after = self.limits.next_level(level, used, 0)
            if after > level:  # raised: at or past that level's threshold
                assert used >= (90.0 if after is Level.WARNING else 95.0)
            if after < level:  # lowered: below the left level's threshold by the margin
                assert used < (90.0 if level is Level.WARNING else 95.0) - 5.0
            level = after

    def test_zero_thresholds_are_off(self) -> None:
        limits = Limits(0.0, 0.0, 0.0, 0.0, 5.0)
        assert limits.next_level(Level.OK, 100.0, 0) is Level.OK


def _only_root(tmp_path: Path) -> ProcTree:
    tree = ProcTree(tmp_path / "proc")
    tree.set_mountinfo("27 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n")
    return tree


class TestThresholdEvents:
    """Space and inode thresholds raise one event per level change, and persist across restarts."""

    async def test_space_hover_raises_once_and_clears_below_margin(self, tmp_path: Path) -> None:
        tree = _only_root(tmp_path)
        statvfs = ScriptedStatvfs()
        collector = DiskCollector(_settings(tree.root), make_deps(), statvfs)
        kinds = []
        with pooled_caller() as caller:
            for used in (50, 91, 89, 90, 86, 84, 97):
                statvfs.answers["/"] = fake_statvfs_result(
                    size=100 * GIB, available=(100 - used) * GIB
                )
                result = await run_round(collector, caller)
                kinds.append([(e.kind, e.severity) for e in result.events])
        assert kinds == [
            [],
            [("filesystem_space_low", Severity.WARNING)],
            [],
            [],
            [],
            [("filesystem_space_ok", Severity.INFO)],
            [("filesystem_space_low", Severity.CRITICAL)],
        ]
        levels = values(result, "gpuwarden_filesystem_threshold_level")
        assert levels[("/", "/dev/nvme0n1p2", "ext4", "space")] == 2

    async def test_inodes_threshold_and_absent_inode_counts(self, tmp_path: Path) -> None:
        tree = _only_root(tmp_path)
        statvfs = ScriptedStatvfs(
            {"/": fake_statvfs_result(size=GIB, available=GIB // 2, inodes=1000, inodes_free=20)}
        )
        collector = DiskCollector(_settings(tree.root), make_deps(), statvfs)
        with pooled_caller() as caller:
            result = await run_round(collector, caller)
            (event,) = by_kind(result.events, "filesystem_inodes_low")
            assert event.severity is Severity.CRITICAL
            assert event.attributes["left"] == 20
            # btrfs and some NFS servers report 0 inodes: absent, and no inode alarm.
            statvfs.answers["/"] = fake_statvfs_result(
                size=GIB, available=GIB // 2, inodes=0, inodes_free=0
            )
            result = await run_round(collector, caller)
        assert values(result, "gpuwarden_filesystem_inodes") == {}
        assert not by_kind(result.events, "filesystem_inodes_ok")

    async def test_a_restart_does_not_raise_a_known_level_again(self, tmp_path: Path) -> None:
        tree = _only_root(tmp_path)
        store = MemoryKeyValueStore()
        statvfs = ScriptedStatvfs({"/": fake_statvfs_result(size=100 * GIB, available=5 * GIB)})
        with pooled_caller() as caller:
            first = await run_round(
                DiskCollector(_settings(tree.root), make_deps(store), statvfs), caller
            )
            again = await run_round(
                DiskCollector(_settings(tree.root), make_deps(store), statvfs), caller
            )
        assert [e.kind for e in first.events] == ["filesystem_space_low"]
        assert again.events == []

    async def test_an_unmounted_file_system_is_forgotten(self, tmp_path: Path) -> None:
        tree = _only_root(tmp_path)
        store = MemoryKeyValueStore()
        statvfs = ScriptedStatvfs({"/": fake_statvfs_result(size=100 * GIB, available=5 * GIB)})
        collector = DiskCollector(_settings(tree.root), make_deps(store), statvfs)
        with pooled_caller() as caller:
            await run_round(collector, caller)
            assert store.items("disk.levels") == {"space:/": 2}
            tree.set_mountinfo("28 1 259:3 / /data rw - xfs /dev/sdb1 rw\n")
            await run_round(collector, caller)
        assert store.items("disk.levels") == {}


class TestStateStoreFull:
    """A disk that refuses the state store's writes does not cost the round; the levels are
    stored once there is room."""

    async def test_round_keeps_its_samples_and_events_and_saves_later(
        self, tmp_path: Path, state_on_disk: StateOnDisk
    ) -> None:
        tree = _only_root(tmp_path)
        state_on_disk.fill()
        statvfs = ScriptedStatvfs({"/": fake_statvfs_result(size=100 * GIB, available=2 * GIB)})
        collector = DiskCollector(_settings(tree.root), make_deps(state_on_disk.state), statvfs)
        with pooled_caller() as caller:
            full = await run_round(collector, caller)
            assert not state_on_disk.end_round()
            assert state_on_disk.store.items("disk.levels") == {}
            state_on_disk.disk.free()
            later = await run_round(collector, caller)
            assert state_on_disk.end_round()
        assert [e.kind for e in full.events] == ["filesystem_space_low"]
        assert values(full, "gpuwarden_filesystem_available_bytes") == {
            ("/", "/dev/nvme0n1p2", "ext4"): 2 * GIB
        }
        assert (
            values(full, "gpuwarden_filesystem_threshold_level")[
                ("/", "/dev/nvme0n1p2", "ext4", "space")
            ]
            == 2
        )
        assert later.events == []
        assert state_on_disk.store.items("disk.levels") == {"space:/": 2}


class TestReadOnly:
    """A mount that turns read-only while watched is critical; one read-only from the start is not."""

    RW = "27 1 259:2 / / rw,relatime - ext4 /dev/sda1 rw\n36 27 8:17 / /mnt/archive ro - ext4 /dev/sdb1 ro\n"
    # errors=remount-ro flips the super block, which shows in the last field.
    RO = "27 1 259:2 / / rw,relatime - ext4 /dev/sda1 ro\n36 27 8:17 / /mnt/archive ro - ext4 /dev/sdb1 ro\n"

    async def test_turning_read_only_and_back(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        statvfs = ScriptedStatvfs({"/": _healthy(), "/mnt/archive": _healthy()})
        collector = DiskCollector(_settings(tree.root), make_deps(), statvfs)
        with pooled_caller() as caller:
            tree.set_mountinfo(self.RW)
            start = await run_round(collector, caller)
            tree.set_mountinfo(self.RO)
            turned = await run_round(collector, caller)
            tree.set_mountinfo(self.RW)
            back = await run_round(collector, caller)
        assert start.events == []
        assert (
            values(start, "gpuwarden_filesystem_readonly")[("/mnt/archive", "/dev/sdb1", "ext4")]
            == 1
        )
        (event,) = turned.events
        assert (event.kind, event.severity, event.subject) == (
            "filesystem_readonly",
            Severity.CRITICAL,
            "/",
        )
        assert "fsck" in event.action
        assert [e.kind for e in back.events] == ["filesystem_writable"]

    async def test_per_mount_read_only_is_not_a_failing_file_system(self, tmp_path: Path) -> None:
        """systemd's ProtectSystem=strict makes every mount of the service read-only (statvfs
        says ST_RDONLY, mount options say ro) while the super block stays rw: no alarm."""
        tree = ProcTree(tmp_path / "proc")
        tree.set_mountinfo("27 1 259:2 / / rw - ext4 /dev/sda1 rw\n")
        statvfs = ScriptedStatvfs({"/": _healthy()})
        collector = DiskCollector(_settings(tree.root), make_deps(), statvfs)
        with pooled_caller() as caller:
            await run_round(collector, caller)
            tree.set_mountinfo("27 1 259:2 / / ro - ext4 /dev/sda1 rw\n")
            statvfs.answers["/"] = fake_statvfs_result(size=GIB, available=GIB // 2, read_only=True)
            result = await run_round(collector, caller)
        assert result.events == []
        readonly = [
            s.value for s in result.samples if s.family.name == "gpuwarden_filesystem_readonly"
        ]
        assert readonly == [0.0]


class TestStuckMount:
    """A statvfs that hangs (a dead NFS server) through the real PooledCaller."""

    async def test_stuck_mount_is_reported_skipped_and_recovers(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.set_mountinfo(
            "27 1 259:2 / / rw - ext4 /dev/sda1 rw\n"
            "30 27 0:45 / /mnt/nfs rw - nfs4 storage01:/export rw,hard\n"
        )
        statvfs = HangingStatvfs(hanging={"/mnt/nfs"}, answer=lambda path: os.statvfs("/"))
        collector = DiskCollector(_settings(tree.root), make_deps(), statvfs)
        nfs = ("/mnt/nfs", "storage01:/export", "nfs4")
        with pooled_caller(timeout=0.2) as caller:
            first = await run_round(collector, caller)
            second = await run_round(collector, caller)
            assert statvfs.calls.count("/mnt/nfs") == 1  # not asked again while it hangs
            statvfs.release.set()
            await until(lambda: not caller.hung, what="the hung statvfs to return")
            third = await run_round(collector, caller)
        (stuck,) = first.events
        assert (stuck.kind, stuck.severity, stuck.subject) == (
            "mount_stuck",
            Severity.CRITICAL,
            "/mnt/nfs",
        )
        assert "storage01:/export" in stuck.action
        assert values(first, "gpuwarden_mount_stuck") == {nfs: 1, ("/", "/dev/sda1", "ext4"): 0}
        assert nfs not in values(first, "gpuwarden_filesystem_size_bytes")
        assert ("/", "/dev/sda1", "ext4") in values(first, "gpuwarden_filesystem_size_bytes")
        assert second.events == []
        assert values(second, "gpuwarden_mount_stuck")[nfs] == 1
        assert [e.kind for e in third.events] == ["mount_recovered"]
        assert values(third, "gpuwarden_mount_stuck")[nfs] == 0
        assert values(third, "gpuwarden_filesystem_size_bytes")[nfs] > 0

    async def test_a_mount_that_keeps_answering_late_is_stuck_once(self, tmp_path: Path) -> None:
        """Each hung statvfs returns in the end, but the next one misses the timeout again:
        one mount_stuck, not one per hung call, until the mount really answers in time."""
        tree = ProcTree(tmp_path / "proc")
        tree.set_mountinfo("30 1 0:45 / /mnt/nfs rw - nfs4 storage01:/export rw,hard\n")
        statvfs = HangingStatvfs(hanging={"/mnt/nfs"}, answer=lambda path: os.statvfs("/"))
        collector = DiskCollector(_settings(tree.root), make_deps(), statvfs)
        kinds = []
        with pooled_caller(timeout=0.2) as caller:
            for _ in range(3):
                kinds.append([e.kind for e in (await run_round(collector, caller)).events])
                kinds.append([e.kind for e in (await run_round(collector, caller)).events])
                statvfs.release.set()  # the hung call returns late...
                await until(lambda: not caller.hung, what="the hung statvfs to return")
                statvfs.release.clear()  # ...and the next one hangs again
            statvfs.release.set()
            recovered = await run_round(collector, caller)
        assert statvfs.calls.count("/mnt/nfs") == 4
        assert kinds == [["mount_stuck"], [], [], [], [], []]
        assert [e.kind for e in recovered.events] == ["mount_recovered"]


class TestErrors:
    """statvfs errors are a series and one event; a mount that vanished is simply left out."""

    async def test_permission_error_and_vanished_mount(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.set_mountinfo(
            "27 1 259:2 / / rw - ext4 /dev/sda1 rw\n"
            "28 27 259:3 / /secret rw - ext4 /dev/sdb1 rw\n"
            "29 27 259:4 / /gone rw - ext4 /dev/sdc1 rw\n"
        )
        statvfs = ScriptedStatvfs(
            {"/": _healthy(), "/secret": OSError(errno.EACCES, "Permission denied")}
        )
        collector = DiskCollector(_settings(tree.root), make_deps(), statvfs)
        with pooled_caller() as caller:
            first = await run_round(collector, caller)
            second = await run_round(collector, caller)
        errors = values(first, "gpuwarden_filesystem_error")
        assert errors == {("/", "/dev/sda1", "ext4"): 0, ("/secret", "/dev/sdb1", "ext4"): 1}
        (event,) = first.events
        assert (event.kind, event.subject) == ("mount_error", "/secret")
        assert "Permission denied" in event.message
        assert second.events == []


class TestRealHost:
    """On this machine's real /proc and statvfs."""

    async def test_root_file_system_is_measured(self) -> None:
        collector = DiskCollector(DiskSettings(), make_deps())
        with pooled_caller() as caller:
            result = await run_round(collector, caller)
        sizes = {
            labels[0]: v for labels, v in values(result, "gpuwarden_filesystem_size_bytes").items()
        }
        assert sizes["/"] == pytest.approx(shutil.disk_usage("/").total, rel=0.01)
