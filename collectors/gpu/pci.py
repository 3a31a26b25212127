"""NVIDIA GPUs on the PCI bus, from sysfs: what NVML should see, whether the driver brought it
up or not.

A function counts as a GPU when its vendor is NVIDIA (0x10de) and its class is a display
controller (0x03xxxx: VGA 0x0300, 3D controller 0x0302 as on data-centre GPUs). NVSwitches
(class 0x0680, "other bridge") are counted apart; the HDMI audio function of a VGA card (0x0403)
is not a GPU. The sysfs root is a parameter so that tests run on fixture trees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

NVIDIA_VENDOR: Final = 0x10DE
DISPLAY_CLASS: Final = 0x03
NVSWITCH_CLASS: Final = 0x0680
PASSTHROUGH_DRIVERS: Final = frozenset({"vfio-pci", "pci-stub"})
"""Drivers that hold a GPU for a virtual machine: NVML on the host is not meant to see it."""


@dataclass(frozen=True, slots=True)
class PciFunction:
    address: str
    """Linux form, `0000:3b:00.0`, as NVML's bus id normalises to."""
    device_id: int
    driver: str
    """The bound driver's name; "" when none is bound (the driver failed to probe it)."""

    @property
    def passed_through(self) -> bool:
        return self.driver in PASSTHROUGH_DRIVERS


@dataclass(frozen=True, slots=True)
class PciScan:
    gpus: tuple[PciFunction, ...]
    nvswitches: tuple[PciFunction, ...]


def _hex(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return int(f.read(32).strip(), 16)
    except (OSError, ValueError):
        return None


def _driver(path: str) -> str:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return ""


def scan_pci(sysfs_root: Path) -> PciScan:
    """Every NVIDIA GPU and NVSwitch function under `<sysfs_root>/bus/pci/devices`, by address.
    Raises OSError when that directory cannot be listed (no sysfs: the count is unknown, not 0);
    a function whose files cannot be read is left out."""
    devices = f"{sysfs_root}/bus/pci/devices"
    gpus: list[PciFunction] = []
    switches: list[PciFunction] = []
    for address in sorted(os.listdir(devices)):
        base = f"{devices}/{address}"
        if _hex(f"{base}/vendor") != NVIDIA_VENDOR:
            continue
        klass = _hex(f"{base}/class")
        if klass is None:
            continue
        function = PciFunction(
            address.lower(), _hex(f"{base}/device") or 0, _driver(f"{base}/driver")
        )
        if klass >> 16 == DISPLAY_CLASS:
            gpus.append(function)
        elif klass >> 8 == NVSWITCH_CLASS:
            switches.append(function)
    return PciScan(tuple(gpus), tuple(switches))
