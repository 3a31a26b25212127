"""A GPU's or NVSwitch's address in a PCI domain of any width, in every line that names one.

Linux writes a domain with `%04x` (drivers/pci/probe.c `pci_name`, the NVIDIA driver's
`%04x:%02x:%02x`), so a domain past 0xffff has 5 or more digits: Intel VMD's start at 0x10000
(drivers/pci/controller/vmd.c), Hyper-V's pci-hyperv takes them from the device's GUID. NVML
writes the same address with 8 digits (`00010000:01:00.0`). Each finding must carry the address
in the one form `normalize_pci_bus_id` gives, whatever the width and case the line used.
"""

from __future__ import annotations

import pytest

from agent.program.commands.scan import scan_lines
from collectors._xid import normalize_pci_bus_id
from collectors.kernel_log.matchers import Finding
from collectors.kernel_log.parse import ParseStats
from tests.support.klog_shapes import SHAPES, Record, render

# (domain as the line writes it, the normalised domain)
DOMAINS = [
    ("0000", "0000"),
    ("0001", "0001"),
    ("ABCD", "abcd"),
    ("10000", "10000"),
    ("1000f", "1000f"),
    ("1000F", "1000f"),
    ("00010000", "10000"),
    ("c0de1234", "c0de1234"),
    ("C0DE1234", "c0de1234"),
]
SHAPE_SAMPLE = ["kmsg", "dmesg", "dmesg-x", "journal-short-iso", "syslog-kern-log"]


def scan(shape: str, messages: list[str]) -> list[Finding]:
    text = "\n".join(
        render(shape, Record(m, seq=i, usec=5_000_000 + i)) for i, m in enumerate(messages, 1)
    )
    stats = ParseStats()
    found = scan_lines([line + "\n" for line in text.split("\n")], stats)
    assert stats.malformed == 0, (shape, messages)
    return found


def lines_naming(domain: str, bus: str) -> dict[str, tuple[list[str], str]]:
    """What kind of line -> (its lines, the finding kind). `bus` is `41:00` in the line's case;
    the function is left out where the driver leaves it out."""
    short = f"{domain}:{bus}"
    full = f"{short}.0"
    aer = f"nvidia {full}: AER: "
    return {
        "xid": (
            [f"NVRM: Xid (PCI:{short}): 79, pid=7, name=python3, GPU has fallen off the bus."],
            "xid",
        ),
        "xid-no-prefix": (
            [f"NVRM: Xid ({short}): 48, pid=7, name=x, An uncorrectable ECC error"],
            "xid",
        ),
        "xid-mig": ([f"NVRM: Xid (PCI:{short} GPU-I:05): 94, pid=7, name=x, Ch 00000008"], "xid"),
        "sxid": (
            [f"nvidia-nvswitch3: SXid (PCI:{full}): 20034, Fatal, Link 44 LTSSM Fault Up"],
            "sxid",
        ),
        "off-bus": (
            [f"NVRM: GPU at PCI:{short}: GPU has fallen off the bus."],
            "gpu_fallen_off_bus",
        ),
        "off-bus-old": ([f"NVRM: GPU at {short} has fallen off the bus."], "gpu_fallen_off_bus"),
        "off-bus-three": (
            [
                f"NVRM: The NVIDIA GPU {full}",
                "NVRM: (PCI ID: 10de:2330) installed in this system has",
                "NVRM: fallen off the bus and is not responding to commands.",
            ],
            "gpu_fallen_off_bus",
        ),
        "init": (
            [
                f"NVRM: GPU {full}: RmInitAdapter failed! (0x62:0xffff:1785)",
                f"NVRM: GPU {full}: rm_init_adapter failed, device minor number 1",
                f"nvidia {full}: probe with driver nvidia failed with error -1",
            ],
            "gpu_init_failed",
        ),
        "aer": (
            [
                f"{aer}PCIe Bus Error: severity=Uncorrectable (Fatal), type=Transaction Layer, "
                "(Receiver ID)",
                f"{aer}  device [10de:2330] error status/mask=00000020/00000000",
            ],
            "pcie_error",
        ),
    }


KINDS_OF_LINE = list(lines_naming("0000", "41:00"))


@pytest.mark.parametrize("shape", SHAPE_SAMPLE)
@pytest.mark.parametrize("line", KINDS_OF_LINE)
@pytest.mark.parametrize("bus", ["41:00", "C7:1F"])
@pytest.mark.parametrize(("domain", "normalised"), DOMAINS)
def test_every_line_names_its_device_in_any_domain(
    domain: str, normalised: str, bus: str, line: str, shape: str
) -> None:
    messages, kind = lines_naming(domain, bus)[line]
    found = scan(shape, messages)
    assert [f.kind for f in found] == [kind], (shape, messages)
    expected = f"{normalised}:{bus.lower()}.0"
    assert found[0].pci_bus_id == expected
    # the address NVML gives the same device names the same GPU
    assert normalize_pci_bus_id(f"{int(normalised, 16):08X}:{bus.upper()}.0") == expected


@pytest.mark.parametrize("domain", ["100000000", "123"])
def test_a_domain_that_cannot_be_gives_no_address(domain: str) -> None:
    """9 or 3 digits are no PCI domain: the Xid is still found, without an address."""
    (found,) = scan("dmesg", [f"NVRM: Xid (PCI:{domain}:41:00): 79, pid=7, name=x, GPU off"])
    assert (found.kind, found.pci_bus_id) == ("xid", "")


def test_shapes_are_known() -> None:
    assert set(SHAPE_SAMPLE) <= set(SHAPES)
