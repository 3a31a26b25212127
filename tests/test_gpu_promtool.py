"""The rendered /metrics of a full fake round passes `promtool check metrics`."""

from __future__ import annotations

import shutil
import subprocess

import pynvml
import pytest

from agent.contracts.model import Collection
from collectors.gpu.collector import GpuSettings
from collectors.gpu.metrics import FAMILIES
from exporters.exposition import render
from tests.support.nvml import GpuRig
from tests.support.nvml_fake import FakeFabric, FakeGpu, FakeNvml, FakeProcess
from tests.test_gpu_pci import TREES

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def exposition(collection: Collection) -> bytes:
    return render(FAMILIES, collection.samples)


def everything_gpu(index: int) -> FakeGpu:
    """A GPU that answers every field, NVLink and retired pages included (an A100-like one)."""
    gpu = FakeGpu.h200(
        index,
        nvlink_states=[1, 1],
        retired_pending=0,
        retired_pages={
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: [0x1000],
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [],
        },
    )
    for link in range(2):
        for counter in range(4):
            gpu.nvlink_errors[(link, counter)] = link + counter
    gpu.failures["nvmlDeviceGetPcieReplayCounter"] = pynvml.NVML_ERROR_UNKNOWN
    gpu.processes = [FakeProcess(1, 2**30)]  # pid 1 is in every /proc
    gpu.fabric = FakeFabric()
    gpu.gpm = {
        pynvml.NVML_GPM_METRIC_SM_UTIL: 50.0,
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 10.0,
    }
    return gpu


def mig_everything_gpu(index: int) -> FakeGpu:
    """A GPU in MIG mode whose instances give GPM activity and throughput."""
    gpm = {pynvml.NVML_GPM_METRIC_SM_UTIL: 40.0, pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 5.0}
    gpu = FakeGpu.h200(index, mig_mode=(1, 1), gpm=dict(gpm))
    gpu.add_mig(1, "1g.18gb", gpm=dict(gpm))
    gpu.add_mig(2, "1c.2g.35gb", compute_instance=0, gpm=dict(gpm))
    gpu.add_mig(2, "1c.2g.35gb", compute_instance=1)
    return gpu


@pytest.mark.skipif(not shutil.which(PROMTOOL), reason="promtool not installed")
class TestPromtool:
    """A full round renders to exposition text that promtool accepts, with every family used."""

    async def test_full_round(self) -> None:
        fake = FakeNvml([everything_gpu(0), mig_everything_gpu(1), FakeGpu.h200(2)])
        # The HGX tree has 8 GPUs on the bus: 5 that NVML does not see.
        settings = GpuSettings(
            expected_gpus=3, event_wait_ms=50, sysfs_root=str(TREES / "hgx-h200-8gpu")
        )
        rig = GpuRig(fake, settings=settings)
        try:
            await rig.collect(advance=settings.gpm_interval)  # GPM needs two samples
            fake.gpus[2].lost = True  # lost after it was identified: its address is known
            collection = await rig.collect()
        finally:
            await rig.close()
        text = exposition(collection)
        names = {s.family.name for s in collection.samples}
        assert names == {f.name for f in FAMILIES}, "a family the round never produced"
        result = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30, check=False
        )
        assert result.returncode == 0, (result.stdout + result.stderr).decode()
        assert b"gpuwarden_gpu_nvlink_errors_total{" in text
