"""Write probe: how fast a directory takes a burst of writes that must reach the disk.

Off by default and never run in a directory it was not given: it writes real data (64 MiB by
default) to the file system the jobs use. The file has no name (`_create_unnamed`), so that it
is gone in every case, a kill -9 included; it is written in 1 MiB chunks of random bytes
(zeros would be compressed away by ZFS or btrfs) and flushed with fdatasync. It refuses to start when the free space after it would fall below a margin.

`run_write_probe` is a plain function so that `gpuwarden check --io-test DIR` reuses it.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
)
from agent.contracts.errors import CallStillHung, CallTimedOut, GpuwardenError
from agent.contracts.model import (
    ActiveRepair,
    Collection,
    Event,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
)
from agent.contracts.settings import setting

MIB = 1024 * 1024
CHUNK_BYTES = MIB
PROBE_PREFIX = ".gpuwarden-io-probe-"


class ProbeError(GpuwardenError):
    """The probe did not produce a measurement; `action` is what to do about this case."""

    def __init__(self, message: str, action: str) -> None:
        super().__init__(message)
        self.action = action


class ProbeRefused(ProbeError):
    """The probe would not start: no directory, not a directory, too little free space."""


class ProbeFailed(ProbeError):
    """Writing, syncing or removing the probe file failed (the OS error is the cause)."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    directory: str
    size_bytes: int
    write_seconds: float
    """Writing every chunk and the final fdatasync: the time until the data is on the device."""
    sync_latency_seconds: float
    """One 4 KiB write plus fdatasync before the burst: what a small durable write costs."""

    @property
    def throughput_bytes_per_second(self) -> float:
        return self.size_bytes / self.write_seconds if self.write_seconds > 0 else 0.0


def run_write_probe(
    directory: str | os.PathLike[str] | None,
    size_mib: int = 64,
    *,
    free_margin_bytes: int = 1024 * MIB,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    clock: Callable[[], float] = time.perf_counter,
) -> ProbeResult:
    """Write `size_mib` MiB to a new file in `directory`, fdatasync, remove it, and time it.

    Raises `ProbeRefused` before writing anything when there is no directory, it is not a
    directory, or its available space minus the probe would drop below `free_margin_bytes`;
    `ProbeFailed` when the writing itself fails. The file is removed in every case.
    """
    if directory is None or not str(directory):
        raise ProbeRefused(
            "no directory given: the write probe runs only where it is told to",
            "name the directories to probe in [collectors.io_probe] directories",
        )
    path = Path(directory)
    if not path.exists():
        raise ProbeRefused(
            f"{path} is not a directory: it does not exist",
            f"create {path}, or name a directory that exists",
        )
    if not path.is_dir():
        raise ProbeRefused(
            f"{path} is not a directory", f"{path} is a file: name a directory to write in"
        )
    if size_mib < 1:
        raise ProbeRefused(
            f"probe size must be at least 1 MiB, got {size_mib}", "set size_mib to 1 or more"
        )
    size = size_mib * MIB
    st = statvfs(str(path))
    available = st.f_bavail * (st.f_frsize or st.f_bsize)
    if available - size < free_margin_bytes:
        raise ProbeRefused(
            f"{path}: {available / MIB:.0f} MiB available; writing {size_mib} MiB would leave "
            f"less than the {free_margin_bytes / MIB:.0f} MiB margin",
            "free space there or lower size_mib / free_margin_mib",
        )
    try:
        fd = _create_unnamed(path)
    except OSError as exc:
        raise ProbeFailed(
            f"{path}: cannot create the probe file: {exc.strerror}", _failed_action(exc, path)
        ) from exc
    try:
        return _write_and_time(fd, str(path), size, clock)
    except OSError as exc:
        raise ProbeFailed(
            f"{path}: writing the probe file failed: {exc.strerror}", _failed_action(exc, path)
        ) from exc
    finally:
        os.close(fd)


def _create_unnamed(directory: Path) -> int:
    """A new file in `directory` that no name points to, open for writing: its blocks are
    the file system's again when the descriptor closes, which the kernel does for a process
    killed by SIGKILL too (no `finally` runs then). A named probe file outlived every kill
    of the agent mid-probe, up to size_mib MiB each time, in the jobs' own directory.
    O_TMPFILE (Linux 3.11; ext4, XFS, btrfs, tmpfs) never has a name; where the file
    system refuses it (NFS, many FUSE file systems), a named file is removed as soon as it
    is open (NFS keeps its data under a `.nfs*` name until the close, then removes it)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        # open(2): EOPNOTSUPP where the file system lacks it; EISDIR from a kernel or
        # file system that does not know the flag (it then reads as O_DIRECTORY).
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, name = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=directory)
    try:
        os.unlink(name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _failed_action(exc: OSError, path: Path) -> str:
    if exc.errno == errno.EROFS:
        return (
            f"{path} is on a read-only file system: if it was remounted read-only after errors, "
            "look for file-system errors in the kernel log and fsck it; else probe a writable one"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"give the agent's user write access to {path}, or probe another directory"
    if exc.errno == errno.ENOSPC:
        return f"free space on {path}"
    return "check the file system and the device behind it"


def _write_and_time(fd: int, directory: str, size: int, clock: Callable[[], float]) -> ProbeResult:
    chunk = os.urandom(CHUNK_BYTES)
    started = clock()
    os.write(fd, chunk[:4096])
    os.fdatasync(fd)
    sync_latency = clock() - started
    os.lseek(fd, 0, os.SEEK_SET)
    started = clock()
    written = 0
    while written < size:
        view = memoryview(chunk)[: min(CHUNK_BYTES, size - written)]
        while view:  # os.write may write less than asked
            done = os.write(fd, view)
            view = view[done:]
            written += done
    os.fdatasync(fd)
    return ProbeResult(directory, size, clock() - started, sync_latency)


# -- the collector ----------------------------------------------------------------------------

G = MetricType.GAUGE
SOURCE = "io_probe"

THROUGHPUT = MetricFamily(
    "gpuwarden_io_probe_write_bytes_per_second",
    G,
    "Write throughput of the last probe, fdatasync included",
    ("directory",),
    "bytes",
)
SYNC_LATENCY = MetricFamily(
    "gpuwarden_io_probe_sync_latency_seconds",
    G,
    "One 4 KiB write plus fdatasync, last probe",
    ("directory",),
    "seconds",
)
DURATION = MetricFamily(
    "gpuwarden_io_probe_write_seconds",
    G,
    "Time to write and sync the probe file, last probe",
    ("directory",),
    "seconds",
)
PROBE_ERROR = MetricFamily(
    "gpuwarden_io_probe_error",
    G,
    "1 if the last probe was refused or failed (reason: refused, failed, hung)",
    ("directory", "reason"),
)
LAST_RUN = MetricFamily(
    "gpuwarden_io_probe_last_run_timestamp_seconds",
    G,
    "When the last probe finished",
    ("directory",),
    "seconds",
)


@dataclass(frozen=True)
class IoProbeSettings(CollectorSettings):
    directories: tuple[str, ...] = setting(
        (), help="directories to probe (required when enabled; there is no default)", path=True
    )
    size_mib: int = setting(64, minimum=1, maximum=65536, help="MiB written per probe")
    free_margin_mib: int = setting(
        1024, minimum=0, help="refuse to probe when less than this would be left available"
    )

    def __post_init__(self) -> None:
        if self.enabled and not self.directories:
            raise ValueError(
                "directories: the write probe is enabled but has no directory; "
                "name the directories to probe, or set enabled = false"
            )
        for directory in self.directories:
            if not os.path.isabs(directory):
                raise ValueError(f"directories: {directory!r} is not an absolute path")


HELD_KINDS: Final = ("io_probe_failed", "io_probe_hung")
"""The probe's events that hold a requirement (check_storage) until io_probe_recovered."""
_INHERITED: Final = "reported by an earlier instance"


def _recovered_event(directory: str, words: str) -> Event:
    return Event(
        source=SOURCE,
        kind="io_probe_recovered",
        severity=Severity.INFO,
        repair_action=RepairAction.NONE,
        clears=("io_probe_failed", "io_probe_hung", "io_probe_refused"),
        subject=directory,
        message=f"{directory}: {words}",
    )


class IoProbeCollector:
    name = "io_probe"

    def __init__(self, settings: IoProbeSettings, deps: CollectorDeps) -> None:
        self.settings = settings
        self.deps = deps
        self._last_problem: dict[str, str] = {}
        self._held: dict[str, dict[str, ActiveRepair]] | None = None
        """directory -> the kinds the ledger held for it when this instance first looked,
        not yet taken over (`_take_over`)."""

    def families(self) -> Sequence[MetricFamily]:
        return (THROUGHPUT, SYNC_LATENCY, DURATION, PROBE_ERROR, LAST_RUN)

    async def collect(self, ctx: CollectContext) -> Collection:
        samples: list[Sample] = []
        events: list[Event] = []
        if self._held is None:
            self._held = self.deps.held_by(SOURCE, HELD_KINDS)
            for directory in sorted(set(self._held) - set(self.settings.directories)):
                del self._held[directory]
                events.append(
                    _recovered_event(
                        directory, "is no longer probed (left out by the configuration)"
                    )
                )
        for directory in self.settings.directories:
            # One at a time: probes running side by side on one disk would measure each other.
            reason, problem, action = "", "", ""
            try:
                result = await ctx.call(
                    f"io_probe:{directory}",
                    run_write_probe,
                    directory,
                    self.settings.size_mib,
                    free_margin_bytes=self.settings.free_margin_mib * MIB,
                )
            except ProbeRefused as exc:
                reason, problem, action = "refused", str(exc), exc.action
            except ProbeFailed as exc:
                reason, problem, action = "failed", str(exc), exc.action
            except (CallTimedOut, CallStillHung) as exc:
                reason, problem = "hung", f"{directory}: the write probe hangs ({exc})"
                action = "check the file system and the device behind it"
            else:
                samples += [
                    THROUGHPUT.sample(result.throughput_bytes_per_second, directory),
                    SYNC_LATENCY.sample(result.sync_latency_seconds, directory),
                    DURATION.sample(result.write_seconds, directory),
                    LAST_RUN.sample(ctx.now, directory),
                ]
            for name in ("refused", "failed", "hung"):
                samples.append(PROBE_ERROR.sample(int(name == reason), directory, name))
            self._take_over(directory, f"io_probe_{reason}", problem)
            if problem and self._last_problem.get(directory) != problem:
                events.append(
                    Event(
                        source=SOURCE,
                        kind=f"io_probe_{reason}",
                        severity=Severity.INFO if reason == "refused" else Severity.WARNING,
                        repair_action=RepairAction.NONE
                        if reason == "refused"
                        else RepairAction.CHECK_STORAGE,
                        subject=directory,
                        message=problem,
                        action=action,
                    )
                )
            if not problem and self._last_problem.get(directory):
                # The all-clear: the requirement the failed or hung probe raised ends here.
                events.append(_recovered_event(directory, "the write probe succeeds again"))
            self._last_problem[directory] = problem
        return Collection(samples=samples, events=events)

    def _take_over(self, directory: str, kind: str, problem: str) -> None:
        """The first probe of a directory for which an earlier instance (before a reload or
        a restart) raised a requirement the ledger still holds: the same problem again is
        no news; none at all is its all-clear."""
        kinds = self._held.pop(directory, None) if self._held else None
        if kinds is not None and directory not in self._last_problem:
            self._last_problem[directory] = problem if problem and kind in kinds else _INHERITED

    async def close(self) -> None:
        return None


SPEC = CollectorSpec(
    name="io_probe",
    description="write throughput and sync latency of configured directories (off by default)",
    settings_type=IoProbeSettings,
    factory=IoProbeCollector,
    default_settings=IoProbeSettings(enabled=False, interval=3600.0, timeout=300.0),
)
