"""Disks: space, inodes and read-only state of every real mount, and mounts that hang.

Mounts come from /proc/self/mountinfo. Pseudo file systems (proc, sysfs, cgroup, tmpfs, overlay,
squashfs, ...) are left out by default: they hold no data a job can lose, and container
runtimes create hundreds of them. Block-backed and network file systems are kept. Bind mounts
of one file system are reported once (see `select_mounts`).

statvfs on a dead NFS server blocks in the kernel, so every statvfs goes through `ctx.call`
with a per-mount key: a mount that does not answer in time is reported stuck and is not asked
again until the hung call returns. One stuck mount never fails the round. For network, cluster
and FUSE file systems (`isolated_fs_types`) the statvfs itself runs in a helper process
(collectors/disk/isolated.py): a thread stuck in the kernel there would keep the agent from
exiting, even on SIGKILL, until the server answers.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
)
from agent.contracts.errors import CallStillHung, CallTimedOut
from agent.contracts.model import (
    AttributeValue,
    Collection,
    Event,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
)
from agent.contracts.settings import setting
from collectors._procfs import MountInfo, read_mountinfo
from collectors.disk.isolated import DEFAULT_ISOLATED_TYPES, StatvfsHelpers
from collectors.disk.levels import Level, Limits, used_percent

G = MetricType.GAUGE
SOURCE = "disk"
MOUNT_LABELS = ("mountpoint", "device", "fstype")

SIZE = MetricFamily("gpuwarden_filesystem_size_bytes", G, "File system size", MOUNT_LABELS, "bytes")
FREE = MetricFamily(
    "gpuwarden_filesystem_free_bytes",
    G,
    "Free bytes, including those reserved for root",
    MOUNT_LABELS,
    "bytes",
)
AVAILABLE = MetricFamily(
    "gpuwarden_filesystem_available_bytes",
    G,
    "Bytes available to unprivileged users",
    MOUNT_LABELS,
    "bytes",
)
INODES = MetricFamily(
    "gpuwarden_filesystem_inodes",
    G,
    "Inodes in the file system (absent where the file system has no fixed count)",
    MOUNT_LABELS,
)
INODES_FREE = MetricFamily("gpuwarden_filesystem_inodes_free", G, "Free inodes", MOUNT_LABELS)
READ_ONLY = MetricFamily(
    "gpuwarden_filesystem_readonly", G, "1 if the mount is read-only", MOUNT_LABELS
)
LEVEL = MetricFamily(
    "gpuwarden_filesystem_threshold_level",
    G,
    "0 ok, 1 warning, 2 critical: the thresholds' state with hysteresis, per resource (space, inodes)",
    (*MOUNT_LABELS, "resource"),
)
STUCK = MetricFamily(
    "gpuwarden_mount_stuck", G, "1 while statvfs on the mount does not answer", MOUNT_LABELS
)
ERROR = MetricFamily(
    "gpuwarden_filesystem_error", G, "1 if statvfs on the mount failed with an error", MOUNT_LABELS
)

# Types that hold no user data. tmpfs is here too: /run, /dev/shm and container secrets are
# many and small; name a tmpfs in mountpoints_include and drop "tmpfs" here to watch one.
DEFAULT_EXCLUDED_TYPES = (
    "autofs",
    "binfmt_misc",
    "bpf",
    "cgroup",
    "cgroup2",
    "configfs",
    "debugfs",
    "devpts",
    "devtmpfs",
    "efivarfs",
    "fusectl",
    "fuse.lxcfs",
    "fuse.portal",
    "fuse.gvfsd-fuse",
    "hugetlbfs",
    "mqueue",
    "nsfs",
    "overlay",
    "proc",
    "pstore",
    "ramfs",
    "rpc_pipefs",
    "securityfs",
    "selinuxfs",
    "squashfs",
    "sysfs",
    "tmpfs",
    "tracefs",
    "nfsd",
    "iso9660",
    "erofs",
)
DEFAULT_EXCLUDED_MOUNTPOINTS = (
    "/proc",
    "/proc/*",
    "/sys",
    "/sys/*",
    "/dev",
    "/dev/*",
    "/run/credentials/*",
    "/var/lib/docker/*",
    "/var/lib/containers/*",
    "/var/lib/kubelet/pods/*",
    "/snap/*",
)

Statvfs = Callable[[str], os.statvfs_result]
STATVFS_CONCURRENCY = 4


@dataclass(frozen=True)
class DiskSettings(CollectorSettings):
    proc_root: Path = setting(Path("/proc"), help="where /proc is mounted (fixture trees in tests)")
    rootfs: Path = setting(
        Path("/"), help="where the host's root is seen (a container with the host's / at /host)"
    )
    mountpoints_include: tuple[str, ...] = setting(
        (), help="glob patterns; if set, only matching mount points are watched"
    )
    mountpoints_exclude: tuple[str, ...] = setting(
        DEFAULT_EXCLUDED_MOUNTPOINTS, help="glob patterns of mount points never watched"
    )
    fs_types_include: tuple[str, ...] = setting(
        (), help="glob patterns; if set, only these file system types are watched"
    )
    fs_types_exclude: tuple[str, ...] = setting(
        DEFAULT_EXCLUDED_TYPES, help="glob patterns of file system types never watched"
    )
    isolated_fs_types: tuple[str, ...] = setting(
        DEFAULT_ISOLATED_TYPES,
        help="glob patterns of file system types (network, cluster, FUSE) whose statvfs runs "
        "in a helper process, so that a dead server cannot keep the agent from stopping; "
        "the others run in threads",
    )
    dedupe_bind_mounts: bool = setting(
        True, help="report a file system once, not once per bind mount"
    )
    space_warning_percent: float = setting(
        90.0, minimum=0, maximum=100, help="percent used that raises a warning (0: off)"
    )
    space_critical_percent: float = setting(
        95.0, minimum=0, maximum=100, help="percent used that is critical (0: off)"
    )
    space_warning_available_bytes: float = setting(
        0.0, minimum=0, help="bytes available at or below which a warning is raised (0: off)"
    )
    space_critical_available_bytes: float = setting(
        0.0, minimum=0, help="bytes available at or below which it is critical (0: off)"
    )
    inodes_warning_percent: float = setting(
        90.0, minimum=0, maximum=100, help="percent of inodes used that raises a warning (0: off)"
    )
    inodes_critical_percent: float = setting(
        95.0, minimum=0, maximum=100, help="percent of inodes used that is critical (0: off)"
    )
    inodes_warning_free: float = setting(
        0.0, minimum=0, help="free inodes at or below which a warning is raised (0: off)"
    )
    inodes_critical_free: float = setting(
        0.0, minimum=0, help="free inodes at or below which it is critical (0: off)"
    )
    hysteresis_percent: float = setting(
        5.0,
        minimum=0,
        maximum=50,
        help="a level clears only this many percent points below its threshold (absolute thresholds: this percent above)",
    )

    def __post_init__(self) -> None:
        for resource in ("space", "inodes"):
            warning = getattr(self, f"{resource}_warning_percent")
            critical = getattr(self, f"{resource}_critical_percent")
            if warning and critical and warning > critical:
                raise ValueError(
                    f"{resource}_warning_percent ({warning}) is above "
                    f"{resource}_critical_percent ({critical})"
                )

    def limits(self, resource: str) -> Limits:
        if resource == "space":
            return Limits(
                self.space_warning_percent,
                self.space_critical_percent,
                self.space_warning_available_bytes,
                self.space_critical_available_bytes,
                self.hysteresis_percent,
            )
        return Limits(
            self.inodes_warning_percent,
            self.inodes_critical_percent,
            self.inodes_warning_free,
            self.inodes_critical_free,
            self.hysteresis_percent,
        )


def _matches(value: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(value, pattern) for pattern in patterns)


def is_watched(mount: MountInfo, settings: DiskSettings) -> bool:
    if settings.fs_types_include and not _matches(mount.fs_type, settings.fs_types_include):
        return False
    if _matches(mount.fs_type, settings.fs_types_exclude):
        return False
    if settings.mountpoints_include and not _matches(
        mount.mount_point, settings.mountpoints_include
    ):
        return False
    return not _matches(mount.mount_point, settings.mountpoints_exclude)


def select_mounts(mounts: Sequence[MountInfo], settings: DiskSettings) -> list[MountInfo]:
    """The watched mounts, one per file system when deduplicating.

    Bind mounts share the device number (major:minor) of the file system they show, and statvfs
    gives them identical figures, so only one is kept: the one that shows the file system's
    root, else the shortest mount point. Network file systems get one device number per
    super block, so two NFS exports stay two series.
    """
    watched = [m for m in mounts if is_watched(m, settings)]
    if not settings.dedupe_bind_mounts:
        return sorted(watched, key=lambda m: m.mount_point)
    chosen: dict[str, MountInfo] = {}
    for mount in watched:
        previous = chosen.get(mount.major_minor)
        if previous is None or _rank(mount) < _rank(previous):
            chosen[mount.major_minor] = mount
    return sorted(chosen.values(), key=lambda m: m.mount_point)


def _rank(mount: MountInfo) -> tuple[int, int, str]:
    return (0 if mount.root == "/" else 1, len(mount.mount_point), mount.mount_point)


@dataclass(frozen=True, slots=True)
class FsStats:
    size_bytes: int
    free_bytes: int
    available_bytes: int
    inodes: int
    inodes_free: int


def stat_filesystem(path: str, statvfs: Statvfs = os.statvfs) -> FsStats:
    """statvfs in bytes. f_frsize is the unit of the block counts (f_bsize is only a hint)."""
    st = statvfs(path)
    unit = st.f_frsize or st.f_bsize
    return FsStats(
        size_bytes=st.f_blocks * unit,
        free_bytes=st.f_bfree * unit,
        available_bytes=st.f_bavail * unit,
        inodes=st.f_files,
        inodes_free=st.f_ffree,
    )


@dataclass(frozen=True, slots=True)
class _Stuck:
    new: bool
    seconds: float


@dataclass(frozen=True, slots=True)
class _Failed:
    error: str


_Outcome = FsStats | _Stuck | _Failed | None  # None: the mount went away meanwhile (normal)

_LEVEL_NAMESPACE = "disk.levels"
_INHERITED = ""
"""In `_errors`: the mount_error an earlier instance raised, its words not known here."""


class DiskCollector:
    name = "disk"

    def __init__(
        self,
        settings: DiskSettings,
        deps: CollectorDeps,
        statvfs: Statvfs = os.statvfs,
        isolated: Statvfs | None = None,
    ) -> None:
        """`statvfs` answers for local mounts, `isolated` for `isolated_fs_types`: by
        default helper processes, unless `statvfs` is a scripted one (tests), which then
        answers for every mount."""
        self.settings = settings
        self.deps = deps
        self._statvfs = statvfs
        self.helpers: StatvfsHelpers | None = None
        if isolated is None and statvfs is os.statvfs:
            self.helpers = StatvfsHelpers()
            isolated = self.helpers.statvfs
        self._isolated: Statvfs = statvfs if isolated is None else isolated
        self._stuck: set[str] = set()
        self._errors: dict[str, str] = {}
        """mount point -> the error its mount_error reported (_INHERITED: an earlier instance
        reported it, and the ledger holds it)."""
        self._held_adopted = False
        self._read_only: dict[str, bool] = {}
        # Levels persist, so a restart neither re-raises a known full disk nor forgets it.
        self._levels: dict[str, Level] = {
            key: Level(int(value))
            for key, value in deps.state.items(_LEVEL_NAMESPACE).items()
            if isinstance(value, int) and value in (1, 2)
        }
        self._saved: dict[str, int] = {key: int(level) for key, level in self._levels.items()}
        """The levels as last handed to the state store (see `_save_levels`)."""

    def families(self) -> Sequence[MetricFamily]:
        return (SIZE, FREE, AVAILABLE, INODES, INODES_FREE, READ_ONLY, LEVEL, STUCK, ERROR)

    async def collect(self, ctx: CollectContext) -> Collection:
        mounts = await ctx.call("proc:mountinfo", read_mountinfo, self.settings.proc_root)
        selected = select_mounts(mounts, self.settings)
        self._adopt_held()
        # Concurrent, so a newly hung mount costs one timeout per round, not one per mount; but
        # bounded, because the runtime's thread pool is shared and every hung statvfs keeps a
        # thread until the kernel lets it go.
        limit = asyncio.Semaphore(STATVFS_CONCURRENCY)

        async def bounded(mount: MountInfo) -> _Outcome:
            async with limit:
                return await self._stat(ctx, mount)

        outcomes = await asyncio.gather(*(bounded(m) for m in selected))
        samples: list[Sample] = []
        events: list[Event] = []
        for mount, outcome in zip(selected, outcomes, strict=True):
            self._report(mount, outcome, samples, events)
        self._forget_unmounted({m.mount_point for m in selected}, events)
        self._save_levels()
        return Collection(samples=samples, events=events)

    def _save_levels(self) -> None:
        """Hand the levels that changed since the last round to the state store (it never
        raises: what a full disk refuses the runtime keeps and writes later)."""
        wanted = {key: int(level) for key, level in self._levels.items() if level is not Level.OK}
        for key in wanted.keys() | self._saved.keys():
            level = wanted.get(key)
            if level == self._saved.get(key):
                continue
            if level is None:  # back to ok, or unmounted
                self.deps.state.delete(_LEVEL_NAMESPACE, key)
            else:
                self.deps.state.put(_LEVEL_NAMESPACE, key, level)
        self._saved = wanted

    def _adopt_held(self) -> None:
        """Once, at the first round: take over the stuck, failing and read-only mounts an
        earlier instance (before a reload or a restart) reported and the ledger still holds,
        so that one still faulty is no news and one that works again gets its all-clear."""
        if self._held_adopted:
            return
        self._held_adopted = True
        held = self.deps.held_by(SOURCE, ("mount_stuck", "mount_error", "filesystem_readonly"))
        for mp, kinds in held.items():
            if "mount_stuck" in kinds:
                self._stuck.add(mp)
            if "mount_error" in kinds:
                self._errors.setdefault(mp, _INHERITED)
            if "filesystem_readonly" in kinds:
                self._read_only.setdefault(mp, True)

    def _forget_unmounted(self, mounted: set[str], events: list[Event]) -> None:
        """Drop what is remembered about mounts that are gone. What a stuck, failing or
        read-only mount raised ends with it: the mount detached ('umount -l', as mount_stuck advises) or no
        longer watched can say nothing more, and its requirement would be held for ever."""
        for mp in sorted(self._stuck - mounted):
            events.append(_gone_event(mp, "mount_recovered", "mount_stuck"))
        self._stuck &= mounted
        for mp in sorted(set(self._errors) - mounted):
            events.append(_gone_event(mp, "mount_error_cleared", "mount_error"))
        for mp in sorted(mp for mp, ro in self._read_only.items() if ro and mp not in mounted):
            events.append(_gone_event(mp, "filesystem_writable", "filesystem_readonly"))
        for table in (self._errors, self._read_only):
            for mp in [mp for mp in table if mp not in mounted]:
                del table[mp]
        for key in [k for k in self._levels if k.partition(":")[2] not in mounted]:
            del self._levels[key]  # and from the state store in _save_levels

    async def _stat(self, ctx: CollectContext, mount: MountInfo) -> _Outcome:
        path = os.path.join(str(self.settings.rootfs), mount.mount_point.lstrip("/"))
        isolated = _matches(mount.fs_type, self.settings.isolated_fs_types)
        statvfs = self._isolated if isolated else self._statvfs
        try:
            return await ctx.call(f"statvfs:{mount.mount_point}", stat_filesystem, path, statvfs)
        except CallTimedOut as exc:
            # Not new if the previous hung call returned and this one hangs again: a mount
            # that always answers too late is one stuck spell, not a new alarm per hung call.
            return _Stuck(new=mount.mount_point not in self._stuck, seconds=exc.timeout)
        except CallStillHung as exc:
            # Reported when that call timed out, by this collector or by the one a reload
            # replaced (the caller and its hung calls outlive it): not new either way.
            return _Stuck(new=False, seconds=exc.hung_for)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            return _Failed(os.strerror(exc.errno) if exc.errno else str(exc))

    def _report(
        self, mount: MountInfo, outcome: _Outcome, samples: list[Sample], events: list[Event]
    ) -> None:
        mp = mount.mount_point
        labels = (mp, mount.source, mount.fs_type)
        if outcome is None:
            return
        if isinstance(outcome, _Stuck):
            samples.append(STUCK.sample(1, *labels))
            if outcome.new:
                events.append(_stuck_event(mount, outcome.seconds))
            self._stuck.add(mp)
            return
        samples.append(STUCK.sample(0, *labels))
        if mp in self._stuck:
            self._stuck.discard(mp)
            events.append(
                Event(
                    source=SOURCE,
                    kind="mount_recovered",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    clears=("mount_stuck",),
                    subject=mp,
                    message=f"mount {mp} ({mount.fs_type} from {mount.source}) answers again",
                )
            )
        if isinstance(outcome, _Failed):
            samples.append(ERROR.sample(1, *labels))
            if self._errors.get(mp) not in (outcome.error, _INHERITED):
                events.append(
                    Event(
                        source=SOURCE,
                        kind="mount_error",
                        severity=Severity.WARNING,
                        repair_action=RepairAction.CHECK_STORAGE,
                        subject=mp,
                        message=f"statvfs on {mp} ({mount.fs_type} from {mount.source}) failed: "
                        f"{outcome.error}",
                        action=f"check that the agent may read {mp} and that its server or device is healthy",
                        attributes={"error": outcome.error, "device": mount.source},
                    )
                )
            self._errors[mp] = outcome.error
            return
        if self._errors.pop(mp, None) is not None:
            # The all-clear of mount_error: its check_storage requirement ends here.
            events.append(
                Event(
                    source=SOURCE,
                    kind="mount_error_cleared",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    clears=("mount_error",),
                    subject=mp,
                    message=f"statvfs on {mp} ({mount.fs_type} from {mount.source}) works again",
                )
            )
        samples.append(ERROR.sample(0, *labels))
        self._report_values(mount, outcome, labels, samples, events)

    def _report_values(
        self,
        mount: MountInfo,
        stats: FsStats,
        labels: tuple[str, str, str],
        samples: list[Sample],
        events: list[Event],
    ) -> None:
        samples += [
            SIZE.sample(stats.size_bytes, *labels),
            FREE.sample(stats.free_bytes, *labels),
            AVAILABLE.sample(stats.available_bytes, *labels),
        ]
        # Not statvfs's ST_RDONLY: it includes the per-mount flag (see MountInfo.read_only).
        read_only = mount.read_only
        samples.append(READ_ONLY.sample(int(read_only), *labels))
        self._check_read_only(mount, read_only, events)
        space_used = used_percent(stats.size_bytes - stats.free_bytes, stats.available_bytes)
        self._check_level(
            mount,
            "space",
            used=space_used,
            left=stats.available_bytes,
            stats=stats,
            samples=samples,
            events=events,
        )
        # f_files is 0 where the file system has no fixed inode count (btrfs, some NFS servers):
        # absent, not "0 inodes, 100 % used".
        if stats.inodes > 0:
            samples += [
                INODES.sample(stats.inodes, *labels),
                INODES_FREE.sample(stats.inodes_free, *labels),
            ]
            inodes_used = used_percent(stats.inodes - stats.inodes_free, stats.inodes_free)
            self._check_level(
                mount,
                "inodes",
                used=inodes_used,
                left=stats.inodes_free,
                stats=stats,
                samples=samples,
                events=events,
            )

    def _check_read_only(self, mount: MountInfo, read_only: bool, events: list[Event]) -> None:
        mp = mount.mount_point
        before = self._read_only.get(mp)
        self._read_only[mp] = read_only
        if before is False and read_only:
            events.append(
                Event(
                    source=SOURCE,
                    kind="filesystem_readonly",
                    severity=Severity.CRITICAL,
                    repair_action=RepairAction.CHECK_STORAGE,
                    subject=mp,
                    message=f"{mp} ({mount.source}, {mount.fs_type}) turned read-only while the agent "
                    "was watching it: every write there now fails",
                    action="the kernel does this after I/O or file-system errors: read the kernel log "
                    "(dmesg | grep -i -e 'I/O error' -e 'fs error'), check the device's health "
                    "(smartctl / nvme smart-log), fsck it before remounting read-write",
                    attributes={"device": mount.source, "fstype": mount.fs_type},
                )
            )
        elif before is True and not read_only:
            events.append(
                Event(
                    source=SOURCE,
                    kind="filesystem_writable",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    clears=("filesystem_readonly",),
                    subject=mp,
                    message=f"{mp} ({mount.source}) is writable again",
                )
            )

    def _check_level(
        self,
        mount: MountInfo,
        resource: str,
        *,
        used: float,
        left: int,
        stats: FsStats,
        samples: list[Sample],
        events: list[Event],
    ) -> None:
        mp = mount.mount_point
        key = f"{resource}:{mp}"
        before = self._levels.get(key, Level.OK)
        after = self.settings.limits(resource).next_level(before, used, left)
        samples.append(LEVEL.sample(int(after), mp, mount.source, mount.fs_type, resource))
        if after == before:
            return
        self._levels[key] = after  # saved at the end of the round (_save_levels)
        events.append(
            _level_event(
                mount, resource, before=before, after=after, used=used, left=left, stats=stats
            )
        )

    async def close(self) -> None:
        if self.helpers is not None:
            self.helpers.close()


def _gone_event(mp: str, kind: str, clears: str) -> Event:
    return Event(
        source=SOURCE,
        kind=kind,
        severity=Severity.INFO,
        repair_action=RepairAction.NONE,
        clears=(clears,),
        subject=mp,
        attributes={"mounted": False},
        message=f"{mp} is no longer watched (unmounted, or left out by the configuration): "
        f"its {clears} ends",
    )


def _stuck_event(mount: MountInfo, seconds: float) -> Event:
    mp = mount.mount_point
    return Event(
        source=SOURCE,
        kind="mount_stuck",
        severity=Severity.CRITICAL,
        repair_action=RepairAction.CHECK_STORAGE,
        subject=mp,
        message=f"mount {mp} ({mount.fs_type} from {mount.source}) did not answer statvfs "
        f"within {seconds:g} s: it hangs, and so will every process that touches it",
        action=f"check the server or device behind {mount.source} and the network to it; "
        f"processes using {mp} wait in D state until it answers; if the server is gone "
        f"for good, 'umount -f -l {mp}' detaches the mount",
        attributes={"device": mount.source, "fstype": mount.fs_type, "waited_seconds": seconds},
    )


def _level_event(
    mount: MountInfo,
    resource: str,
    *,
    before: Level,
    after: Level,
    used: float,
    left: int,
    stats: FsStats,
) -> Event:
    mp = mount.mount_point
    what = "space" if resource == "space" else "inodes"
    amount = f"{left / 2**30:.1f} GiB available" if resource == "space" else f"{left} inodes free"
    attributes: dict[str, AttributeValue] = {
        "used_percent": round(used, 2),
        "left": left,
        "level": after.name.lower(),
        "previous_level": before.name.lower(),
        "device": mount.source,
        "fstype": mount.fs_type,
        "size_bytes": stats.size_bytes,
    }
    if after is Level.OK:
        return Event(
            source=SOURCE,
            kind=f"filesystem_{what}_ok",
            severity=Severity.INFO,
            repair_action=RepairAction.NONE,
            clears=(f"filesystem_{what}_low",),
            subject=mp,
            attributes=attributes,
            message=f"{mp}: {what} back to normal ({used:.1f} % used, {amount})",
        )
    if resource == "space":
        action = (
            f"free space on {mp}: remove or move old checkpoints, logs and caches "
            f"(du -xh --max-depth=2 {mp} | sort -h | tail), or grow the file system"
        )
    else:
        action = (
            f"{mp} holds too many files: find the directories with the most entries "
            f"(find {mp} -xdev -type f | cut -d/ -f1-4 | sort | uniq -c | sort -n | tail) "
            "and clean them up"
        )
    severity = Severity.CRITICAL if after is Level.CRITICAL else Severity.WARNING
    return Event(
        source=SOURCE,
        kind=f"filesystem_{what}_low",
        severity=severity,
        repair_action=RepairAction.CHECK_STORAGE,
        subject=mp,
        attributes=attributes,
        action=action,
        message=f"{mp} ({mount.source}): {what} {after.name.lower()}: {used:.1f} % used, {amount}",
    )


SPEC = CollectorSpec(
    name="disk",
    description="space, inodes and read-only state of real mounts; hung mounts",
    settings_type=DiskSettings,
    factory=DiskCollector,
    default_settings=DiskSettings(interval=30.0),
)
