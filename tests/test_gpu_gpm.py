"""GPM (Hopper and later): SM activity, SM occupancy, tensor activity, DRAM bandwidth, PCIe and
NVLink throughput, between two samples taken a `gpm_interval` apart.

The collector never sleeps between the two samples: it keeps the previous round's sample and
computes the metrics against it, so the first GPM round gives no value and each later one the
average since the last. Absent where GPM is not supported; read on its own interval.
"""

from __future__ import annotations

import pynvml
import pytest

from collectors.gpu.collector import GpuSettings
from tests.support.nvml import GpuRig, fake_gpus, find, value
from tests.support.nvml_fake import FakeNvml

MiB = 2**20


def activity(result: object, gpu: str, metric: str) -> float | None:
    return value(result, "gpuwarden_gpu_activity_ratio", gpu=gpu, metric=metric)  # type: ignore[arg-type]


def busy(fake: FakeNvml, index: int) -> None:
    fake.gpus[index].gpm = {
        pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 99.0,
        pynvml.NVML_GPM_METRIC_SM_UTIL: 80.0,
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 40.0,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 60.0,
        pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 25.0,
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 100.0,
        pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 200.0,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 300.0,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 400.0,
    }


def gpm_rig(gpus: int = 2, interval: float = 30.0) -> GpuRig:
    fake = FakeNvml(fake_gpus(gpus))
    for index in range(gpus):
        busy(fake, index)
    return GpuRig(fake, settings=GpuSettings(event_thread=False, gpm_interval=interval))


class TestGpm:
    async def test_two_samples_apart_in_time(self) -> None:
        rig = gpm_rig()
        try:
            first = await rig.collect(advance=30)
            second = await rig.collect(advance=30)
        finally:
            await rig.close()
        assert find(first, "gpuwarden_gpu_activity_ratio") == []  # one sample: nothing yet
        assert activity(second, "0", "sm_active") == pytest.approx(0.80)
        assert activity(second, "0", "sm_occupancy") == pytest.approx(0.40)
        assert activity(second, "0", "tensor_active") == pytest.approx(0.60)
        assert activity(second, "0", "dram_active") == pytest.approx(0.25)
        assert activity(second, "0", "graphics_active") == pytest.approx(0.99)
        throughput = {
            (s.labels["bus"], s.labels["direction"]): s.value
            for s in find(second, "gpuwarden_gpu_throughput_bytes_per_second", gpu="1")
        }
        assert throughput == {
            ("pcie", "tx"): 100 * MiB,
            ("pcie", "rx"): 200 * MiB,
            ("nvlink", "tx"): 300 * MiB,
            ("nvlink", "rx"): 400 * MiB,
        }

    async def test_each_interval_against_the_previous_sample(self) -> None:
        rig = gpm_rig(gpus=1)
        try:
            for _ in range(5):
                await rig.collect(advance=30)
            gpu = rig.fake.gpus[0]
            # one sample per GPM round (never two in one round: no sleeping), two buffers only
            assert gpu.calls["nvmlGpmSampleGet"] == 5
            assert gpu.calls["nvmlGpmMetricsGet"] == 4
            assert rig.fake.gpm_samples_live <= 2
        finally:
            await rig.close()
            rig.backend.stop()
        assert rig.fake.gpm_samples_live == 0  # freed at stop

    async def test_own_interval_cached_between(self) -> None:
        rig = gpm_rig(gpus=1, interval=60.0)
        try:
            results = [await rig.collect(advance=10) for _ in range(8)]
        finally:
            await rig.close()
        assert rig.fake.gpus[0].calls["nvmlGpmSampleGet"] == 2  # at 0 s and at 60 s
        # between GPM reads the last values are served, not dropped
        assert activity(results[6], "0", "sm_active") == pytest.approx(0.80)
        assert activity(results[7], "0", "sm_active") == pytest.approx(0.80)

    async def test_values_change_with_the_load(self) -> None:
        rig = gpm_rig(gpus=1)
        try:
            await rig.collect(advance=30)
            await rig.collect(advance=30)
            rig.fake.gpus[0].gpm = dict.fromkeys(rig.fake.gpus[0].gpm or {}, 0.0)
            idle = await rig.collect(advance=30)
        finally:
            await rig.close()
        assert activity(idle, "0", "sm_active") == 0

    async def test_unsupported_device_is_absent_and_not_asked_again(self) -> None:
        rig = gpm_rig(gpus=2)
        rig.fake.gpus[1].gpm = None  # an A100: GPM not supported
        try:
            results = [await rig.collect(advance=30) for _ in range(3)]
        finally:
            await rig.close()
        assert find(results[-1], "gpuwarden_gpu_activity_ratio", gpu="1") == []
        assert find(results[-1], "gpuwarden_gpu_throughput_bytes_per_second", gpu="1") == []
        assert find(results[-1], "gpuwarden_gpu_activity_ratio", gpu="0") != []
        assert rig.fake.gpus[1].calls["nvmlGpmSampleGet"] == 0
        assert rig.fake.gpus[1].calls["nvmlGpmQueryDeviceSupport"] == 1
        assert find(results[-1], "gpuwarden_gpu_field_error") == []

    async def test_one_unsupported_metric_is_absent(self) -> None:
        rig = gpm_rig(gpus=1)
        gpm = rig.fake.gpus[0].gpm
        assert gpm is not None
        del gpm[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC]  # no NVLink on a PCIe card
        try:
            await rig.collect(advance=30)
            result = await rig.collect(advance=30)
        finally:
            await rig.close()
        buses = {
            (s.labels["bus"], s.labels["direction"])
            for s in find(result, "gpuwarden_gpu_throughput_bytes_per_second")
        }
        assert ("nvlink", "tx") not in buses
        assert ("nvlink", "rx") in buses

    @pytest.mark.parametrize("odd", [float("nan"), float("inf"), -1.0])
    async def test_a_value_nvml_cannot_mean_is_absent(self, odd: float) -> None:
        """NVML answers SUCCESS with a value no activity can have (the GPM part of a GPU round
        failed on the lent H200, inside the samples): that one metric is absent, the round
        and every other series stand."""
        rig = gpm_rig(gpus=1)
        gpm = rig.fake.gpus[0].gpm
        assert gpm is not None
        gpm[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC] = odd
        gpm[pynvml.NVML_GPM_METRIC_SM_UTIL] = odd
        try:
            await rig.collect(advance=30)
            result = await rig.collect(advance=30)
        finally:
            await rig.close()
        assert activity(result, "0", "sm_active") is None
        assert activity(result, "0", "tensor_active") == pytest.approx(0.6)
        buses = {
            (s.labels["bus"], s.labels["direction"])
            for s in find(result, "gpuwarden_gpu_throughput_bytes_per_second")
        }
        assert ("nvlink", "tx") not in buses
        assert ("pcie", "rx") in buses

    @pytest.mark.parametrize("percent", [100.5, 377.0, 833.3])
    async def test_a_share_over_100_percent_is_absent_and_flagged(self, percent: float) -> None:
        """On the lent H200 a GPM window spanning a benchmark run gave tensor activity 833 %
        and DRAM activity 377 % (NVML documents 0-100): a share over the whole is no reading
        (the series would say the GPU was busier than busy). That metric is absent and named
        in the field errors; the rest of the round, and throughputs (not shares), stand."""
        rig = gpm_rig(gpus=1)
        gpm = rig.fake.gpus[0].gpm
        assert gpm is not None
        gpm[pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL] = percent
        gpm[pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL] = percent
        gpm[pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC] = 1000 * percent  # MiB/s: no ceiling
        try:
            await rig.collect(advance=30)
            result = await rig.collect(advance=30)
        finally:
            await rig.close()
        assert activity(result, "0", "tensor_active") is None
        assert activity(result, "0", "dram_active") is None
        assert activity(result, "0", "sm_active") == pytest.approx(0.80)
        flagged = {s.labels["field"] for s in find(result, "gpuwarden_gpu_field_error")}
        assert flagged == {"gpm_tensor_active", "gpm_dram_active"}
        rx = find(result, "gpuwarden_gpu_throughput_bytes_per_second", bus="pcie", direction="rx")
        assert [s.value for s in rx] == [pytest.approx(1000 * percent * MiB)]

    async def test_a_full_share_is_a_reading(self) -> None:
        rig = gpm_rig(gpus=1)
        gpm = rig.fake.gpus[0].gpm
        assert gpm is not None
        gpm[pynvml.NVML_GPM_METRIC_SM_UTIL] = 100.0
        try:
            await rig.collect(advance=30)
            result = await rig.collect(advance=30)
        finally:
            await rig.close()
        assert activity(result, "0", "sm_active") == pytest.approx(1.0)
        assert find(result, "gpuwarden_gpu_field_error") == []

    async def test_disabled_with_zero(self) -> None:
        rig = gpm_rig(gpus=1, interval=0.0)
        try:
            for _ in range(3):
                await rig.collect(advance=30)
        finally:
            await rig.close()
        assert rig.fake.gpus[0].calls["nvmlGpmQueryDeviceSupport"] == 0

    async def test_lost_gpu_mid_gpm(self) -> None:
        rig = gpm_rig(gpus=1)
        try:
            await rig.collect(advance=30)
            rig.fake.gpus[0].failures["nvmlGpmSampleGet"] = pynvml.NVML_ERROR_GPU_IS_LOST
            lost = await rig.collect(advance=30)
            del rig.fake.gpus[0].failures["nvmlGpmSampleGet"]
            await rig.collect(advance=30)
            back = await rig.collect(advance=30)
        finally:
            await rig.close()
        assert value(lost, "gpuwarden_gpu_up", gpu="0") == 0
        assert activity(back, "0", "sm_active") == pytest.approx(0.80)
