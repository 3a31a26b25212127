"""Findings in kernel-log records: one reader feeds several matchers, each record in order.

A matcher sees the records that hold one of its trigger words (`feed`), may hold a finding open
for the lines a message continues on (collectors/kernel_log/finding.py), and yields `Finding`s.
`settle` hands on what is held when the reader has nothing more for now; `flush` ends a stream.
`MatcherSet` runs them all and drops what user space wrote into the kernel log (facility >= 1),
counting it instead. The GPU matchers are here; the host ones (disks, file systems, memory,
CPUs, crashes) in collectors/kernel_log/host.py.

Message formats are the NVIDIA driver's (open-gpu-kernel-modules: kernel_rc.c for Xids,
common_nvswitch.h and error_nvswitch.c for SXids, osapi.c and osinit.c for a GPU fallen off
the bus) and the kernel's; the regular expressions accept the variations seen across versions,
noted where they matter.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from agent.contracts.model import AttributeValue, RepairAction, Severity
from collectors._repair import clears_for, repair_for
from collectors._xid_catalog import lookup, lookup_event, lookup_sxid
from collectors.kernel_log.finding import (
    Assembling,
    Finding,
    Matcher,
    OpenRecords,
    Position,
    Ready,
    TriggerIndex,
    arrival,
    distance,
    pci_or_empty,
    position,
    trigger_search,
)
from collectors.kernel_log.host import HOST_KINDS, HostMatcher, host_matchers
from collectors.kernel_log.journal import LINE_WORDS as JOURNAL_LINE_WORDS
from collectors.kernel_log.parse import TERMINAL_ESCAPE, LogRecord
from collectors.kernel_log.pcie import PCIE_KINDS, AerMatcher, GpuInitMatcher

__all__ = [
    "GPU_KINDS",
    "KINDS",
    "PAUSABLE_KINDS",
    "AerMatcher",
    "FallenOffBusMatcher",
    "Finding",
    "GpuInitMatcher",
    "GpuLostLedger",
    "HostMatcher",
    "Matcher",
    "MatcherSet",
    "SxidMatcher",
    "XidMatcher",
    "about_gpu",
    "default_matchers",
]

GPU_KINDS: Final = frozenset({"xid", "sxid", "gpu_fallen_off_bus", "gpu_init_failed"})
KINDS: Final = ("xid", "sxid", "gpu_fallen_off_bus", *PCIE_KINDS, *HOST_KINDS)
PAUSABLE_KINDS: Final = GPU_KINDS | {"pcie_error"}
"""Kinds a finding of which can be about a GPU (`about_gpu`)."""


def about_gpu(finding: Finding) -> bool:
    """A finding about a GPU or an NVSwitch: judged by the GPUs' pauses and described as the
    GPU's. A PCIe error is one when its device is a GPU (it then names the GPU's address)."""
    return finding.kind in GPU_KINDS or (finding.kind == "pcie_error" and bool(finding.pci_bus_id))


# NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.
# An Xid the driver attributes to a MIG instance names it after the address (kernel_rc.c,
# XID_PRINT_WITH_ATTR): `(PCI:0000:3b:00 GPU-I:05)` or `(PCI:0000:3b:00 GPU-I:05 GPU-CI:01)`.
# The `PCI:` prefix is missing on some drivers, the function number never appears, and the text
# after the code (pid/name/description) varies by Xid and driver version.
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?"
    r"\): (?P<code>\d{1,6})\b,?\s*(?P<text>.*)$",
    re.DOTALL,
)
_PID = re.compile(r"\bpid=(?P<pid>\d+)")
# `pid=%s, name=%s, %s` (kernel_rc.c): the name is a task's comm, which may hold spaces,
# parentheses and commas; it ends at the `, ` before the driver's text, or, where that text is
# empty (`pMsg` NULL or ""), at the `,` the line ends with once its trailing space is gone.
_NAME = re.compile(r"\bname=(?P<name>[^\n]{0,64}?)(?:, |,?[ \t]*$)", re.MULTILINE)
_XID_TRIGGER: Final = "NVRM: Xid ("


class GpuLostLedger:
    """Shared by one set's Xid and fallen-off-bus matchers: what a fallen-off-the-bus message
    said, while it waits for the Xid 79 older drivers write after it (the Xid is then the one
    finding, and carries these facts)."""

    def __init__(self) -> None:
        self.waiting: dict[str, tuple[Position, dict[str, AttributeValue]]] = {}

    def claim(self, pci_bus_id: str, record: LogRecord) -> dict[str, AttributeValue]:
        """The facts of a block for this GPU near enough to `record` to be its message."""
        waiting = self.waiting.get(pci_bus_id)
        if waiting is None:
            return {}
        at, facts = waiting
        here = position(record)
        known, apart = bool(at.scheme and here.scheme), distance(at, here)
        if known and apart is None:
            return {}  # the other numbering: not this Xid's; it keeps waiting for its own
        del self.waiting[pci_bus_id]
        if known and apart is not None and not 0 <= apart <= XID79_NEARBY_RECORDS:
            return {}  # a block from long before: its own finding (the other matcher's)
        return facts


class XidMatcher:
    """NVRM Xid lines: code, GPU (and MIG instance), the process the driver blamed, the
    catalog's meaning."""

    triggers: Final = (_XID_TRIGGER,)

    def __init__(self, ledger: GpuLostLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else GpuLostLedger()

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
        pci = pci_or_empty(match["pci"])
        attributes: dict[str, AttributeValue] = {
            "fault": info.fault,
            "known": info.known,
            "text": text,
            **info.attributes(),
        }
        for group, key in (("gi", "gpu_instance"), ("ci", "compute_instance")):
            if match[group] is not None:
                attributes[key] = int(match[group])
        if code == 79:
            attributes.update(self.ledger.claim(pci, record))
        yield Finding(
            kind="xid",
            severity=info.severity,
            meaning=info.meaning,
            action=info.action,
            repair_action=repair_for(info),
            clears=clears_for(info),
            record=record,
            pci_bus_id=pci,
            code=code,
            name=info.name,
            pid=int(pid_match["pid"]) if pid_match else None,
            process="" if process in ("", "<unknown>") else process,
            attributes=attributes,
        )

    def settle(self) -> Iterator[Finding]:
        return iter(())

    def flush(self) -> Iterator[Finding]:
        return iter(())


# nvidia-nvswitch3: SXid (PCI:0000:c7:00.0): 20034, Fatal, Link 44 LTSSM Fault Up
# (common_nvswitch.h NVSWITCH_PRINT_SXID: the code is `%05d`), then, from the same call
# (error_nvswitch.c _nvswitch_dump_error_entry), lines with the same prefix and code:
#   ..., Severity 1 Engine instance 44 Sub-engine instance 00
#   ..., Data {0x00000000, ...}        (one or two of these)
# The severity number is NVSWITCH_ERROR_SEVERITY_* (ctrl_dev_nvswitch.h: 0 non-fatal, 1 fatal).
_SXID = re.compile(
    r"(?P<dev>nvidia-nvswitch\d+): SXid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): "
    r"(?P<code>\d{1,6})\b,?\s*(?P<text>.*)$",
    re.DOTALL,
)
_SXID_SEVERITY = re.compile(
    r"^Severity (?P<severity>\d+) Engine instance (?P<engine>\d+) "
    r"Sub-engine instance (?P<sub>\d+)"
)
_SXID_DATA = re.compile(r"^Data \{(?P<data>[^}]*)\}")
# The follow-up lines come from the same function call as their header; other CPUs' lines
# may come between them, not many.
SXID_FOLLOW_UP_REACH: Final = 16


@dataclass
class _Sxid:
    header: Finding
    data: list[str] = field(default_factory=list)

    def finding(self) -> Finding:
        if self.data:
            self.header.attributes["data"] = " | ".join(self.data)
        return self.header

    def add(self, text: str) -> bool:
        """Take a follow-up line's facts; False when `text` is not a follow-up."""
        if (severity := _SXID_SEVERITY.match(text)) is not None:
            self.header.attributes.update(
                nvswitch_severity=int(severity["severity"]),
                engine_instance=int(severity["engine"]),
                subengine_instance=int(severity["sub"]),
            )
            return True
        if (data := _SXID_DATA.match(text)) is not None:
            self.data.append(data["data"])
            return True
        return False


class SxidMatcher(Assembling[_Sxid]):
    """NVSwitch SXid records: switch device, its PCI address, code, fatal or not, and the
    severity, engine instance and data of the lines that follow the header."""

    triggers: Final = ("SXid (",)

    def __init__(self) -> None:
        self._open: OpenRecords[_Sxid] = OpenRecords(SXID_FOLLOW_UP_REACH)
        self._device_key: dict[str, tuple[str, int]] = {}

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        match = _SXID.search(record.message)
        if match is None:
            return
        device, code, text = match["dev"], int(match["code"]), match["text"].strip()
        follow_up = _SXID_SEVERITY.match(text) or _SXID_DATA.match(text)
        key = (device, code)
        if follow_up is not None and self._open.near(key):
            held = self._open.get(key)
            if held is not None:
                held.add(text)
            self._open.extend(key)  # after a settle: absorbed, the record was handed on
            return
        info = lookup_sxid(code, text)
        header = Finding(
            kind="sxid",
            severity=info.severity,
            meaning=info.meaning,
            action=info.action,
            repair_action=repair_for(info),
            record=record,
            pci_bus_id=pci_or_empty(match["pci"]),
            device=device,
            code=code,
            name=info.name,
            attributes={
                "fault": info.fault,
                "known": info.known,
                "text": text,
                **info.attributes(),
            },
        )
        state = _Sxid(header)
        state.add(text)  # a follow-up whose header was lost stands for its record
        # A new header ends the switch's previous record (its follow-ups come right after it).
        previous = self._device_key.get(device)
        if previous is not None and previous != key:
            found = self._open.close(previous)
            if found is not None:
                yield found
        self._device_key[device] = key
        yield from self._open.hold(key, state)

    def flush(self) -> list[Finding]:
        self._device_key.clear()
        return super().flush()


# The driver's three-line form, with no Xid line (osapi.c, one printk with newlines in it):
#   NVRM: The NVIDIA GPU 0000:18:00.0
#   NVRM: (PCI ID: 10de:2901) installed in this system has
#   NVRM: fallen off the bus and is not responding to commands.
# the one-line form `NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.` (osinit.c, after the
# Xid 79 line), and the older drivers' `NVRM: GPU at 0000:02:00.0 has fallen off the bus.`,
# which came before its Xid 79.
_BUS_FIRST = re.compile(r"NVRM: The NVIDIA GPU (?P<pci>[0-9a-fA-F:.]+)\s*$")
_BUS_SECOND = re.compile(
    r"NVRM: \(PCI ID: (?P<id>[0-9a-fA-F]{4}:[0-9a-fA-F]{4})\) installed in this system has"
)
_BUS_THIRD = re.compile(r"NVRM: fallen off the bus and is not responding to commands")
_BUS_ONE_LINE = re.compile(
    r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>[0-9a-fA-F:.]+): GPU has fallen off the bus"
)
_BUS_OLD = re.compile(r"NVRM: GPU at (?:PCI:)?(?P<pci>[0-9a-fA-F:.]+) has fallen off the bus")

# How far (in records) a fallen-off-bus message and the Xid 79 for the same GPU are taken as
# the same incident (the driver writes them next to each other) and reported once.
XID79_NEARBY_RECORDS: Final = 50
_BUS_MEANING = "the GPU stopped answering on PCIe and is no longer reachable (fallen off the bus)"


@dataclass
class _ThreeLines:
    record: LogRecord
    pci: str
    last: Position
    """Position of the part seen last; the next part must be in this record or the next."""
    pci_device_id: str = ""


class FallenOffBusMatcher:
    """GPU fallen off the bus without an Xid line: the driver's three-line, one-line and older
    forms. A form that comes before its Xid 79 waits for it (`GpuLostLedger`): the Xid is then
    the finding (the Xid matcher's); one that comes after a recent Xid 79 is not repeated."""

    triggers: Final = (_XID_TRIGGER, "NVRM: The NVIDIA GPU", "(PCI ID: ", "fallen off the bus")

    def __init__(self, ledger: GpuLostLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else GpuLostLedger()
        self._three: _ThreeLines | None = None
        self._waiting: OpenRecords[Ready] = OpenRecords(XID79_NEARBY_RECORDS)
        self._xid79: OpenRecords[Ready] = OpenRecords(XID79_NEARBY_RECORDS)

    def _finding(self, record: LogRecord, pci: str, form: str, device_id: str) -> Finding:
        attributes: dict[str, AttributeValue] = {"form": form}
        if device_id:
            attributes["pci_device_id"] = device_id
        return Finding(
            kind="gpu_fallen_off_bus",
            severity=Severity.CRITICAL,
            meaning=_BUS_MEANING,
            # Xid 79's action, read when a GPU falls off, not at import: the catalog (about
            # 0.45 MB once read) is resident only in a daemon that has seen an Xid (issue 14).
            action=lookup(79).action,
            repair_action=RepairAction.REBOOT_NODE,
            record=record,
            pci_bus_id=pci,
            name="GPU fallen off the bus",
            attributes=attributes,
        )

    def _found(
        self, record: LogRecord, pci: str, form: str, device_id: str = "", wait: bool = True
    ) -> list[Finding]:
        if self._xid79.near(pci):
            return []  # already reported as Xid 79
        finding = self._finding(record, pci, form, device_id)
        if not wait:
            return [finding]
        self.ledger.waiting[pci] = (
            position(record),
            {
                "fallen_off_bus_form": form,
                "fallen_off_bus_line": record.line,
                **({"pci_device_id": device_id} if device_id else {}),
            },
        )
        return self._waiting.hold(pci, Ready(finding))

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        self._xid79.advance(record)
        for found in self._waiting.advance(record):
            self.ledger.waiting.pop(found.pci_bus_id, None)
            yield found
        # /dev/kmsg keeps a printk with newlines as one record; saved shapes split it.
        for part in record.message.split("\n"):
            yield from self._part(record, part)

    def _part(self, record: LogRecord, message: str) -> list[Finding]:
        if (xid := _XID.search(message)) is not None:
            if xid["code"] == "79":
                pci = pci_or_empty(xid["pci"])
                if self._waiting.get(pci) is not None:  # the Xid 79 is the finding now
                    self._waiting.drop(pci)
                    self.ledger.waiting.pop(pci, None)
                self._xid79.hold(pci, Ready(self._finding(record, pci, "xid", "")))
            return []
        if (one := _BUS_ONE_LINE.search(message)) is not None:
            return self._found(record, pci_or_empty(one["pci"]), "one line", wait=False)
        if (old := _BUS_OLD.search(message)) is not None:
            return self._found(record, pci_or_empty(old["pci"]), "older one line")
        here = position(record)
        if (first := _BUS_FIRST.search(message)) is not None:
            self._three = _ThreeLines(record, pci_or_empty(first["pci"]), here)
            return []
        if self._three is not None and distance(self._three.last, here) is None:
            return []  # the other numbering: says nothing of what came between the parts
        three, self._three = self._three, None
        apart = distance(three.last, here) if three is not None else None
        if three is None or apart is None or not 0 <= apart <= 1:
            return []  # a part without its beginning, or another line came between them
        if (second := _BUS_SECOND.search(message)) is not None:
            three.pci_device_id, three.last = second["id"].lower(), here
            self._three = three
        elif _BUS_THIRD.search(message):
            return self._found(three.record, three.pci, "three lines", three.pci_device_id)
        return []

    def settle(self) -> list[Finding]:
        found = self._waiting.settle()
        for finding in found:
            self.ledger.waiting.pop(finding.pci_bus_id, None)
        return found

    def flush(self) -> list[Finding]:
        found = self.settle()
        self._three = None
        self._waiting.reset()
        self._xid79.reset()
        return found


def default_matchers() -> list[Matcher]:
    # The Xid matcher comes before the fallen-off-bus one: it claims a waiting block's facts
    # from the ledger before the other drops the block on the same Xid 79 line.
    ledger = GpuLostLedger()
    return [
        XidMatcher(ledger),
        SxidMatcher(),
        FallenOffBusMatcher(ledger),
        GpuInitMatcher(),
        AerMatcher(),
        *host_matchers(),
    ]


class MatcherSet:
    """Feeds each record to every matcher, in order; keeps user-space records out.

    Records from user space (facility >= 1 in a raw /dev/kmsg record or `dmesg --decode`, a
    journal line not from `kernel:`) go to a second, separate set of matchers, so a forged
    line can neither raise a finding nor complete a multi-line one; what that set finds is
    counted in `ignored` (by kind) instead.

    A record that holds none of the matchers' trigger words is skipped at the cost of one
    search (`candidate`); `prefilter=False` feeds every record (the reference the prefilter is
    tested against).
    """

    def __init__(
        self, matchers: Sequence[Matcher] | None = None, *, prefilter: bool = True
    ) -> None:
        self.matchers = list(matchers) if matchers is not None else default_matchers()
        self._untrusted = default_matchers()
        self.ignored: Counter[str] = Counter()
        triggers = [t for m in (*self.matchers, *self._untrusted) for t in m.triggers]
        self.triggers: tuple[str, ...] = tuple(dict.fromkeys(triggers))
        self._everything = not prefilter or any(not m.triggers for m in self.matchers)
        # Each matcher is fed only the records that hold one of its own words.
        # Each carries its rank: findings of one record are sorted in the matchers' order.
        self._ranked = list(enumerate(self.matchers))
        self._index = TriggerIndex([((i, m), m.triggers) for i, m in self._ranked])
        self._index_untrusted = TriggerIndex([(m, m.triggers) for m in self._untrusted])
        self._search = trigger_search(self.triggers)
        # A saved raw record escapes bytes outside printable ASCII as \\xNN: such a line may
        # spell a trigger word only once unescaped, so it is always parsed.
        # A journal line whose message is given as bytes, or left out, is parsed too, and a
        # line with a terminal's colours in it (they may split a trigger word).
        self._line_search = trigger_search(
            (*self.triggers, "\\x", TERMINAL_ESCAPE, *JOURNAL_LINE_WORDS)
        )

    def candidate(self, message: str) -> bool:
        """Whether a record's message can matter to any matcher."""
        return self._everything or self._search(message) is not None

    def candidate_line(self, line: str) -> bool:
        """Whether a saved line, before parsing, can hold a message that `candidate` takes."""
        return self._everything or self._line_search(line) is not None

    def feed(self, record: LogRecord) -> list[Finding]:
        return [f for _, f in self._feed(record)]

    def _feed(self, record: LogRecord) -> list[tuple[int, Finding]]:
        """`feed`'s findings, each with its matcher's rank."""
        if not record.from_kernel:
            chosen = (
                self._untrusted if self._everything else self._index_untrusted.hits(record.message)
            )
            for matcher in chosen:
                for finding in matcher.feed(record):
                    self.ignored[finding.kind] += 1
            return []
        ranked = self._ranked if self._everything else self._index.hits(record.message)
        return [(i, f) for i, m in ranked for f in m.feed(record)]

    def settle(self) -> list[Finding]:
        """The reader has nothing more for now: findings held for follow-up lines, in order."""
        for matcher in self._untrusted:
            for finding in matcher.settle():
                self.ignored[finding.kind] += 1
        return _in_order((i, f) for i, m in self._ranked for f in m.settle())

    def _flush(self) -> list[tuple[int, Finding]]:
        for matcher in self._untrusted:
            for finding in matcher.flush():
                self.ignored[finding.kind] += 1
        return [(i, f) for i, m in self._ranked for f in m.flush()]

    def flush(self) -> list[Finding]:
        return _in_order(self._flush())

    def scan(self, records: Iterable[LogRecord]) -> Iterator[Finding]:
        """Every finding of a stream, in the order of the records they start at."""
        found = [ranked for record in records for ranked in self._feed(record)]
        found.extend(self._flush())
        return iter(_in_order(found))


def _in_order(findings: Iterable[tuple[int, Finding]]) -> list[Finding]:
    """Findings (with their matchers' ranks) in the order of their records, those of one
    record in the matchers' order: a record held open for its follow-up lines is handed on
    after findings of later lines, and when depends on which records its matcher was fed.
    Sorted by arrival, not position: a file may mix two numberings (finding.py)."""
    ranked = sorted(findings, key=lambda pair: (arrival(pair[1].record), pair[0]))
    return [f for _, f in ranked]
