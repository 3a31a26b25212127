"""Judge the host collectors' rounds for `check`: file-system space and inodes (disk), processes
in D state and zombies (processes). Thresholds and their hysteresis are the disk collector's own
(its `gpuwarden_filesystem_threshold_level`); nothing is re-decided here."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from agent.contracts.model import Severity
from agent.program.diagnose.collect_once import CollectorResult
from agent.program.diagnose.findings import Finding, Status
from collectors import processes

LEVEL_STATUS = {0: Status.OK, 1: Status.WARN, 2: Status.FAIL}


def _events(result: CollectorResult, folded: set[str]) -> list[Finding]:
    return [
        Finding(
            result.name,
            e.subject or e.kind,
            Status.from_severity(e.severity),
            e.message,
            e.action,
            e.repair_action,
            check=e.kind,
            subject=e.subject,
        )
        for e in result.events
        if e.severity >= Severity.WARNING and e.kind not in folded
    ]


def classify_disk(result: CollectorResult) -> list[Finding]:
    if result.error:
        return [
            Finding(
                "host",
                "disks",
                Status.WARN,
                f"one round of the disk collector failed: {result.error}",
            )
        ]
    mounts: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for sample in result.samples:
        labels = sample.labels
        if "mountpoint" not in labels:
            continue
        key = (labels["mountpoint"], labels.get("device", ""), labels.get("fstype", ""))
        name = sample.family.name.removeprefix("gpuwarden_")
        if "resource" in labels:
            name = f"{name}:{labels['resource']}"
        mounts[key][name] = sample.value
    findings: list[Finding] = []
    levelled: set[str] = set()
    for (mountpoint, device, fstype), values in sorted(mounts.items()):
        line = _mount_line(mountpoint, device, fstype, values)
        findings.append(dataclasses.replace(line, check="disk", subject=mountpoint))
        levelled.add(mountpoint)
    folded = {"filesystem_space_low", "filesystem_inodes_low"}
    findings.extend(
        f for f in _events(result, folded) if f.subject not in levelled or f.status is Status.FAIL
    )
    if not mounts and not findings:
        findings.append(
            Finding("host", "disks", Status.NA, "no file system watched (all excluded)")
        )
    return findings


def _mount_line(mountpoint: str, device: str, fstype: str, values: dict[str, float]) -> Finding:
    name = f"disk {mountpoint}"
    if values.get("mount_stuck") == 1:
        return Finding(
            "host",
            name,
            Status.FAIL,
            f"statvfs does not answer ({fstype} from {device})",
            f"check the server or device behind {device}; processes touching it hang",
        )
    if values.get("filesystem_error") == 1:
        return Finding(
            "host",
            name,
            Status.WARN,
            f"statvfs failed ({fstype} from {device})",
            f"check that {mountpoint} is readable and its device healthy",
        )
    size, available = values.get("filesystem_size_bytes"), values.get("filesystem_available_bytes")
    free = values.get("filesystem_free_bytes")
    parts = []
    if size and available is not None and free is not None:
        used = size - free
        percent = 100.0 * used / (used + available) if used + available > 0 else 0.0
        parts.append(
            f"{percent:.0f}% used, {available / 2**30:.1f} GiB available of {size / 2**30:.1f} GiB"
        )
    inodes, inodes_free = values.get("filesystem_inodes"), values.get("filesystem_inodes_free")
    if inodes and inodes_free is not None:
        parts.append(f"inodes {100.0 * (inodes - inodes_free) / inodes:.0f}% used")
    else:
        parts.append("inodes: no fixed count")
    if values.get("filesystem_readonly") == 1:
        parts.append("read-only")
    level = max(
        int(values.get("filesystem_threshold_level:space", 0)),
        int(values.get("filesystem_threshold_level:inodes", 0)),
    )
    status = LEVEL_STATUS.get(level, Status.FAIL)
    action = (
        ""
        if status is Status.OK
        else (
            f"free space on {mountpoint} (old checkpoints, caches, core dumps: du -xsh {mountpoint}/* | sort -h)"
        )
    )
    return Finding("host", name, status, f"{', '.join(parts)} ({fstype})", action)


def classify_processes(result: CollectorResult, observed_seconds: float) -> list[Finding]:
    """`observed_seconds`: how long apart the two rounds were; a process in D state in both
    has been there at least that long (short D sleeps for disk I/O are normal)."""
    if result.error:
        return [
            Finding(
                "host",
                "processes",
                Status.WARN,
                f"one round of the processes collector failed: {result.error}",
            )
        ]
    states = {s.labels["state"]: s.value for s in result.values(processes.PROCESSES.name)}
    stuck = [s for s in result.values(processes.D_STATE.name) if s.value >= observed_seconds > 0]
    findings = []
    if stuck:
        listed = ", ".join(
            f"{s.labels['comm']} (pid {s.labels['pid']}{', in ' + s.labels['wchan'] if s.labels['wchan'] else ''})"
            for s in stuck[:5]
        )
        findings.append(
            Finding(
                "host",
                "D-state processes",
                Status.WARN,
                f"{len(stuck)} process(es) in uninterruptible sleep for {observed_seconds:.0f} s or more: {listed}",
                "find what they wait on (cat /proc/PID/stack as root): a disk, a network mount or the GPU driver",
            )
        )
    else:
        findings.append(
            Finding(
                "host",
                "D-state processes",
                Status.OK,
                f"none stuck ({states.get('disk_sleep', 0):.0f} in D state at the last look)",
            )
        )
    zombies = states.get("zombie", 0)
    parents = sorted(result.values(processes.ZOMBIES.name), key=lambda s: -s.value)
    zombie_events = [e for e in result.events if e.kind == "zombies_accumulating"]
    if zombie_events:
        worst = zombie_events[0]
        findings.append(
            Finding(
                "host",
                "zombie processes",
                Status.WARN,
                "; ".join(e.message for e in zombie_events),
                worst.action,
                worst.repair_action,
            )
        )
    else:
        top = (
            f" (most under {parents[0].labels['parent'] or '?'}, pid {parents[0].labels['ppid']})"
            if parents
            else ""
        )
        findings.append(Finding("host", "zombie processes", Status.OK, f"{zombies:.0f}{top}"))
    findings.extend(_events(result, {"zombies_accumulating", "process_stuck_d_state"}))
    return findings
