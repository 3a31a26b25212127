"""The kernel log of the current boot, for `check` (its findings, judged) and `diag` (the
findings and the raw NVIDIA and I/O lines).

The reading and the matching are the kernel_log collector's own plain parts: `KmsgReader` (or
`FileLogReader` for a file of saved lines) on an in-memory cursor, so the whole ring buffer of
this boot is read once and the daemon's cursor is never moved, and `MatcherSet` for the
findings (user-space lines written into /dev/kmsg are not trusted, as in the daemon).

A GPU finding whose /dev/kmsg record was logged while the running agent had the GPUs paused
(`gpuwarden pause`: what a GPU reset or MIG change logs) is listed and not judged: a Slurm
health check run after a planned reset must not drain the node for it (docs/pause.md).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.contracts.collector import CollectorSettings, MemoryKeyValueStore
from agent.contracts.model import clears_kind
from agent.contracts.pause import PauseHistory, PauseWindow
from agent.program.diagnose.findings import Finding, Status
from collectors._xid_catalog import CatalogError, catalog
from collectors.kernel_log.collector import KernelLogSettings
from collectors.kernel_log.kmsg import (
    FileLogReader,
    KernelLogError,
    KmsgIO,
    KmsgReader,
    LogReader,
    is_character_device,
)
from collectors.kernel_log.matchers import Finding as LogFinding
from collectors.kernel_log.matchers import MatcherSet, about_gpu
from collectors.kernel_log.parse import LogRecord

AREA = "kernel"
# Raw lines worth a support engineer's eyes even when no matcher calls them a finding: the
# NVIDIA driver's, NVSwitch's and the storage stack's.
RAW_LINE = re.compile(
    r"NVRM|nvidia|nvswitch|NVLink|\bXid\b|\bSXid\b|GPU has fallen|I/O error|EXT4-fs|XFS \(|"
    r"\bnvme\d|blk_update_request|Out of memory|Killed process|blocked for more than|"
    r"\bmce:|Machine Check|PCIe Bus Error|AER:|Hardware Error|Kernel panic|Oops|BUG:|"
    r"soft lockup|hard LOCKUP|md/raid|read-only|readonly|oom-kill:|no available path|"
    r"beyond end of device",
    re.IGNORECASE,
)
MAX_RAW_LINES = 20_000


@dataclass
class KernelLogScan:
    source: str
    records_read: int = 0
    raw: list[LogRecord] = field(default_factory=list)
    """The records worth a support engineer's eyes (RAW_LINE, or a finding's), in log order,
    the latest MAX_RAW_LINES: not every record, so a saved log of any size fits in memory."""
    findings: list[LogFinding] = field(default_factory=list)
    paused: list[tuple[LogFinding, PauseWindow]] = field(default_factory=list)
    """GPU findings logged while the running agent had the GPUs paused, with that pause: not
    judged (a reset logs them)."""
    ignored: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    malformed: int = 0
    error: str = ""

    def raw_lines(self) -> list[str]:
        """The matching records as `[seconds.micro] message` lines (at most MAX_RAW_LINES,
        the latest kept)."""
        return [format_record(r) for r in self.raw][-MAX_RAW_LINES:]

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "records_read": self.records_read,
            "records_lost": self.lost,
            "records_malformed": self.malformed,
            "error": self.error,
            "ignored_user_space_findings": self.ignored,
            "xid_catalog": xid_catalog_info(),
            "findings": [f.to_dict() for f in self.findings],
            "findings_during_pause": [
                {**f.to_dict(), "pause_since_ts": round(w.since, 3), "pause_reason": w.reason}
                for f, w in self.paused
            ],
        }


def xid_catalog_info() -> dict[str, Any]:
    """The catalog that judged the findings (version, sources), or why it could not be read."""
    try:
        return catalog().info()
    except CatalogError as exc:
        return {"version": "", "error": str(exc)}


def xid_catalog_line() -> str:
    try:
        return f"kernel log judged with the {catalog().describe()}"
    except CatalogError as exc:
        return f"kernel log: the Xid catalog cannot be read: {exc}"


def format_record(record: LogRecord) -> str:
    # A line written into /dev/kmsg from user space says so: it is not the driver's word.
    message = (
        record.message
        if record.from_kernel
        else (f"{record.message}  <written from user space, facility {record.facility}>")
    )
    if record.monotonic_usec is not None:
        return f"[{record.monotonic_usec // 1_000_000:>6}.{record.monotonic_usec % 1_000_000:06d}] {message}"
    if record.timestamp:
        return f"[{record.timestamp}] {message}"
    return message


def scan_kernel_log(
    settings: CollectorSettings | None,
    io: KmsgIO | None = None,
    pauses: PauseHistory | None = None,
) -> KernelLogScan:
    """Read the configured kernel log once (this boot's ring buffer, or the saved file).
    `io`: a stand-in for /dev/kmsg (tests), as the collector takes one. `pauses`: the running
    agent's; a GPU finding of /dev/kmsg logged in one goes to `paused` (a saved file's lines
    carry no reliable time: they are all judged)."""
    chosen = settings if isinstance(settings, KernelLogSettings) else KernelLogSettings()
    path = chosen.path
    scan = KernelLogScan(str(path))
    store = MemoryKeyValueStore()  # a fresh cursor: from the start of the buffer, never saved
    try:
        reader: LogReader = (
            KmsgReader(path, chosen.boot_id_path, store, io=io)
            if io is not None or is_character_device(path)
            else FileLogReader(path, store)
        )
        raw: deque[LogRecord] = deque(maxlen=MAX_RAW_LINES)
        matchers = MatcherSet()
        try:
            scan.findings = list(matchers.scan(_records(reader, scan, raw)))
            if pauses is not None and isinstance(reader, KmsgReader):
                _set_paused_apart(scan, reader, pauses)
        finally:
            reader.close()
    except (KernelLogError, OSError) as exc:
        scan.error = str(exc)
        return scan
    scan.ignored = dict(matchers.ignored)
    scan.raw = _with_finding_records(raw, scan.findings)
    return scan


def _set_paused_apart(scan: KernelLogScan, reader: KmsgReader, pauses: PauseHistory) -> None:
    judged: list[LogFinding] = []
    for finding in scan.findings:
        window = pauses.covering(reader.record_time(finding.record))
        if window is not None and about_gpu(finding):
            scan.paused.append((finding, window))
        else:
            judged.append(finding)
    scan.findings = judged


def _records(reader: LogReader, scan: KernelLogScan, raw: deque[LogRecord]) -> Iterator[LogRecord]:
    """Every record to the end, in the reader's bounded batches (each committed to the
    in-memory cursor so the next read moves on), counted in `scan`; the ones worth showing
    kept in `raw` as they pass."""
    while True:
        batch = reader.read()
        reader.commit(batch)
        scan.lost += batch.lost
        scan.malformed += batch.malformed
        scan.records_read += len(batch.records)
        for record in batch.records:
            if RAW_LINE.search(record.message):
                raw.append(record)
            yield record
        if not batch.more:
            return


def _with_finding_records(raw: deque[LogRecord], findings: Sequence[LogFinding]) -> list[LogRecord]:
    """`raw` and every finding's own record, in log order."""
    kept = {id(r) for r in raw}
    extra = {id(f.record): f.record for f in findings if id(f.record) not in kept}
    return sorted([*raw, *extra.values()], key=lambda r: r.line)


def _group_key(finding: LogFinding) -> tuple[str, int | None, str]:
    return (finding.kind, finding.code, finding.pci_bus_id or finding.device or finding.process)


def classify_kernel_log(scan: KernelLogScan) -> list[Finding]:
    if scan.error:
        return [
            Finding(
                AREA,
                "kernel log",
                Status.WARN,
                f"cannot read it: {scan.error}",
                "run check as root (or with CAP_SYSLOG) to see Xids and I/O errors",
            )
        ]
    groups: dict[tuple[str, int | None, str], list[LogFinding]] = {}
    for finding in scan.findings:
        groups.setdefault(_group_key(finding), []).append(finding)
    paused = _paused_lines(scan.paused)
    if not groups:
        note = ""
        if scan.ignored:
            note = f"; {sum(scan.ignored.values())} look-alike line(s) from user space ignored"
        if scan.paused:
            note += f"; {len(scan.paused)} GPU finding(s) logged while the GPUs were paused"
        return [
            Finding(
                AREA,
                "kernel log",
                Status.OK,
                f"no Xid, lost GPU, disk, RAID, file-system, OOM, crash or hardware-error "
                f"findings in {scan.records_read} "
                f"records of {scan.source}{note}",
            )
        ]
    return [_group_line(key, found) for key, found in groups.items()] + paused


def _paused_lines(paused: Sequence[tuple[LogFinding, PauseWindow]]) -> list[Finding]:
    """One SKIP line per GPU and code of the findings a pause logged: listed, not judged."""
    groups: dict[tuple[str, int | None, str], list[tuple[LogFinding, PauseWindow]]] = {}
    for finding, window in paused:
        groups.setdefault(_group_key(finding), []).append((finding, window))
    lines = []
    for (kind, code, where), found in groups.items():
        first, window = found[0]
        what = f"Xid {code}" if kind == "xid" else f"SXid {code}" if kind == "sxid" else kind
        times = f" ({len(found)} times)" if len(found) > 1 else ""
        why = f" ({window.reason})" if window.reason else ""
        lines.append(
            Finding(
                AREA,
                f"{what.replace('_', ' ')} {where}".strip(),
                Status.SKIP,
                f"not judged: logged while the GPUs were paused{why}, as a GPU reset or MIG "
                f"change logs it{times}. First: {format_record(first.record)[:200]}",
                "nothing for the pause's own lines; a GPU that did not come back shows in "
                "the gpu lines after gpuwarden resume",
                check=kind,
                subject=where,
                data={"count": len(found), **({"code": code} if code is not None else {})},
            )
        )
    return lines


def _ends(finding: LogFinding, kind: str) -> bool:
    """An all-clear of `kind` (`nfs: server ... OK` for network_storage)."""
    return clears_kind(finding.clears, kind)


def _group_line(key: tuple[str, int | None, str], found: Sequence[LogFinding]) -> Finding:
    """One line per kind, code and subject, judged by what the log says now: the findings
    after the last all-clear of the kind (all of them when there is none)."""
    kind, code, where = key
    ended = max((i for i, f in enumerate(found) if _ends(f, kind)), default=None)
    if ended is not None and ended == len(found) - 1:
        return _ended_line(key, found)
    current = found if ended is None else found[ended + 1 :]
    first = current[0]
    worst = max(f.severity for f in current)
    what = (
        f"Xid {code}"
        if kind == "xid"
        else f"SXid {code}"
        if kind == "sxid"
        else kind.replace("_", " ")
    )
    name = f"{what} {where}".strip()
    times = f" ({len(found)} times)" if len(found) > 1 else ""
    label = f"{first.name}: " if first.name else ""
    detail = f"{label}{first.meaning}{times}. First: {format_record(first.record)[:200]}"
    repair = max(current, key=lambda f: f.severity).repair_action
    data: dict[str, int] = {"count": len(found)}
    if code is not None:
        data["code"] = code
    return Finding(
        AREA,
        name,
        Status.from_severity(worst),
        detail,
        first.action,
        repair,
        check=kind,
        subject=where,
        data=data,
    )


def _ended_line(key: tuple[str, int | None, str], found: Sequence[LogFinding]) -> Finding:
    """The last word of the log on it is its all-clear: history, not a fault of the host now."""
    kind, code, where = key
    end = found[-1]
    faults = [f for f in found if not _ends(f, kind)]
    was = f"{faults[0].name or kind.replace('_', ' ')} ({len(faults)} times), " if faults else ""
    detail = f"{was}ended: {end.name}. Last: {format_record(end.record)[:200]}"
    data: dict[str, int] = {"count": len(found)}
    if code is not None:
        data["code"] = code
    return Finding(
        AREA,
        f"{kind.replace('_', ' ')} {where}".strip(),
        Status.OK,
        detail,
        check=kind,
        subject=where,
        data=data,
    )
