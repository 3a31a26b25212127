"""dcgm-exporter compatibility: the info label the rules join on (more follows)."""

from __future__ import annotations

import pytest

from collectors.gpu.collector import GpuSettings
from tests.support.nvml import GpuRig, find
from tests.support.nvml_fake import FakeGpu, FakeNvml


class TestNvmlPciBusIdLabel:
    """gpuwarden_gpu_info carries the PCI address as NVML (and so DCGM) writes it, which
    PromQL cannot make from the Linux form (no upper case in label_replace)."""

    @pytest.mark.parametrize(
        "nvml_form",
        ["00000000:18:00.0", "00000000:3B:00.0", "00000001:AF:1F.7", "0000ABCD:00:00.0"],
    )
    async def test_the_fakes_own_busid_string(self, nvml_form: str) -> None:
        rig = GpuRig(
            FakeNvml([FakeGpu.h200(0, pci_bus_id=nvml_form)]), GpuSettings(event_thread=False)
        )
        try:
            collection = await rig.collect()
        finally:
            await rig.close()
        (info,) = find(collection, "gpuwarden_gpu_info")
        assert info.labels["nvml_pci_bus_id"] == nvml_form
        assert info.labels["pci_bus_id"] == nvml_form[4:].lower()  # the contract's form stays

    async def test_lower_case_from_nvml_is_written_as_nvml_does(self) -> None:
        rig = GpuRig(FakeNvml([FakeGpu.h200(0, pci_bus_id="00000000:3b:00.0")]))
        try:
            collection = await rig.collect()
        finally:
            await rig.close()
        (info,) = find(collection, "gpuwarden_gpu_info")
        assert info.labels["nvml_pci_bus_id"] == "00000000:3B:00.0"
