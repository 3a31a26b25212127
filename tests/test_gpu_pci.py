"""A GPU on the PCI bus that NVML never enumerated: counted in sysfs, named by its address.

NVML counts only the GPUs the driver brought up, so a GPU that fails to come up after a reboot
has no series at all. The collector counts NVIDIA display and 3D controller functions in sysfs
(NVSwitches, class 0x0680, and audio functions apart) and compares the PCI count, the NVML count
and `expected_gpus`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.contracts.model import Severity
from agent.program.diagnose.collect_once import CollectorResult
from agent.program.diagnose.findings import Status
from agent.program.diagnose.gpu_findings import classify_gpus
from collectors.gpu.collector import GpuSettings
from collectors.gpu.pci import scan_pci
from tests.support.nvml import GpuRig, fake_gpus, find, kinds, value
from tests.support.nvml_fake import FakeNvml

TREES = Path(__file__).resolve().parent / "fixtures" / "sysfs"


class TestScan:
    def test_hgx(self) -> None:
        scan = scan_pci(TREES / "hgx-h200-8gpu")
        assert [f.address for f in scan.gpus] == [
            f"0000:{0x18 + i * 0x10:02x}:00.0" for i in range(8)
        ]
        assert len(scan.nvswitches) == 4
        assert {f.driver for f in scan.gpus} == {"nvidia"}

    def test_audio_and_other_vendors_are_not_gpus(self) -> None:
        scan = scan_pci(TREES / "workstation-vfio")
        assert [(f.address, f.driver) for f in scan.gpus] == [
            ("0000:18:00.0", "nvidia"),
            ("0000:28:00.0", "vfio-pci"),
        ]
        assert scan.nvswitches == ()

    def test_unbound_gpu_has_no_driver(self) -> None:
        scan = scan_pci(TREES / "hgx-one-unbound")
        assert [f.driver for f in scan.gpus].count("") == 1

    def test_missing_tree_is_an_error_not_zero(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match="bus/pci/devices"):
            scan_pci(tmp_path)

    def test_unreadable_function_is_skipped(self, tmp_path: Path) -> None:
        shutil.copytree(TREES / "one-h200", tmp_path / "sys", symlinks=True)
        broken = tmp_path / "sys/bus/pci/devices/0000:99:00.0"
        broken.mkdir()
        (broken / "vendor").write_text("garbage\n")
        scan = scan_pci(tmp_path / "sys")
        assert [f.address for f in scan.gpus] == ["0000:18:00.0"]


def rig_for(tree: str, gpus: int, expected: int = 0) -> GpuRig:
    settings = GpuSettings(event_thread=False, sysfs_root=str(TREES / tree), expected_gpus=expected)
    return GpuRig(FakeNvml(fake_gpus(gpus)), settings=settings)


class TestCollector:
    async def test_all_enumerated(self) -> None:
        rig = rig_for("hgx-h200-8gpu", 8)
        try:
            result = await rig.collect()
        finally:
            await rig.close()
        assert value(result, "gpuwarden_gpus_pci") == 8
        assert value(result, "gpuwarden_nvswitches_pci") == 4
        assert value(result, "gpuwarden_gpus_visible") == 8
        assert find(result, "gpuwarden_gpu_pci_not_visible") == []
        assert "gpu_not_enumerated" not in kinds(result)

    async def test_the_counts_follow_the_bus_scan_by_scan(self, tmp_path: Path) -> None:
        """The PCI series are made once per scan (every slow_interval) and kept between: a
        GPU that leaves the bus shows at the next scan, not before and not never."""
        tree = tmp_path / "sys"
        shutil.copytree(TREES / "hgx-h200-8gpu", tree, symlinks=True)
        settings = GpuSettings(event_thread=False, sysfs_root=str(tree))
        rig = GpuRig(FakeNvml(fake_gpus(8)), settings=settings)
        try:
            first = await rig.collect(advance=1.0)
            devices = tree / "bus" / "pci" / "devices"
            gpus = [
                d for d in sorted(devices.iterdir()) if (d / "class").read_text() == "0x030200\n"
            ]
            shutil.rmtree(gpus[-1])
            same_scan = await rig.collect(advance=1.0)
            rig.now += settings.slow_interval
            next_scan = await rig.collect()
        finally:
            await rig.close()
        assert value(first, "gpuwarden_gpus_pci") == 8
        assert value(same_scan, "gpuwarden_gpus_pci") == 8  # kept until the next scan
        assert value(next_scan, "gpuwarden_gpus_pci") == 7
        assert value(next_scan, "gpuwarden_nvswitches_pci") == 4

    async def test_gpu_on_the_bus_that_nvml_does_not_see(self) -> None:
        fake = FakeNvml(fake_gpus(8))
        del fake.gpus[3]  # 0000:48:00.0 did not come up
        rig = GpuRig(
            fake, settings=GpuSettings(event_thread=False, sysfs_root=str(TREES / "hgx-h200-8gpu"))
        )
        try:
            first = await rig.collect()
            again = await rig.collect()
            fake.gpus.insert(3, fake_gpus(8)[3])
            rig.now += 3600  # past slow_interval: the count is read again
            back = await rig.collect()
        finally:
            await rig.close()
        assert value(first, "gpuwarden_gpus_pci") == 8
        assert value(first, "gpuwarden_gpus_visible") == 7
        missing = find(first, "gpuwarden_gpu_pci_not_visible")
        assert [(s.labels["pci_bus_id"], s.value) for s in missing] == [("0000:48:00.0", 1)]
        events = [e for e in first.events if e.kind == "gpu_not_enumerated"]
        assert len(events) == 1
        assert events[0].severity is Severity.CRITICAL
        assert events[0].subject == "0000:48:00.0"
        assert "0000:48:00.0" in events[0].message
        assert "nvidia" in events[0].message  # the driver bound to it
        assert events[0].action
        assert "gpu_not_enumerated" not in kinds(again)  # once, not every round
        assert find(again, "gpuwarden_gpu_pci_not_visible") != []
        assert find(back, "gpuwarden_gpu_pci_not_visible") == []
        assert "gpu_not_enumerated_cleared" in kinds(back)

    async def test_unbound_gpu_is_named_so(self) -> None:
        fake = FakeNvml(fake_gpus(8))
        del fake.gpus[3]
        rig = GpuRig(
            fake,
            settings=GpuSettings(event_thread=False, sysfs_root=str(TREES / "hgx-one-unbound")),
        )
        try:
            result = await rig.collect()
        finally:
            await rig.close()
        event = next(e for e in result.events if e.kind == "gpu_not_enumerated")
        assert "no driver" in event.message

    async def test_passed_through_gpu_is_not_missing(self) -> None:
        fake = FakeNvml(fake_gpus(1))
        rig = GpuRig(
            fake,
            settings=GpuSettings(event_thread=False, sysfs_root=str(TREES / "workstation-vfio")),
        )
        try:
            result = await rig.collect()
        finally:
            await rig.close()
        # 0000:28:00.0 is bound to vfio-pci: given to a VM on purpose, counted apart.
        assert value(result, "gpuwarden_gpus_pci") == 1
        assert value(result, "gpuwarden_gpus_pci_passthrough") == 1
        assert find(result, "gpuwarden_gpu_pci_not_visible") == []
        assert "gpu_not_enumerated" not in kinds(result)

    async def test_no_sysfs_means_absent_not_zero(self, tmp_path: Path) -> None:
        settings = GpuSettings(event_thread=False, sysfs_root=str(tmp_path))
        rig = GpuRig(FakeNvml(fake_gpus(1)), settings=settings)
        try:
            result = await rig.collect()
        finally:
            await rig.close()
        assert value(result, "gpuwarden_gpus_pci") is None
        assert value(result, "gpuwarden_gpus_visible") == 1

    async def test_nvml_down_still_counts_the_bus(self) -> None:
        import pynvml

        fake = FakeNvml(fake_gpus(1), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        rig = GpuRig(
            fake, settings=GpuSettings(event_thread=False, sysfs_root=str(TREES / "one-h200"))
        )
        try:
            result = await rig.collect()
        finally:
            await rig.close()
        # The bus count is what tells "no GPU here" from "a GPU the driver did not bring up".
        assert value(result, "gpuwarden_gpus_pci") == 1
        assert value(result, "gpuwarden_nvml_up") == 0


class TestCheck:
    async def test_check_fails_naming_the_address(self) -> None:
        fake = FakeNvml(fake_gpus(8))
        del fake.gpus[5]
        rig = GpuRig(
            fake, settings=GpuSettings(event_thread=False, sysfs_root=str(TREES / "hgx-h200-8gpu"))
        )
        try:
            result = await rig.collect()
        finally:
            await rig.close()
        findings = classify_gpus(CollectorResult("gpu", result.samples, result.events), None)
        failed = [f for f in findings if f.status is Status.FAIL]
        assert any("0000:68:00.0" in f.detail or "0000:68:00.0" in f.name for f in failed), findings
        count = next(f for f in findings if f.name == "GPU count")
        assert count.status is Status.FAIL
        assert "7 visible to NVML, 8 NVIDIA GPUs on the PCI bus" in count.detail
