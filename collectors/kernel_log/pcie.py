"""PCIe and driver bring-up findings: PCIe AER errors (any device; a GPU's carry its address)
and a GPU the NVIDIA driver could not initialise.

Formats, by file:
- drivers/pci/pcie/aer.c `aer_print_error` (aerdrv_errprint.c before 4.17): `<driver> <bdf>:
  PCIe Bus Error: severity=%s, type=%s, (%s)` then `  device [%04x:%04x] error
  status/mask=%08x/%08x`, then one line per error bit. Since 4.19 the lines carry `AER: `
  after the device (`dev_fmt`); before 4.18 the agent is `id=%04x(%s)`; the severity words are
  `Corrected`, `Uncorrected (Non-Fatal)`, `Uncorrected (Fatal)`, renamed `Correctable`,
  `Uncorrectable (Non-Fatal)`, `Uncorrectable (Fatal)` by a later patch (the PCIe
  specification's words): both are read. The errors are read from the status register, unmasked (the bit names are the
  kernel's `aer_*_error_string`, after the PCIe base specification's AER registers), so that
  kernels which print no `AER: ` on the bit lines lose nothing.
- open-gpu-kernel-modules src/nvidia/arch/nvalloc/unix/src/osinit.c `RmInitAdapter`:
  `NVRM: GPU %04x:%02x:%02x.%x: RmInitAdapter failed! (0x%x:0x%x:%d)` (`NV_DEV_PRINTF`) and,
  before it, `GPU does not have the necessary power cables connected.`;
  kernel-open/nvidia/nv.c: `rm_init_adapter failed, device minor number %d` (with the same
  `GPU <bdf>: ` prefix in current drivers, without it in older ones);
  drivers/base/dd.c: `nvidia: probe of %s failed with error %d`, since 5.x `nvidia <bdf>:
  probe with driver nvidia failed with error %d`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from agent.contracts.model import AttributeValue, RepairAction, Severity
from collectors.kernel_log.finding import (
    ANY_BDF,
    Assembling,
    Finding,
    OpenRecords,
    pci_or_empty,
)
from collectors.kernel_log.parse import LogRecord

PCIE_KINDS: Final = ("pcie_error", "gpu_init_failed")

# Each line is found by its fixed words, and the device (`<driver> <bdf>: [AER: ]`) read from
# just before them, with every field bounded: a pattern that began with the driver's name would
# try it from every place in a line, the square of its length (tests/test_kernel_log_hostile.py).
_AER_SOURCE = re.compile(rf"(?:^|\s)(?P<driver>[\w.-]{{1,64}}) (?P<bdf>{ANY_BDF}): (?:AER: )?\s*$")
_AER_HEADER = re.compile(
    r"PCIe Bus Error: severity=(?P<severity>[^,]{1,40}), type=(?P<type>[^,]{1,40}),"
    r" (?:id=[0-9a-fA-F]{4})?\((?P<agent>[^)]{0,40})\)"
)
_AER_DEVICE = re.compile(
    r"device \[(?P<vendor>[0-9a-fA-F]{4}):(?P<device_id>[0-9a-fA-F]{4})\] "
    r"error status/mask=(?P<status>[0-9a-fA-F]{8})/(?P<mask>[0-9a-fA-F]{8})"
)


def _aer_source(message: str, match: re.Match[str]) -> re.Match[str] | None:
    """The `<driver> <bdf>: ` right before a line's fixed words (None: the words stand
    elsewhere, so this is no AER line)."""
    return _AER_SOURCE.search(message, max(0, match.start() - 120), match.start())


# The device line follows its header at once, unless another CPU's line comes between.
AER_REACH: Final = 8

# Bit -> the kernel's short name (aer.c aer_correctable_error_string and
# aer_uncorrectable_error_string; the bits are the PCIe base specification's).
_CORRECTABLE_BITS: Final = {
    0: "RxErr",
    6: "BadTLP",
    7: "BadDLLP",
    8: "Rollover",
    12: "Timeout",
    13: "NonFatalErr",
    14: "CorrIntErr",
    15: "HeaderOF",
}
_UNCORRECTABLE_BITS: Final = {
    0: "Undefined",
    4: "DLP",
    5: "SDES",
    12: "TLP",
    13: "FCP",
    14: "CmpltTO",
    15: "CmpltAbrt",
    16: "UnxCmplt",
    17: "RxOF",
    18: "MalfTLP",
    19: "ECRC",
    20: "UnsupReq",
    21: "ACSViol",
    22: "UncorrIntErr",
    23: "BlockedTLP",
    24: "AtomicOpBlocked",
    25: "TLPBlockedErr",
    26: "PoisonTLPBlocked",
}

_CORRECTED: Final = "corrected"
_NON_FATAL: Final = "non-fatal"
_FATAL: Final = "fatal"


def _aer_class(words: str) -> str:
    """The kernel's severity words, old (`Uncorrected (Fatal)`) or new (`Uncorrectable
    (Fatal)`), as one of three classes; unknown words count as non-fatal."""
    text = words.strip().lower()
    if text.startswith("correct"):
        return _CORRECTED
    if "non-fatal" in text or "nonfatal" in text:
        return _NON_FATAL
    if "fatal" in text:
        return _FATAL
    return _NON_FATAL


def _errors(status: int, mask: int, corrected: bool) -> list[str]:
    names = _CORRECTABLE_BITS if corrected else _UNCORRECTABLE_BITS
    unmasked = status & ~mask
    return [names.get(bit, f"bit {bit}") for bit in range(32) if unmasked >> bit & 1]


@dataclass
class _Aer:
    record: LogRecord
    driver: str
    bdf: str
    severity_words: str
    layer: str
    agent: str
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    vendor: str = ""

    def add_device(self, match: re.Match[str]) -> None:
        self.vendor = match["vendor"].lower()
        status, mask = int(match["status"], 16), int(match["mask"], 16)
        self.attributes.update(
            pci_device_id=f"{self.vendor}:{match['device_id'].lower()}",
            error_status=f"0x{status:08x}",
            error_mask=f"0x{mask:08x}",
        )
        errors = _errors(status, mask, _aer_class(self.severity_words) == _CORRECTED)
        if errors:
            self.attributes["errors"] = ", ".join(errors)

    def finding(self) -> Finding:
        klass = _aer_class(self.severity_words)
        # Only a GPU's address is a pci_bus_id: it ties the finding to the GPU (its UUID, its
        # pause). Any other device, and a GPU at an address NVML cannot have (a domain past
        # ffff), is named as a device.
        gpu = self.driver == "nvidia"
        address = pci_or_empty(self.bdf) if gpu else ""
        what = f"the GPU {self.bdf}" if gpu else f"the PCIe device {self.bdf} ({self.driver})"
        errors = self.attributes.get("errors")
        detail = f": {errors}" if errors else ""
        layer = self.layer.strip()
        if klass == _CORRECTED:
            severity, repair = Severity.INFO, RepairAction.NONE
            meaning = (
                f"{what} reported a corrected PCIe error ({layer}{detail}); the link retried "
                "and nothing was lost"
            )
            action = (
                "nothing at a low rate; many a minute, or a rising count, point at a bad "
                "link (riser, cable, slot): reseat the device, and check the BMC's event log"
            )
        elif klass == _NON_FATAL:
            severity, repair = Severity.WARNING, RepairAction.INVESTIGATE
            meaning = (
                f"{what} reported an uncorrectable, non-fatal PCIe error ({layer}{detail}): "
                "a transaction was lost, the link stayed up"
            )
            action = (
                "check the device's own errors next to this line (an Xid for a GPU); if it "
                "repeats, drain the node and reseat the device or have its slot inspected"
            )
        else:
            severity = Severity.CRITICAL
            # A GPU whose link failed is lost to the driver until the node restarts.
            repair = RepairAction.REBOOT_NODE if gpu else RepairAction.INVESTIGATE
            meaning = (
                f"{what} reported a fatal PCIe error ({layer}{detail}): the link had to be "
                "reset and the device may be gone"
            )
            action = (
                "drain the node and reboot it; check the BMC's event log and the lines around "
                "this one (an Xid 79 for a GPU, `device recovery failed`); if it comes back, "
                "have the device, its riser or slot inspected"
                if gpu
                else "see whether the kernel's recovery succeeded (`device recovery` after "
                "this line) and whether the device still works; if it repeats, reseat or "
                "replace it"
            )
        attributes: dict[str, AttributeValue] = {
            "aer_severity": klass,
            "layer": layer,
            "agent": self.agent.strip(),
            "driver": self.driver,
            **self.attributes,
        }
        return Finding(
            kind="pcie_error",
            severity=severity,
            meaning=meaning,
            action=action,
            repair_action=repair,
            record=self.record,
            pci_bus_id=address,
            device="" if address else self.bdf.lower(),
            name=f"PCIe {klass} error",
            attributes=attributes,
        )


class AerMatcher(Assembling[_Aer]):
    """A PCIe AER report of one device: the `PCIe Bus Error` line and the device line after
    it (vendor, the error bits)."""

    triggers: Final = ("PCIe Bus Error", "error status/mask=")

    def __init__(self) -> None:
        self._open: OpenRecords[_Aer] = OpenRecords(AER_REACH)

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        message = record.message
        header = _AER_HEADER.search(message)
        if header is not None and (source := _aer_source(message, header)) is not None:
            state = _Aer(
                record,
                source["driver"],
                source["bdf"].lower(),
                header["severity"],
                header["type"],
                header["agent"],
            )
            yield from self._open.hold(state.bdf, state)
            return
        device = _AER_DEVICE.search(message)
        if device is not None and (source := _aer_source(message, device)) is not None:
            key = source["bdf"].lower()
            held = self._open.get(key)
            if held is not None and not held.vendor:
                held.add_device(device)
                self._open.extend(key)


_NV_GPU: Final = rf"NVRM: (?:GPU (?P<pci>{ANY_BDF}): )?"
_INIT_FAILED = re.compile(
    _NV_GPU + r"RmInitAdapter failed! \((?P<init>0x[0-9a-fA-F]+):(?P<rm>0x[0-9a-fA-F]+):"
    r"(?P<line>\d+)\)"
)
_ADAPTER_FAILED = re.compile(
    _NV_GPU + r"rm_init_adapter failed(?:, device minor number| for device bearing minor "
    r"number) (?P<minor>\d+)"
)
_NO_POWER = re.compile(_NV_GPU + r"GPU does not have the necessary power cables connected")
_PROBE_FAILED = re.compile(
    rf"nvidia(?: (?P<pci>{ANY_BDF}))?: probe (?:of (?P<old>{ANY_BDF}) )?(?:with driver nvidia )?"
    r"failed with error (?P<errno>-?\d+)"
)
# The driver writes these lines of one attempt together; every open of the device tries again.
INIT_REACH: Final = 16


@dataclass
class _Init:
    record: LogRecord
    pci: str
    no_power: bool = False
    attributes: dict[str, AttributeValue] = field(default_factory=dict)

    @property
    def has_status(self) -> bool:
        return "rm_init_status" in self.attributes

    def finding(self) -> Finding:
        where = f"the GPU {self.pci}" if self.pci else "a GPU"
        if self.no_power:
            meaning = (
                f"{where} has no power from its auxiliary cables (or the driver does not "
                "sense it): the driver did not start it, CUDA and NVML do not see it"
            )
            action = (
                "power the node off and connect or reseat the GPU's power cables; if they are "
                "connected, have the cables, the power supply or the GPU inspected"
            )
            repair, name = RepairAction.HARDWARE_INSPECTION, "GPU without power"
        else:
            meaning = (
                f"the NVIDIA driver could not initialise {where}: it is on the PCIe bus but "
                "unusable, CUDA and NVML do not see it"
            )
            action = (
                "read the driver's lines just before this one (a GSP or firmware error, an Xid "
                "79, a PCIe error); reboot the node, power-cycling it if a reboot does not bring "
                "the GPU back; if it fails again, have the GPU inspected (reseat, RMA)"
            )
            repair, name = RepairAction.REBOOT_NODE, "GPU failed to initialise"
        return Finding(
            kind="gpu_init_failed",
            severity=Severity.CRITICAL,
            meaning=meaning,
            action=action,
            repair_action=repair,
            record=self.record,
            pci_bus_id=self.pci,
            name=name,
            attributes=dict(self.attributes),
        )


class GpuInitMatcher(Assembling[_Init]):
    """One failed bring-up of a GPU: the power-cable line, `RmInitAdapter failed!`, the
    `rm_init_adapter failed` and the probe failure that follow it, as one finding."""

    triggers: Final = (
        "RmInitAdapter failed",
        "rm_init_adapter failed",
        "necessary power cables",
        "failed with error",
    )

    def __init__(self) -> None:
        self._open: OpenRecords[_Init] = OpenRecords(INIT_REACH)

    def _state(self, record: LogRecord, pci: str) -> tuple[_Init | None, list[Finding]]:
        held = self._open.get(pci)
        if held is not None:
            self._open.extend(pci)
            return held, []
        if self._open.near(pci):  # a line of an attempt handed on already (a batch ended)
            self._open.extend(pci)
            return None, []
        state = _Init(record, pci)
        return state, self._open.hold(pci, state)

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        message = record.message
        if (power := _NO_POWER.search(message)) is not None:
            pci = pci_or_empty(power["pci"])
            yield from self._open.hold(pci, _Init(record, pci, no_power=True))  # an attempt's first
            return
        if (failed := _INIT_FAILED.search(message)) is not None:
            pci = pci_or_empty(failed["pci"])
            held = self._open.get(pci)
            if held is not None and held.has_status:  # the next attempt
                held = None
            if held is None:
                held = _Init(record, pci)
                yield from self._open.hold(pci, held)
            else:
                self._open.extend(pci)
            held.attributes.update(
                rm_init_status=failed["init"].lower(),
                rm_status=failed["rm"].lower(),
                rm_init_line=int(failed["line"]),
            )
            return
        if (adapter := _ADAPTER_FAILED.search(message)) is not None:
            joined, found = self._state(record, pci_or_empty(adapter["pci"]))
            yield from found
            if joined is not None:
                joined.attributes["device_minor"] = int(adapter["minor"])
            return
        if (probe := _PROBE_FAILED.search(message)) is not None:
            pci = pci_or_empty(probe["pci"] or probe["old"])
            joined, found = self._state(record, pci)
            yield from found
            if joined is not None:
                joined.attributes["probe_errno"] = int(probe["errno"])
