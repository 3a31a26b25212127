"""A thin layer over /proc: the parsers and readers the host collectors share.

The proc root is always a parameter, so tests run on fixture trees. Parsers take text and
raise `ProcParseError` on input they cannot read; readers treat a process or mount that vanishes
between listing and reading as normal and leave it out.
"""

from __future__ import annotations

import os
import pwd
import re
from dataclasses import dataclass
from pathlib import Path

from agent.contracts.errors import GpuwardenError


class ProcParseError(GpuwardenError, ValueError):
    """A /proc file did not have the shape the kernel documents (proc(5))."""


# -- /proc/[pid]/stat -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of /proc/[pid]/stat the host collectors use (proc(5) numbering in comments)."""

    pid: int  # (1)
    comm: str  # (2) at most 15 bytes, may hold spaces and parentheses
    state: str  # (3) one letter: R S D Z T t X I P W K
    ppid: int  # (4)
    num_threads: int  # (20)
    starttime: int  # (22) clock ticks after boot: with pid, identifies one process for good


def parse_stat(text: str) -> ProcStat:
    """Parse one /proc/[pid]/stat line.

    `comm` is wrapped in parentheses and may itself contain ") (" and spaces, so the fields
    after it are found from the *last* closing parenthesis, never by splitting on spaces.
    """
    open_at = text.find("(")
    close_at = text.rfind(")")
    if open_at <= 0 or close_at < open_at:
        raise ProcParseError(f"no (comm) in stat line {text[:80]!r}")
    rest = text[close_at + 1 :].split()
    # rest[0] is field 3 (state); field 22 (starttime) is rest[19].
    if len(rest) < 20:
        raise ProcParseError(f"stat line has {len(rest) + 2} fields, expected at least 22")
    try:
        return ProcStat(
            pid=int(text[:open_at]),
            comm=text[open_at + 1 : close_at],
            state=rest[0],
            ppid=int(rest[1]),
            num_threads=int(rest[17]),
            starttime=int(rest[19]),
        )
    except ValueError as exc:
        raise ProcParseError(f"bad number in stat line: {exc}") from None


def read_all_stats(proc_root: Path) -> dict[int, ProcStat]:
    """Every process's stat, keyed by pid; processes that vanish meanwhile are left out."""
    stats: dict[int, ProcStat] = {}
    root = str(proc_root)
    for name in os.listdir(root):
        if not name.isdigit():
            continue
        raw = _read_small(f"{root}/{name}/stat")
        if raw is None:
            continue
        try:
            stat = parse_stat(raw.decode("utf-8", "replace"))
        except ProcParseError:
            # An exiting process can present an empty file: skip it, like a vanished one.
            if raw.strip():
                raise
            continue
        stats[stat.pid] = stat
    return stats


def _read_small(path: str, size: int = 4096) -> bytes | None:
    """One read of a small /proc file, None if its process is gone.

    os.open/os.read rather than open(): no buffered file object per process, about a third less
    CPU over a scan of thousands (measured with bench/host_round.py). A stat line is far below
    4 KiB (52 numbers and a 15-byte name).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        return os.read(fd, size)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)


def read_wchan(proc_root: Path, pid: int, tid: int | None = None) -> str:
    """The kernel function a process (or one of its threads) sleeps in; "" if unknown or gone."""
    path = Path(proc_root, str(pid)) if tid is None else Path(proc_root, str(pid), "task", str(tid))
    try:
        text = (path / "wchan").read_text(errors="replace").strip()
    except OSError:
        return ""
    return "" if text in ("0", "") else text


def find_thread_in_state(proc_root: Path, pid: int, state: str) -> int | None:
    """A thread (not the leader) of `pid` in `state`, or None; a thread that exits is skipped."""
    task = f"{proc_root}/{pid}/task"
    try:
        tids = os.listdir(task)
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    for name in tids:
        if name == str(pid) or not name.isdigit():
            continue
        raw = _read_small(f"{task}/{name}/stat")
        if raw is None:
            continue
        # The state letter follows the last ")" (see parse_stat); no full parse needed here.
        close_at = raw.rfind(b")")
        if close_at >= 0 and raw[close_at + 2 : close_at + 3].decode("ascii", "replace") == state:
            return int(name)
    return None


# -- /proc/self/mountinfo ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MountInfo:
    """One line of mountinfo (proc(5)), with octal escapes in paths decoded."""

    mount_id: int
    parent_id: int
    major_minor: str
    root: str
    mount_point: str
    mount_options: tuple[str, ...]
    fs_type: str
    source: str
    super_options: tuple[str, ...]

    @property
    def read_only(self) -> bool:
        """Read-only at the super block: what a file system that hit errors does
        (ext4 errors=remount-ro, xfs shutdown). The per-mount flag is left out on purpose:
        systemd's ProtectSystem=strict marks every mount of the service's namespace read-only
        while the file system itself stays writable for everyone else."""
        return "ro" in self.super_options


_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")


def unescape(field: str) -> str:
    """Undo the kernel's octal escapes (space \\040, tab \\011, newline \\012, backslash \\134).

    The kernel escapes bytes; a path in another encoding than UTF-8 keeps its bytes through
    surrogateescape, so it still names the same directory for statvfs.
    """
    if "\\" not in field:
        return field
    raw = field.encode("utf-8", "surrogateescape")
    decoded = _OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), raw)
    return decoded.decode("utf-8", "surrogateescape")


def parse_mountinfo_line(line: str) -> MountInfo:
    fields = line.split(" ")
    try:
        separator = fields.index("-", 6)
    except ValueError:
        raise ProcParseError(f"no '-' separator in mountinfo line {line[:120]!r}") from None
    if len(fields) < separator + 3:
        raise ProcParseError(f"mountinfo line ends early: {line[:120]!r}")
    try:
        mount_id, parent_id = int(fields[0]), int(fields[1])
    except ValueError:
        raise ProcParseError(f"bad mount id in {line[:120]!r}") from None
    super_options = fields[separator + 3] if len(fields) > separator + 3 else ""
    return MountInfo(
        mount_id=mount_id,
        parent_id=parent_id,
        major_minor=fields[2],
        root=unescape(fields[3]),
        mount_point=unescape(fields[4]),
        mount_options=tuple(fields[5].split(",")),
        fs_type=unescape(fields[separator + 1]),
        source=unescape(fields[separator + 2]),
        super_options=tuple(super_options.split(",")) if super_options else (),
    )


def parse_mountinfo(text: str) -> list[MountInfo]:
    # Only "\n" ends a line: splitlines() would also split on \x0b, \x85, \u2028..., which the
    # kernel does not escape in paths.
    return [parse_mountinfo_line(line) for line in text.split("\n") if line.strip(" ")]


def read_mountinfo(proc_root: Path) -> list[MountInfo]:
    return parse_mountinfo((proc_root / "self" / "mountinfo").read_text(errors="surrogateescape"))


# -- small files ------------------------------------------------------------------------------


def read_boot_id(proc_root: Path) -> str:
    return (proc_root / "sys/kernel/random/boot_id").read_text().strip()


# -- who owns a process: its cgroup and user ---------------------------------------------------

# A container id is 64 hex digits in every runtime's cgroup names: docker-<id>.scope,
# cri-containerd-<id>.scope, crio-<id>.scope, libpod-<id>.scope, or a bare <id> directory
# (the cgroupfs driver).
_CONTAINER = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")
# The kubelet names a pod's cgroup pod<uid>; under the systemd driver with `_` for `-`
# (kubepods-burstable-pod<uid>.slice).
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
# Controllers whose v1 hierarchy names the owner best, in order; v2's unified line ("0::")
# comes first when it holds more than the root.
_V1_PREFERENCE = ("name=systemd", "memory", "pids", "cpu,cpuacct", "cpu")


@dataclass(frozen=True, slots=True)
class CgroupOwner:
    """Who a process belongs to, from /proc/<pid>/cgroup; "" where the path does not say."""

    unit: str = ""
    """The innermost systemd unit (`slurmd.service`, `session-4.scope`, `docker-<id>.scope`)."""
    container_id: str = ""
    pod_uid: str = ""
    """The Kubernetes pod's uid, in its API form (with dashes)."""
    path: str = ""


def _cgroup_path(text: str) -> str:
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths.setdefault("", path)
        for controller in controllers.split(","):
            paths.setdefault(controller, path)
        paths.setdefault(controllers, path)
    unified = paths.get("", "/")
    if unified != "/":
        return unified
    for controller in _V1_PREFERENCE:
        if paths.get(controller, "/") != "/":
            return paths[controller]
    return next((p for p in paths.values() if p != "/"), "")


def parse_cgroup(text: str) -> CgroupOwner:
    """The owner a /proc/<pid>/cgroup file names (cgroup v1 or v2); lines it cannot read are
    skipped, and an empty owner is a process in the root cgroup (or a file from elsewhere)."""
    path = _cgroup_path(text)
    if not path:
        return CgroupOwner()
    components = [c for c in path.split("/") if c]
    unit = next((c for c in reversed(components) if c.endswith((".service", ".scope"))), "")
    container = next((m.group(1) for c in reversed(components) if (m := _CONTAINER.search(c))), "")
    pod = next((m.group(1) for c in components if (m := _POD.search(c))), "")
    return CgroupOwner(unit, container, pod.replace("_", "-"), path)


@dataclass(frozen=True, slots=True)
class ProcessOwner:
    pid: int
    name: str
    """/proc/<pid>/comm: at most 15 characters, as the kernel keeps it."""
    user: str
    """The user name of the process's real owner, or its uid where no name is known."""
    cgroup: CgroupOwner


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_owner(proc_root: Path, pid: int) -> ProcessOwner | None:
    """Name, user and cgroup of a process; None when it is gone. Reads only files that never
    wait on the process's memory map (comm, cgroup, the directory's owner), unlike cmdline or
    environ, which block while the process is stuck in D state holding its mmap lock."""
    base = f"{proc_root}/{pid}"
    try:
        uid = os.stat(base).st_uid
    except OSError:
        return None
    comm = _read_small(f"{base}/comm")
    cgroup = _read_small(f"{base}/cgroup", 65536)  # v1 kubepods paths on 13 controllers
    if comm is None or cgroup is None:
        return None
    return ProcessOwner(
        pid,
        comm.decode(errors="replace").strip(),
        _user(uid),
        parse_cgroup(cgroup.decode(errors="replace")),
    )


# -- /proc/[pid]/fd ---------------------------------------------------------------------------


def open_files(proc_root: Path, pid: int | str, prefix: str) -> list[str]:
    """What the process's open descriptors point at, those whose target starts with `prefix`
    (each once, sorted). A descriptor closed between listing and reading is left out."""
    fd_dir = proc_root / str(pid) / "fd"
    found: set[str] = set()
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith(prefix):
            found.add(target)
    return sorted(found)
