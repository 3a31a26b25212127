"""Findings in kernel-log records: one reader feeds several matchers, each record in order.

A matcher sees every record (`feed`), may keep state across records for messages the kernel
writes over several lines, and yields `Finding`s. `flush` ends a stream (a file's end).
`MatcherSet` runs them all and drops what user space wrote into the kernel log (facility >= 1),
counting it instead.

Message formats are the kernel's and the NVIDIA driver's (printk strings in drivers/nvme,
block/, fs/ext4, fs/xfs, mm/oom_kill.c, kernel/hung_task.c, and NVRM); the regular expressions
accept the variations seen across kernel versions, noted where they matter.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from agent.contracts.model import AttributeValue, Severity
from collectors._xid import normalize_pci_bus_id
from collectors._xid_catalog import lookup, lookup_event, lookup_sxid
from collectors.kernel_log.parse import LogRecord

KINDS: Final = (
    "xid",
    "sxid",
    "gpu_fallen_off_bus",
    "io_error",
    "fs_error",
    "nvme_error",
    "oom_kill",
    "hung_task",
)
GPU_KINDS: Final = frozenset({"xid", "sxid", "gpu_fallen_off_bus"})


@dataclass(frozen=True, slots=True)
class Finding:
    """Something in the log a person should know about, with what it means and what to do."""

    kind: str
    severity: Severity
    meaning: str
    action: str
    record: LogRecord
    pci_bus_id: str = ""
    """Normalised (`0000:3b:00.0`), or empty when the line names none or names it badly."""
    device: str = ""
    process: str = ""
    pid: int | None = None
    code: int | None = None
    """The Xid or SXid code."""
    name: str = ""
    attributes: dict[str, AttributeValue] = field(default_factory=dict)

    @property
    def line(self) -> int:
        return self.record.line

    @property
    def subject(self) -> str:
        return self.pci_bus_id or self.device or (str(self.pid) if self.pid else "") or self.kind

    def to_dict(self) -> dict[str, AttributeValue]:
        out: dict[str, AttributeValue] = {
            "kind": self.kind,
            "severity": self.severity.label,
            "meaning": self.meaning,
            "action": self.action,
            "line": self.line,
            "message": self.record.message,
        }
        if self.kind in ("xid", "sxid"):
            out["xid"] = self.code
            out["name"] = self.name
        for key, value in (
            ("pci_bus_id", self.pci_bus_id),
            ("device", self.device),
            ("process", self.process),
        ):
            if value:
                out[key] = value
        if self.pid is not None:
            out["pid"] = self.pid
        if self.record.timestamp:
            out["timestamp"] = self.record.timestamp
        out.update(self.attributes)
        return out


class Matcher(Protocol):
    def feed(self, record: LogRecord) -> Iterable[Finding]: ...

    def flush(self) -> Iterable[Finding]: ...


def _pci(text: str | None) -> str:
    if not text:
        return ""
    try:
        return normalize_pci_bus_id(text)
    except ValueError:
        return ""


# NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.
# The `PCI:` prefix is missing on some drivers, the function number never appears, and the text
# after the code (pid/name/description) varies by Xid and driver version.
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): (?P<code>\d{1,6})\b,?\s*(?P<text>.*)$",
    re.DOTALL,
)
_PID = re.compile(r"\bpid=(?P<pid>\d+)")
_NAME = re.compile(r"\bname=(?P<name>[^,]*)")


class XidMatcher:
    """NVRM Xid lines: code, GPU, the process the driver blamed, the catalog's meaning."""

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        match = _XID.search(record.message)
        if match is None:
            return
        code = int(match["code"])
        text = match["text"].strip()
        # The driver's own words on the line (NVLink5 Fatal/Nonfatal, Xid 154's new recovery
        # action) decide this event's severity where the catalog says they do.
        info = lookup_event(code, text)
        pid_match, name_match = _PID.search(text), _NAME.search(text)
        process = name_match["name"].strip() if name_match else ""
        yield Finding(
            kind="xid",
            severity=info.severity,
            meaning=info.meaning,
            action=info.action,
            record=record,
            pci_bus_id=_pci(match["pci"]),
            code=code,
            name=info.name,
            pid=int(pid_match["pid"]) if pid_match else None,
            process="" if process in ("", "<unknown>") else process,
            attributes={
                "fault": info.fault,
                "known": info.known,
                "text": text,
                **info.attributes(),
            },
        )

    def flush(self) -> Iterator[Finding]:
        return iter(())


# nvidia-nvswitch3: SXid (PCI:0000:c7:00.0): 20034, Fatal, Link 44 LTSSM Fault Up
_SXID = re.compile(
    r"(?P<dev>nvidia-nvswitch\d+): SXid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): "
    r"(?P<code>\d{1,6})\b,?\s*(?P<text>.*)$",
    re.DOTALL,
)


class SxidMatcher:
    """NVSwitch SXid lines: switch device, its PCI address, code, fatal or not."""

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        match = _SXID.search(record.message)
        if match is None:
            return
        code = int(match["code"])
        info = lookup_sxid(code, match["text"])
        yield Finding(
            kind="sxid",
            severity=info.severity,
            meaning=info.meaning,
            action=info.action,
            record=record,
            pci_bus_id=_pci(match["pci"]),
            device=match["dev"],
            code=code,
            name=info.name,
            attributes={
                "fault": info.fault,
                "known": info.known,
                "text": match["text"].strip(),
                **info.attributes(),
            },
        )

    def flush(self) -> Iterator[Finding]:
        return iter(())


# The driver's three-line form, with no Xid line:
#   NVRM: The NVIDIA GPU 0000:18:00.0
#   NVRM: (PCI ID: 10de:2901) installed in this system has
#   NVRM: fallen off the bus and is not responding to commands.
# and the one-line form `NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.`
_BUS_FIRST = re.compile(r"NVRM: The NVIDIA GPU (?P<pci>[0-9a-fA-F:.]+)\s*$")
_BUS_SECOND = re.compile(
    r"NVRM: \(PCI ID: (?P<id>[0-9a-fA-F]{4}:[0-9a-fA-F]{4})\) installed in this system has"
)
_BUS_THIRD = re.compile(r"NVRM: fallen off the bus and is not responding to commands")
_BUS_ONE_LINE = re.compile(
    r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>[0-9a-fA-F:.]+): GPU has fallen off the bus"
)
_XID79 = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): 79\b")

# How many records after an `Xid 79` line a fallen-off-bus line for the same GPU is taken as
# the same incident (the driver writes them next to each other) and not reported twice.
XID79_NEARBY_RECORDS: Final = 50
_BUS_MEANING = "the GPU stopped answering on PCIe and is no longer reachable (fallen off the bus)"
_BUS_ACTION = lookup(79).action


class FallenOffBusMatcher:
    """GPU fallen off the bus without an Xid line: the driver's three-line and one-line forms."""

    def __init__(self) -> None:
        self._first: tuple[LogRecord, str] | None = None
        self._pci_id = ""
        self._recent_xid79: deque[tuple[int, str]] = deque(maxlen=64)
        self._count = 0

    def _finding(self, record: LogRecord, pci: str, form: str) -> Iterator[Finding]:
        if any(self._count - n <= XID79_NEARBY_RECORDS and p == pci for n, p in self._recent_xid79):
            return  # already reported as Xid 79
        attributes: dict[str, AttributeValue] = {"form": form}
        if self._pci_id:
            attributes["pci_device_id"] = self._pci_id
        yield Finding(
            kind="gpu_fallen_off_bus",
            severity=Severity.CRITICAL,
            meaning=_BUS_MEANING,
            action=_BUS_ACTION,
            record=record,
            pci_bus_id=pci,
            attributes=attributes,
        )

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        self._count += 1
        message = record.message
        if (xid79 := _XID79.search(message)) is not None:
            self._recent_xid79.append((self._count, _pci(xid79["pci"])))
        elif (one := _BUS_ONE_LINE.search(message)) is not None:
            yield from self._finding(record, _pci(one["pci"]), "one line")
        elif (first := _BUS_FIRST.search(message)) is not None:
            self._first, self._pci_id = (record, _pci(first["pci"])), ""
        elif self._first is not None and (second := _BUS_SECOND.search(message)) is not None:
            self._pci_id = second["id"].lower()
        elif self._first is not None and _BUS_THIRD.search(message):
            first_record, pci = self._first
            self._first = None
            yield from self._finding(first_record, pci, "three lines")
        elif self._first is not None and "NVRM:" not in message:
            self._first = None  # another driver's line broke the sequence

    def flush(self) -> Iterator[Finding]:
        self._first = None
        return iter(())


@dataclass(frozen=True)
class _Rule:
    kind: str
    pattern: re.Pattern[str]
    severity: Severity
    meaning: str
    action: str


# {device}, {process}, {pid}, {seconds} in meaning/action are filled from the match.
_HOST_RULES: Final[Sequence[_Rule]] = (
    # block/blk-core.c: `I/O error, dev sda, sector 2048 op 0x1:(WRITE) ...` (prefixed by
    # `blk_update_request: ` before 5.16) and fs/buffer.c: `Buffer I/O error on dev sda1, ...`
    _Rule(
        "io_error",
        re.compile(r"(?:Buffer )?I/O error,? (?:on )?dev(?:ice)? (?P<device>[\w.:-]+),"),
        Severity.CRITICAL,
        "the block device {device} returned an I/O error",
        "check {device}'s health (smartctl -a, nvme smart-log) and the kernel log around "
        "this line; plan to replace the disk if errors repeat",
    ),
    # fs/ext4/super.c: `EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: ...`
    _Rule(
        "fs_error",
        re.compile(r"EXT4-fs (?:error|critical error) \(device (?P<device>[\w.:-]+)\)"),
        Severity.CRITICAL,
        "the ext4 file system on {device} found an error (corruption or failed I/O)",
        "unmount {device} and run e2fsck at the next chance; check the disk",
    ),
    _Rule(
        "fs_error",
        re.compile(
            r"EXT4-fs \((?P<device>[\w.:-]+)\): (?:Remounting filesystem read-only|"
            r"I/O error while writing superblock|previous I/O error)"
        ),
        Severity.CRITICAL,
        "the ext4 file system on {device} hit I/O errors or went read-only",
        "check the disk behind {device}; unmount it and run e2fsck",
    ),
    # fs/xfs: `XFS (sdb1): Metadata corruption detected at ...`, `... Shutting down filesystem`,
    # `XFS (dm-0): log I/O error -5`, `XFS (md0): metadata I/O error in "..." at daddr ...`
    _Rule(
        "fs_error",
        re.compile(
            r"XFS \((?P<device>[\w.:-]+)\): .*(?:[Cc]orruption|I/O error|"
            r"[Ss]hutting down|shut down)"
        ),
        Severity.CRITICAL,
        "the XFS file system on {device} found corruption, an I/O error or shut down",
        "check the disk behind {device}; unmount it and run xfs_repair",
    ),
    # drivers/nvme/host/pci.c: `nvme nvme0: I/O 123 QID 4 timeout, aborting` / `..., reset
    # controller`, `controller is down; will reset: CSTS=0xffffffff`, `Removing after probe
    # failure status: -19`, `Device not ready; aborting reset`
    _Rule(
        "nvme_error",
        re.compile(
            r"nvme (?P<device>nvme\d+): (?:controller is down|Removing after "
            r"probe failure|Device not ready|Disabling device after reset failure)"
        ),
        Severity.CRITICAL,
        "the NVMe controller {device} went down or was removed",
        "check {device} (nvme smart-log, firmware) and its slot; replace it if it repeats",
    ),
    _Rule(
        "nvme_error",
        re.compile(
            r"nvme (?P<device>nvme\d+): (?:I/O \d+ (?:\(\w+\) )?QID \d+ timeout|"
            r"Abort status|resetting controller|.*reset controller)"
        ),
        Severity.WARNING,
        "the NVMe controller {device} timed out on a command or was reset",
        "check {device} (nvme smart-log, firmware version); repeated timeouts mean a "
        "failing drive or slot",
    ),
    # mm/oom_kill.c: `Out of memory: Killed process 4321 (python3) total-vm:...` (5.x+), the
    # memory-cgroup form `Memory cgroup out of memory: Killed process ...`, and before 5.0 a
    # separate `Killed process 4321 (python3) total-vm:...` line.
    _Rule(
        "oom_kill",
        re.compile(r"Killed process (?P<pid>\d+) \((?P<process>[^)]*)\)"),
        Severity.WARNING,
        "the kernel's OOM killer killed {process} (pid {pid}) to free memory",
        "find out why {process} ran out of memory (its limits, the host's memory); rerun "
        "the job with more memory or a smaller batch",
    ),
    # kernel/hung_task.c: `INFO: task python3:4321 blocked for more than 120 seconds.`
    _Rule(
        "hung_task",
        re.compile(
            r"task (?P<process>.+):(?P<pid>\d+) blocked for more than "
            r"(?P<seconds>\d+) seconds"
        ),
        Severity.WARNING,
        "the task {process} (pid {pid}) was blocked in the kernel for more "
        "than {seconds} s (often waiting on a disk, a network mount or a driver)",
        "look at the stack trace that follows in the log and at the device it waits on",
    ),
)


class HostMatcher:
    """The host kinds: I/O errors, file-system errors, NVMe trouble, OOM kills, hung tasks."""

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        for rule in _HOST_RULES:
            match = rule.pattern.search(record.message)
            if match is None:
                continue
            values = {k: v or "" for k, v in match.groupdict().items()}
            pid = int(values["pid"]) if values.get("pid") else None
            attributes: dict[str, AttributeValue] = {}
            if values.get("seconds"):
                attributes["blocked_seconds"] = int(values["seconds"])
            yield Finding(
                kind=rule.kind,
                severity=rule.severity,
                record=record,
                meaning=rule.meaning.format_map(_Blank(values)),
                action=rule.action.format_map(_Blank(values)),
                device=values.get("device", ""),
                process=values.get("process", ""),
                pid=pid,
                attributes=attributes,
            )
            return  # one finding per line: the first rule that matches wins

    def flush(self) -> Iterator[Finding]:
        return iter(())


class _Blank(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "?"


def default_matchers() -> list[Matcher]:
    return [XidMatcher(), SxidMatcher(), FallenOffBusMatcher(), HostMatcher()]


class MatcherSet:
    """Feeds each record to every matcher, in order; keeps user-space records out.

    Records from user space (facility >= 1 in a raw /dev/kmsg record or `dmesg --decode`, a
    journal line not from `kernel:`) go to a second, separate set of matchers, so a forged
    line can neither raise a finding nor complete a multi-line one; what that set finds is
    counted in `ignored` (by kind) instead.
    """

    def __init__(self, matchers: Sequence[Matcher] | None = None) -> None:
        self.matchers = list(matchers) if matchers is not None else default_matchers()
        self._untrusted = default_matchers()
        self.ignored: Counter[str] = Counter()

    def feed(self, record: LogRecord) -> list[Finding]:
        if not record.from_kernel:
            for matcher in self._untrusted:
                for finding in matcher.feed(record):
                    self.ignored[finding.kind] += 1
            return []
        return [f for m in self.matchers for f in m.feed(record)]

    def flush(self) -> list[Finding]:
        for matcher in self._untrusted:
            for finding in matcher.flush():
                self.ignored[finding.kind] += 1
        return [f for m in self.matchers for f in m.flush()]

    def scan(self, records: Iterable[LogRecord]) -> Iterator[Finding]:
        for record in records:
            yield from self.feed(record)
        yield from self.flush()
