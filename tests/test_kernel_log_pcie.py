"""PCIe AER reports, a GPU the driver could not bring up, and host memory errors (EDAC): every
wording the kernels and drivers use, in every shape a tool saves a log in, and live through
the collector (where a report's lines arrive in two reads).

Formats and their sources: collectors/kernel_log/pcie.py, collectors/kernel_log/host.py and
tests/fixtures/kernel_log/corpus/SOURCES.md (class 11)."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest

from agent.contracts.model import Event, RepairAction, Severity
from agent.program.commands.scan import scan_lines
from collectors.kernel_log.matchers import KINDS, Finding, about_gpu
from collectors.kernel_log.parse import ParseStats
from tests.support.klog_shapes import SHAPES, Record, render
from tests.support.kmsg import FakeKmsg
from tests.test_kmsg_collector import Harness, executor, value

__all__ = ["executor"]  # the fixture, used by name

GPU = ("nvidia", "0000:41:00.0", "10de:2335")
NIC = ("mlx5_core", "0000:83:00.0", "15b3:1021")
# class -> (old words, new words, severity, repair of a GPU, repair of another device)
CLASSES = {
    "corrected": (
        "Corrected",
        "Correctable",
        Severity.INFO,
        RepairAction.NONE,
        RepairAction.NONE,
    ),
    "non-fatal": (
        "Uncorrected (Non-Fatal)",
        "Uncorrectable (Non-Fatal)",
        Severity.WARNING,
        RepairAction.INVESTIGATE,
        RepairAction.INVESTIGATE,
    ),
    "fatal": (
        "Uncorrected (Fatal)",
        "Uncorrectable (Fatal)",
        Severity.CRITICAL,
        RepairAction.REBOOT_NODE,
        RepairAction.INVESTIGATE,
    ),
}
# (kernel, its prefix after the device, its agent form)
KERNELS = {
    "before 4.18": ("", "id=4100(Receiver ID)"),
    "4.19 on": ("AER: ", "(Receiver ID)"),
}


def aer_lines(
    device: tuple[str, str, str], words: str, kernel: str, status: str, mask: str
) -> list[str]:
    driver, bdf, ids = device
    prefix, agent = KERNELS[kernel]
    head = f"{driver} {bdf}: {prefix}"
    return [
        f"{head}PCIe Bus Error: severity={words}, type=Transaction Layer, {agent}",
        f"{head}  device [{ids}] error status/mask={status}/{mask}",
        f"{head}   [ 5] SDES                   (First)",
    ]


def in_shape(shape: str, messages: list[str]) -> list[Finding]:
    """The messages as `shape` saves them (one record each), read as `gpuwarden scan` does."""
    text = "\n".join(
        render(shape, Record(m, seq=i, usec=5_000_000 + i)) for i, m in enumerate(messages, 1)
    )
    return scan_lines([line + "\n" for line in text.split("\n")], ParseStats())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("new_words", [False, True], ids=["old words", "new words"])
@pytest.mark.parametrize("klass", CLASSES)
@pytest.mark.parametrize("device", [GPU, NIC], ids=["GPU", "NIC"])
def test_an_aer_report_in_every_wording_and_shape(
    kernel: str, new_words: bool, klass: str, device: tuple[str, str, str]
) -> None:
    old, new, severity, gpu_repair, other_repair = CLASSES[klass]
    lines = aer_lines(device, new if new_words else old, kernel, "00040020", "00000000")
    gpu = device is GPU
    for shape in SHAPES:
        found = in_shape(shape, lines)
        assert [f.kind for f in found] == ["pcie_error"], shape
        (finding,) = found
        assert finding.severity is severity, shape
        assert finding.repair_action is (gpu_repair if gpu else other_repair), shape
        # A GPU's address ties the finding to the GPU; another device is a device.
        assert (finding.pci_bus_id, finding.device) == (
            (device[1], "") if gpu else ("", device[1])
        ), shape
        assert about_gpu(finding) is gpu
        attributes = finding.to_dict()
        assert attributes["aer_severity"] == klass
        assert attributes["pci_device_id"] == device[2]
        # The status register, unmasked: bits 5 and 18 of the uncorrectable register, bits
        # 5 (not one) and 18 (not one either) of the correctable one.
        expected = "SDES, MalfTLP" if klass != "corrected" else "bit 5, bit 18"
        assert attributes["errors"] == expected, shape
        assert finding.name and finding.meaning and finding.action


@pytest.mark.parametrize(
    ("status", "mask", "corrected", "errors"),
    [
        ("00000001", "00000000", True, "RxErr"),
        ("000011c1", "00000000", True, "RxErr, BadTLP, BadDLLP, Rollover, Timeout"),
        ("0000f000", "00002000", True, "Timeout, CorrIntErr, HeaderOF"),
        ("00104000", "00180000", False, "CmpltTO"),
        ("07fff031", "00000000", False, None),
        ("00000000", "00000000", False, None),
    ],
)
def test_the_errors_are_the_unmasked_status_bits(
    status: str, mask: str, corrected: bool, errors: str | None
) -> None:
    words = "Corrected" if corrected else "Uncorrected (Non-Fatal)"
    (finding,) = in_shape("dmesg", aer_lines(NIC, words, "4.19 on", status, mask))
    got = finding.to_dict().get("errors")
    if status == "07fff031":  # every uncorrectable bit the kernel names, in bit order
        assert got == (
            "Undefined, DLP, SDES, TLP, FCP, CmpltTO, CmpltAbrt, UnxCmplt, RxOF, MalfTLP, ECRC, "
            "UnsupReq, ACSViol, UncorrIntErr, BlockedTLP, AtomicOpBlocked, TLPBlockedErr, "
            "PoisonTLPBlocked"
        )
    else:
        assert got == errors


def test_a_device_line_joins_only_its_own_report() -> None:
    """Another device's report between a header and its device line, and a device line too
    far from its header: each report keeps its own facts."""
    gpu = aer_lines(GPU, "Uncorrected (Fatal)", "4.19 on", "00000020", "00000000")
    nic = aer_lines(NIC, "Corrected", "4.19 on", "00000001", "00000000")
    found = in_shape("dmesg", [gpu[0], nic[0], nic[1], gpu[1]])
    by_device = {f.pci_bus_id or f.device: f.to_dict() for f in found}
    assert by_device[GPU[1]]["pci_device_id"] == GPU[2]
    assert by_device[NIC[1]]["pci_device_id"] == NIC[2]
    assert by_device[NIC[1]]["errors"] == "RxErr"
    far = in_shape("dmesg", [gpu[0], *[f"noise {i}" for i in range(20)], gpu[1]])
    (alone,) = far
    assert "pci_device_id" not in alone.to_dict()


INIT = "0000:07:00.0"
ATTEMPT = [
    f"NVRM: GPU {INIT}: RmInitAdapter failed! (0x62:0xffff:1785)",
    f"NVRM: GPU {INIT}: rm_init_adapter failed, device minor number 1",
    f"nvidia {INIT}: probe with driver nvidia failed with error -1",
]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_failed_bring_up_is_one_finding_in_every_shape(shape: str) -> None:
    found = in_shape(
        shape,
        [
            f"NVRM: GPU {INIT}: GPU does not have the necessary power cables connected.",
            *ATTEMPT,
            *ATTEMPT,
        ],
    )
    assert [(f.kind, f.pci_bus_id, f.name) for f in found] == [
        ("gpu_init_failed", INIT, "GPU without power"),
        ("gpu_init_failed", INIT, "GPU failed to initialise"),
    ], shape
    first, second = (f.to_dict() for f in found)
    assert first["repair_action"] == RepairAction.HARDWARE_INSPECTION.value
    assert second["repair_action"] == RepairAction.REBOOT_NODE.value
    for attributes in (first, second):
        assert (attributes["rm_init_status"], attributes["rm_status"]) == ("0x62", "0xffff")
        assert (attributes["device_minor"], attributes["probe_errno"]) == (1, -1)
    assert all(about_gpu(f) and f.severity is Severity.CRITICAL for f in found)


@pytest.mark.parametrize(
    ("line", "severity", "device"),
    [
        (
            "EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0 (channel:1 "
            "slot:0 page:0x1 offset:0x0 grain:32 syndrome:0x0 -  area:DRAM err_code:0001:0090)",
            Severity.WARNING,
            "CPU_SrcID#0_Ha#0_Chan#1_DIMM#0",
        ),
        (
            "EDAC MC1: 3 UE memory read error on CPU_SrcID#1_Ha#0_Chan#0_DIMM#1 (channel:0 "
            "slot:1 page:0x2 offset:0x0 grain:32 -  area:DRAM err_code:0000:009f)",
            Severity.CRITICAL,
            "CPU_SrcID#1_Ha#0_Chan#0_DIMM#1",
        ),
        ("EDAC MC0: 1 UE Multi-bit ECC on unknown memory (node:0 card:0)", Severity.CRITICAL, ""),
        (
            "EDAC MC0: CE page 0x7f3a, offset 0x40, grain 8, syndrome 0x5d, row 1",
            Severity.WARNING,
            "",
        ),
        ("EDAC skx MC2: 1 CE memory read error on DIMM_A1 (x)", Severity.WARNING, "DIMM_A1"),
        ("EDAC sbridge: Seeking for: PCI ID 8086:0e7f", None, ""),
        ("EDAC MC: Ver: 3.0.0", None, ""),
        ("EDAC MC0: Giving out device to module skx_edac controller Skylake", None, ""),
    ],
)
def test_host_memory_errors(line: str, severity: Severity | None, device: str) -> None:
    found = in_shape("journal-short", [line])
    if severity is None:
        assert found == []
        return
    (finding,) = found
    assert (finding.kind, finding.severity, finding.device) == ("memory_error", severity, device)
    repair = (
        RepairAction.HARDWARE_INSPECTION
        if severity is Severity.CRITICAL
        else RepairAction.INVESTIGATE
    )
    assert finding.repair_action is repair
    if device:
        assert device in finding.meaning
    assert "memory_error" in KINDS and "pcie_error" in KINDS and "gpu_init_failed" in KINDS


def _write(device: FakeKmsg, line: str) -> None:
    device.write(line, level=3, usec=int(time.monotonic() * 1e6))


def _of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.kind == kind]


async def test_live_a_report_split_across_reads_is_one_event(
    tmp_path: Path, executor: concurrent.futures.Executor
) -> None:
    """The driver's lines of one attempt read in two rounds (the event is raised at the
    first, the later line is known as part of it), then the same attempt again and again
    (every open of the device retries): one event, the rest counted as repeats."""
    device = FakeKmsg.with_records([])
    h = Harness(tmp_path, device, executor)
    await h.collect()
    events: list[Event] = []
    for lines in (ATTEMPT[:1], ATTEMPT[1:], ATTEMPT, ATTEMPT):
        for line in lines:
            _write(device, line)
        events += (await h.collect())[0]
    (raised,) = _of(events, "gpu_init_failed")
    assert raised.subject == INIT
    assert raised.severity is Severity.CRITICAL
    assert raised.repair_action is RepairAction.REBOOT_NODE
    assert raised.attributes["rm_init_status"] == "0x62"
    samples = (await h.collect())[1]
    assert value(samples, "gpuwarden_kernel_log_findings_total", kind="gpu_init_failed") == 3
    assert (
        value(samples, "gpuwarden_kernel_log_suppressed_events_total", kind="gpu_init_failed") == 2
    )


async def test_live_a_gpu_aer_report_is_named_by_the_gpu(
    tmp_path: Path, executor: concurrent.futures.Executor
) -> None:
    """A GPU the agent knows: its UUID is the subject, its address an alias; the device line
    read in the next round is part of the report raised already, not a second one."""
    from collectors._xid import XidCorrelator
    from tests.test_kmsg_collector import IDENTITY, PCI

    bdf = PCI
    lines = aer_lines(
        ("nvidia", bdf, "10de:2335"), "Uncorrected (Fatal)", "4.19 on", "00000020", "00000000"
    )
    device = FakeKmsg.with_records([])
    h = Harness(tmp_path, device, executor)
    h.shared.get(XidCorrelator, XidCorrelator).set_identity(PCI, IDENTITY)
    await h.collect()
    _write(device, lines[0])
    events = (await h.collect())[0]
    _write(device, lines[1])
    events += (await h.collect())[0]
    (raised,) = _of(events, "pcie_error")
    assert raised.subject == IDENTITY["uuid"]
    assert bdf in raised.aliases
    assert raised.repair_action is RepairAction.REBOOT_NODE
    assert raised.attributes["uuid"] == IDENTITY["uuid"]


@pytest.mark.parametrize(
    ("driver", "bdf", "pci_bus_id", "device"),
    [
        # Intel VMD puts the devices behind it in domains from 10000 (drivers/pci/controller/vmd.c)
        ("nvme", "10000:01:00.0", "", "10000:01:00.0"),
        ("pcieport", "10000:00:02.0", "", "10000:00:02.0"),
        # a GPU there is named as NVML names it (`00010000:E1:00.0`, the same address)
        ("nvidia", "10000:e1:00.0", "10000:e1:00.0", ""),
        ("nvidia", "10000:E1:00.0", "10000:e1:00.0", ""),
        ("nvidia", "0001:41:00.0", "0001:41:00.0", ""),
    ],
)
def test_a_device_in_any_pci_domain(driver: str, bdf: str, pci_bus_id: str, device: str) -> None:
    lines = aer_lines(
        (driver, bdf, "8086:0a54"), "Uncorrected (Fatal)", "4.19 on", "00000020", "00000000"
    )
    (finding,) = in_shape("dmesg", lines[:2])
    assert (finding.kind, finding.pci_bus_id, finding.device) == ("pcie_error", pci_bus_id, device)
    assert finding.to_dict()["pci_device_id"] == "8086:0a54"
    assert finding.severity is Severity.CRITICAL
    gpu = driver == "nvidia"
    assert finding.repair_action is (RepairAction.REBOOT_NODE if gpu else RepairAction.INVESTIGATE)
    assert ("GPU" in finding.meaning) is gpu
