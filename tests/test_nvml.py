"""The NVML backend over the fake library: the one error mapping, units, absent fields."""

from __future__ import annotations

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors._nvml import (
    CLOCK_EVENT_REASONS,
    GpuLost,
    NvmlBackend,
    NvmlError,
    NvmlUnavailable,
    decode_clock_event_reasons,
)
from tests.support.nvml_fake import FakeGpu, FakeNvml, FakeUtilization


def started(*gpus: FakeGpu) -> NvmlBackend:
    backend = NvmlBackend(FakeNvml(list(gpus)))
    backend.start()
    return backend


class CountFails(FakeNvml):
    """A FakeNvml whose nvmlDeviceGetCount raises `count_error` while it is set."""

    count_error: int | None = None

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise pynvml.NVMLError(self.count_error)
        return super().nvmlDeviceGetCount()


class TestErrorMapping:
    """Not supported is absent, lost is a state, a missing driver marks the backend down."""

    def test_not_supported_is_absent_not_zero(self) -> None:
        gpu = FakeGpu.h200(0)
        gpu.unsupported.add("nvmlDeviceGetPowerUsage")
        reading = started(gpu).read_gpu(0).reading
        assert reading.power_draw_watts is None
        assert reading.power_limit_watts == 700.0
        assert "power_draw" not in reading.errors

    def test_lost_gpu_raises_gpu_lost(self) -> None:
        gpu = FakeGpu.h200(0, lost=True)
        with pytest.raises(GpuLost) as caught:
            started(gpu).read_gpu(0)
        assert caught.value.code == pynvml.NVML_ERROR_GPU_IS_LOST

    def test_unexpected_error_is_a_field_error(self) -> None:
        gpu = FakeGpu.h200(0)
        gpu.failures["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_UNKNOWN
        reading = started(gpu).read_gpu(0).reading
        assert reading.temperature_gpu_celsius is None
        assert "Unknown" in reading.errors["temperature_gpu"]

    def test_driver_missing_at_init(self) -> None:
        backend = NvmlBackend(
            FakeNvml([FakeGpu.h200(0)], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        )
        with pytest.raises(NvmlUnavailable) as caught:
            backend.start()
        assert caught.value.code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
        assert not backend.up

    def test_init_is_retried_once_the_driver_loads(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0)], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        backend = NvmlBackend(fake)
        with pytest.raises(NvmlUnavailable):
            backend.start()
        fake.init_error = None
        backend.start()
        assert backend.up
        assert backend.device_count() == 1

    def test_driver_gone_mid_run_marks_backend_down(self) -> None:
        gpu = FakeGpu.h200(0)
        backend = started(gpu)
        gpu.failures["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
        with pytest.raises(NvmlUnavailable):
            backend.read_gpu(0)
        assert not backend.up
        with pytest.raises(NvmlUnavailable):
            backend.device_count()

    def test_failed_device_count_is_an_error_not_zero(self) -> None:
        fake = CountFails([FakeGpu.h200(i) for i in range(8)])
        fake.count_error = pynvml.NVML_ERROR_UNKNOWN
        backend = NvmlBackend(fake)
        backend.start()
        with pytest.raises(NvmlError, match="nvmlDeviceGetCount"):
            backend.device_count()
        assert backend.up  # one failed call, not a missing driver
        fake.count_error = None
        assert backend.device_count() == 8


class TestReadings:
    """Readings come in base units; Hopper's unsupported fields are absent."""

    def test_units(self) -> None:
        gpu = FakeGpu.h200(0, power_mw=123_450, utilization=FakeUtilization(50, 25))
        result = started(gpu).read_gpu(0, static=True, slow=True, energy=True)
        r = result.reading
        assert r.power_draw_watts == 123.45
        assert r.sm_clock_hertz == 345e6
        assert r.memory_clock_hertz == 3201e6
        assert r.utilization_gpu_ratio == 0.5
        assert r.utilization_memory_ratio == 0.25
        assert r.memory_total_bytes == 143771 * 2**20
        assert r.memory_reserved_bytes == 616 * 2**20
        assert r.temperature_memory_celsius == 35.0
        assert r.energy_joules == 1000.0
        assert result.static is not None
        assert result.static.sm_clock_max_hertz == 1980e6

    def test_static_facts(self) -> None:
        static = started(FakeGpu.h200(0)).read_gpu(0, static=True).static
        assert static is not None
        assert static.identity.pci_bus_id == "0000:18:00.0"
        assert static.driver_version == "580.159.04"
        assert static.compute_capability == "9.0"
        assert static.mig_mode is False
        assert static.ecc_mode is True
        assert static.temperature_shutdown_celsius == 92.0

    def test_hopper_has_no_retired_pages_and_no_nvlink(self) -> None:
        slow = started(FakeGpu.h200(0)).read_gpu(0, slow=True).slow
        assert slow is not None
        assert slow.retired_pages_single_bit is None
        assert slow.retired_pages_pending is None
        assert slow.nvlinks == ()
        assert dict(slow.errors) == {}

    def test_nvlinks_enumerated_until_the_last_link(self) -> None:
        gpu = FakeGpu.h200(0, nvlink_states=[1, 1, 0])
        gpu.nvlink_errors[(1, pynvml.NVML_NVLINK_ERROR_DL_REPLAY)] = 7
        slow = started(gpu).read_gpu(0, slow=True).slow
        assert slow is not None
        assert [(link.link, link.up) for link in slow.nvlinks] == [(0, True), (1, True), (2, False)]
        assert slow.nvlinks[1].errors == {"replay": 7}
        assert slow.nvlinks[0].errors == {}

    def test_memory_info_v1_fallback(self) -> None:
        gpu = FakeGpu.h200(0)
        calls: list[int | None] = []
        fake = FakeNvml([gpu])
        original = fake.nvmlDeviceGetMemoryInfo

        def v1_only(handle: FakeGpu, version: int | None = None) -> object:
            calls.append(version)
            if version is not None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return original(handle)

        fake.nvmlDeviceGetMemoryInfo = v1_only  # type: ignore[method-assign,assignment]
        backend = NvmlBackend(fake)
        backend.start()
        reading = backend.read_gpu(0).reading
        assert calls == [pynvml.nvmlMemory_v2, None]
        assert reading.memory_total_bytes == 143771 * 2**20


class TestHelpers:
    """The plain methods the benchmark uses for identity and idle gating."""

    def test_gpus_lists_identities_and_skips_lost(self) -> None:
        lost = FakeGpu.h200(1, lost=True)
        backend = started(FakeGpu.h200(0), lost, FakeGpu.h200(2))
        gpus = backend.gpus()
        assert [g.index for g in gpus] == [0, 2]
        assert gpus[1].pci_bus_id == "0000:38:00.0"
        assert gpus[0].labels()["model"] == "NVIDIA H200"

    def test_process_count_and_utilization(self) -> None:
        backend = started(FakeGpu.h200(0, processes=3, utilization=FakeUtilization(90, 40)))
        assert backend.compute_process_count(0) == 3
        assert backend.utilization(0) == (0.9, 0.4)


class TestClockEventReasons:
    """The reasons bit mask decodes into one flag per known reason."""

    def test_idle(self) -> None:
        decoded = decode_clock_event_reasons(0x1)
        assert decoded["gpu_idle"] is True
        assert sum(decoded.values()) == 1

    @given(st.integers(min_value=0, max_value=2**64 - 1))
    def test_any_mask(self, mask: int) -> None:
        decoded = decode_clock_event_reasons(mask)
        assert set(decoded) == set(CLOCK_EVENT_REASONS)
        for name, bit in CLOCK_EVENT_REASONS.items():
            assert decoded[name] == bool(mask & bit)


class TestHandles:
    """A GPU's handle is looked up once per nvmlInit (the lookup is a driver call each round
    would repeat), and again after what can change it: NVML shut and started again, or the
    GPU lost."""

    def test_looked_up_once_across_rounds(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0), FakeGpu.h200(1)])
        backend = NvmlBackend(fake)
        backend.start()
        for _ in range(5):
            for index in (0, 1):
                backend.read_gpu(index, static=True, slow=True)
        assert fake.lib_calls["nvmlDeviceGetHandleByIndex"] == 2

    def test_looked_up_again_after_a_restart_of_nvml(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0)])
        backend = NvmlBackend(fake)
        backend.start()
        before = backend.read_gpu(0, static=True)
        fake.gpus[0] = FakeGpu.h200(0, uuid="GPU-swapped")  # NVML numbers the GPUs at init
        backend.stop()
        backend.start()
        after = backend.read_gpu(0, static=True)
        assert fake.lib_calls["nvmlDeviceGetHandleByIndex"] == 2
        assert before.static is not None and after.static is not None
        assert after.static.identity.uuid == "GPU-swapped" != before.static.identity.uuid

    def test_looked_up_again_after_the_gpu_was_lost(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0)])
        backend = NvmlBackend(fake)
        backend.start()
        backend.read_gpu(0)
        fake.gpus[0].lost = True
        with pytest.raises(GpuLost):
            backend.read_gpu(0)
        fake.gpus[0] = FakeGpu.h200(0)  # NVML's handle of the index once the GPU is back
        backend.read_gpu(0)
        assert fake.lib_calls["nvmlDeviceGetHandleByIndex"] == 2

    def test_looked_up_again_when_the_count_changes(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0), FakeGpu.h200(2)])
        backend = NvmlBackend(fake)
        backend.start()
        assert backend.device_count() == 2
        backend.read_gpu(1, static=True)
        fake.gpus.insert(1, FakeGpu.h200(1, uuid="GPU-came-up"))  # index 1 is another GPU now
        assert backend.device_count() == 3
        round_ = backend.read_gpu(1, static=True)
        assert round_.static is not None and round_.static.identity.uuid == "GPU-came-up"


class TestLinkWidth:
    """The current PCIe link width is read with the slow reads (the link trains again only
    after a reset or a fault, and its read is a round's costliest); every round reports the
    last one, with its read's error."""

    def test_read_on_slow_rounds_only(self) -> None:
        gpu = FakeGpu.h200(0)
        fake = FakeNvml([gpu])
        backend = NvmlBackend(fake)
        backend.start()
        assert backend.read_gpu(0, static=True, slow=True).reading.pcie_width == 16
        gpu.pcie_width = (8, 16)
        for _ in range(3):
            assert backend.read_gpu(0).reading.pcie_width == 16
        assert gpu.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 1
        assert backend.read_gpu(0, slow=True).reading.pcie_width == 8
        assert backend.read_gpu(0).reading.pcie_width == 8
        assert gpu.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 2

    def test_a_failed_read_keeps_its_error_until_the_next(self) -> None:
        gpu = FakeGpu.h200(
            0, failures={"nvmlDeviceGetCurrPcieLinkWidth": pynvml.NVML_ERROR_UNKNOWN}
        )
        backend = NvmlBackend(FakeNvml([gpu]))
        backend.start()
        first = backend.read_gpu(0, slow=True).reading
        later = backend.read_gpu(0).reading
        assert first.pcie_width is None and later.pcie_width is None
        assert (
            "pcie_width" in first.errors
            and later.errors["pcie_width"] == first.errors["pcie_width"]
        )
        gpu.failures.clear()
        assert backend.read_gpu(0, slow=True).reading.errors.get("pcie_width") is None
        assert "pcie_width" not in backend.read_gpu(0).reading.errors

    def test_read_again_after_the_gpu_was_lost_or_nvml_restarted(self) -> None:
        gpu = FakeGpu.h200(0)
        fake = FakeNvml([gpu])
        backend = NvmlBackend(fake)
        backend.start()
        backend.read_gpu(0, slow=True)
        gpu.lost = True
        with pytest.raises(GpuLost):
            backend.read_gpu(0)
        gpu.lost, gpu.pcie_width = False, (4, 16)
        assert backend.read_gpu(0).reading.pcie_width == 4  # after the loss: read again
        gpu.pcie_width = (2, 16)
        backend.stop()
        backend.start()
        assert backend.read_gpu(0).reading.pcie_width == 2
