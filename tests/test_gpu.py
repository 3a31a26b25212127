"""The gpu collector over the fake NVML: telemetry, failures, counters, conditions, GPU count."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pynvml
import pytest

from agent.contracts.collector import MemoryKeyValueStore
from agent.contracts.model import Severity
from agent.program import config_file
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._nvml import CLOCK_EVENT_REASONS, GpuReading, NvmlBackend, NvmlError
from collectors.gpu import collector as gpu_collector
from collectors.gpu.checks import COUNTERS_NAMESPACE, FAST_COUNTERS, CounterTracker, counter_events
from collectors.gpu.collector import GpuSettings
from tests.support.disk import SmallDisk
from tests.support.nvml import GpuRig, fake_gpus, find, kinds, value
from tests.support.nvml_fake import FakeGpu, FakeNvml, FakeUtilization
from tests.support.waiting import until
from tests.test_nvml import CountFails

CORRECTED_VOLATILE = (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
UNCORRECTED_VOLATILE = (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)


@pytest.fixture
async def rig() -> AsyncIterator[GpuRig]:
    instance = GpuRig(FakeNvml(fake_gpus(2)))
    yield instance
    await instance.close()


class TestNoDriver:
    """No driver: the collector succeeds, says so once, and retries nvmlInit later."""

    async def test_reports_once_and_succeeds(self) -> None:
        fake = FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        rig = GpuRig(fake, settings=GpuSettings(event_thread=False, nvml_retry_interval=60.0))
        try:
            first = await rig.collect(advance=10)
            assert kinds(first) == ["nvml_unavailable"]
            assert first.events[0].severity is Severity.WARNING
            assert "no NVIDIA driver" in first.events[0].message
            assert value(first, "gpuwarden_nvml_up") == 0
            for _ in range(10):
                later = await rig.collect(advance=10)
                assert kinds(later) == []
                assert value(later, "gpuwarden_nvml_up") == 0
            assert fake.init_calls == 2  # at 0 s and at 60 s, not every round
        finally:
            await rig.close()

    async def test_critical_when_gpus_are_expected(self) -> None:
        fake = FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        rig = GpuRig(fake, settings=GpuSettings(event_thread=False, expected_gpus=8))
        try:
            first = await rig.collect()
            assert first.events[0].severity is Severity.CRITICAL
            assert "8 are expected" in first.events[0].message
        finally:
            await rig.close()

    async def test_driver_appears_later(self) -> None:
        fake = FakeNvml(fake_gpus(1), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        rig = GpuRig(fake, settings=GpuSettings(event_thread=False, nvml_retry_interval=30.0))
        try:
            await rig.collect(advance=30)
            fake.init_error = None
            back = await rig.collect()
            assert kinds(back) == ["nvml_available"]
            assert value(back, "gpuwarden_nvml_up") == 1
            assert value(back, "gpuwarden_gpus_visible") == 1
        finally:
            await rig.close()

    async def test_driver_unloaded_mid_run(self, rig: GpuRig) -> None:
        await rig.collect()
        for gpu in rig.fake.gpus:  # the driver is gone: the lookup and the round's first read fail
            for call in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUtilizationRates"):
                gpu.failures[call] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
        down = await rig.collect()
        assert kinds(down) == ["nvml_unavailable"]
        assert value(down, "gpuwarden_nvml_up") == 0
        assert find(down, "gpuwarden_gpu_temperature_celsius") == []


class TestTelemetry:
    """Every per-GPU series carries the GPU labels; absent fields have no sample."""

    async def test_labels_and_values(self, rig: GpuRig) -> None:
        result = await rig.collect()
        labels = {
            "gpu": "1",
            "uuid": rig.fake.gpus[1].uuid,
            "pci_bus_id": "0000:28:00.0",
            "model": "NVIDIA H200",
        }
        assert value(result, "gpuwarden_gpu_temperature_celsius", sensor="gpu", **labels) == 33
        assert value(result, "gpuwarden_gpu_power_limit_watts", **labels) == 700
        assert value(result, "gpuwarden_gpu_up", **labels) == 1
        assert value(result, "gpuwarden_gpus_visible") == 2
        info = find(result, "gpuwarden_gpu_info", **labels)
        assert info[0].labels["driver_version"] == "580.159.04"
        assert info[0].labels["mig_mode"] == "disabled"
        assert value(result, "gpuwarden_gpu_pcie_link_width_lanes", which="max", **labels) == 16

    async def test_unsupported_is_absent(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].unsupported.add("nvmlDeviceGetPowerUsage")
        result = await rig.collect()
        assert len(find(result, "gpuwarden_gpu_power_watts")) == 1
        assert find(result, "gpuwarden_gpu_power_watts", gpu="0") == []
        assert find(result, "gpuwarden_gpu_retired_pages_total") == []
        assert find(result, "gpuwarden_gpu_field_error") == []

    async def test_field_error_is_its_own_series(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].failures["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_UNKNOWN
        result = await rig.collect()
        assert value(result, "gpuwarden_gpu_field_error", gpu="0", field="power_draw") == 1
        assert find(result, "gpuwarden_gpu_power_watts", gpu="0") == []

    async def test_throttle_reasons_one_series_each(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].clock_event_reasons = (
            CLOCK_EVENT_REASONS["sw_power_cap"] | CLOCK_EVENT_REASONS["hw_thermal_slowdown"]
        )
        result = await rig.collect()
        series = find(result, "gpuwarden_gpu_clock_event_active", gpu="0")
        assert len(series) == len(CLOCK_EVENT_REASONS)
        active = {s.labels["reason"] for s in series if s.value == 1}
        assert active == {"sw_power_cap", "hw_thermal_slowdown"}
        assert "hardware_slowdown" in kinds(result)

    async def test_slow_reads_on_their_interval(self) -> None:
        rig = GpuRig(
            FakeNvml(fake_gpus(1)),
            settings=GpuSettings(
                event_thread=False,
                slow_interval=60.0,
                static_refresh_interval=600.0,
                energy_interval=100.0,
            ),
        )
        try:
            for _ in range(12):  # 120 s at a 10 s interval
                result = await rig.collect(advance=10)
                assert value(result, "gpuwarden_gpu_energy_joules_total") == 1000.0
            calls = rig.fake.gpus[0].calls
            assert calls["nvmlDeviceGetTotalEnergyConsumption"] == 2  # at 0 s and 100 s
            assert calls["nvmlDeviceGetPcieReplayCounter"] == 2  # at 0 s and 60 s
            assert calls["nvmlDeviceGetSerial"] == 1
            assert calls["nvmlDeviceGetTemperature"] == 12
        finally:
            await rig.close()


class TestLostGpu:
    """A lost GPU is a critical event once, its own series, and the others keep reporting."""

    async def test_lost_mid_run(self, rig: GpuRig) -> None:
        await rig.collect()
        rig.fake.gpus[1].lost = True
        lost = await rig.collect()
        assert kinds(lost) == ["gpu_lost"]
        event = lost.events[0]
        assert event.severity is Severity.CRITICAL
        assert "Xid 79" in event.action
        assert event.subject == rig.fake.gpus[1].uuid
        assert value(lost, "gpuwarden_gpu_up", gpu="1") == 0
        assert value(lost, "gpuwarden_gpu_error", gpu="1", reason="lost") == 1
        assert find(lost, "gpuwarden_gpu_temperature_celsius", gpu="1") == []
        assert value(lost, "gpuwarden_gpu_temperature_celsius", gpu="0", sensor="gpu") == 33
        again = await rig.collect()
        assert kinds(again) == []
        rig.fake.gpus[1].lost = False
        back = await rig.collect()
        assert kinds(back) == ["gpu_recovered"]
        assert value(back, "gpuwarden_gpu_up", gpu="1") == 1


class TestHungGpu:
    """A hung GPU is reported, not called again while hung, and does not blank the others."""

    async def test_hang(self) -> None:
        rig = GpuRig(FakeNvml(fake_gpus(2)), timeout=0.3)
        release = threading.Event()
        try:
            await rig.collect()
            hung = rig.fake.gpus[1]
            hung.hang = release
            first = await rig.collect()
            assert kinds(first) == ["gpu_unresponsive"]
            assert value(first, "gpuwarden_gpu_error", gpu="1", reason="unresponsive") == 1
            assert value(first, "gpuwarden_gpu_temperature_celsius", gpu="0", sensor="gpu") == 33
            calls_while_hung = sum(hung.calls.values())
            second = await rig.collect()
            assert sum(hung.calls.values()) == calls_while_hung  # not called on top of itself
            assert kinds(second) == []
            assert value(second, "gpuwarden_gpu_up", gpu="1") == 0
            assert value(second, "gpuwarden_gpu_up", gpu="0") == 1
            hung.hang = None
            release.set()
            for _ in range(50):  # the hung call returns in its own thread
                if "nvml:gpu1" not in rig.caller.hung:
                    break
                await asyncio.sleep(0.02)
            back = await rig.collect()
            assert kinds(back) == ["gpu_recovered"]
        finally:
            release.set()
            await rig.close()


class TestCounters:
    """Events fire on increases with the delta; restarts and resets never fake an increase."""

    async def test_increase_event_with_delta(self, rig: GpuRig) -> None:
        await rig.collect()
        rig.fake.gpus[0].ecc[UNCORRECTED_VOLATILE] = 3
        result = await rig.collect()
        assert kinds(result) == ["ecc_uncorrected_volatile_increase"]
        event = result.events[0]
        assert event.severity is Severity.CRITICAL
        assert event.attributes["delta"] == 3
        assert event.subject == rig.fake.gpus[0].uuid
        assert kinds(await rig.collect()) == []

    async def test_nonzero_at_first_sight_is_history(self) -> None:
        gpu = FakeGpu.h200(0)
        gpu.ecc[CORRECTED_VOLATILE] = 50
        rig = GpuRig(FakeNvml([gpu]))
        try:
            assert kinds(await rig.collect()) == []
        finally:
            await rig.close()

    async def test_restart_neither_realerts_nor_forgets(self) -> None:
        state = MemoryKeyValueStore()
        rig = GpuRig(FakeNvml(fake_gpus(1)), state=state)
        try:
            await rig.collect()
            rig.fake.gpus[0].remapped_rows = (0, 2, 0, 0)
            assert kinds(await rig.collect()) == ["remapped_rows_uncorrectable_increase"]
            await rig.restart()
            assert kinds(await rig.collect()) == []
            rig.fake.gpus[0].remapped_rows = (0, 3, 0, 0)
            await rig.restart()
            result = await rig.collect()
            assert kinds(result) == ["remapped_rows_uncorrectable_increase"]
            assert result.events[0].attributes["delta"] == 1
        finally:
            await rig.close()

    async def test_restart_with_the_sqlite_store(self, tmp_path: Path) -> None:
        store = StateStore.open(tmp_path)
        rig = GpuRig(FakeNvml(fake_gpus(1)), state=store)
        try:
            rig.fake.gpus[0].ecc[UNCORRECTED_VOLATILE] = 1
            rig.fake.gpus[0].remapped_rows = (0, 0, 1, 0)
            assert kinds(await rig.collect()) == ["row_remap_pending"]
            await rig.close()
            store.close()
            rig.fake.gpus[0].ecc[UNCORRECTED_VOLATILE] = 4  # while the agent was down
            store = StateStore.open(tmp_path)
            rig = GpuRig(rig.fake, state=store)
            result = await rig.collect()
            assert kinds(result) == ["ecc_uncorrected_volatile_increase"]  # not the remap again
            assert result.events[0].attributes["delta"] == 3
            assert kinds(await rig.collect()) == []
        finally:
            await rig.close()
            store.close()

    async def test_reset_is_a_new_baseline(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].ecc[CORRECTED_VOLATILE] = 10
        await rig.collect()
        rig.fake.gpus[0].ecc[CORRECTED_VOLATILE] = 0  # driver reload
        reset = await rig.collect()
        assert kinds(reset) == ["counter_reset"]
        assert reset.events[0].severity is Severity.INFO
        rig.fake.gpus[0].ecc[CORRECTED_VOLATILE] = 2
        again = await rig.collect()
        assert kinds(again) == ["ecc_corrected_volatile_increase"]
        assert again.events[0].attributes["delta"] == 2

    async def test_errors_since_a_reset_are_an_increase(self) -> None:
        state = MemoryKeyValueStore()
        rig = GpuRig(FakeNvml(fake_gpus(1)), state=state)
        try:
            rig.fake.gpus[0].ecc[UNCORRECTED_VOLATILE] = 5
            await rig.collect()
            rig.fake.gpus[0].ecc[UNCORRECTED_VOLATILE] = 2  # reboot, then 2 new errors
            await rig.restart()
            result = await rig.collect()
            assert kinds(result) == ["counter_reset", "ecc_uncorrected_volatile_increase"]
            increase = result.events[1]
            assert increase.severity is Severity.CRITICAL
            assert increase.attributes["delta"] == 2
            assert kinds(await rig.collect()) == []
        finally:
            await rig.close()

    def test_reboot_is_a_reset_even_when_the_value_is_higher(self) -> None:
        state = MemoryKeyValueStore()
        labels = {"gpu": "0", "uuid": "GPU-1", "pci_bus_id": "0000:3b:00.0", "model": "H200"}
        before = CounterTracker(state, boot_id="boot-1")
        counter_events(before, labels, GpuReading(ecc_uncorrected_volatile=2), FAST_COUNTERS)
        after = CounterTracker(state, boot_id="boot-2")  # 7 errors since the reboot
        events = counter_events(
            after, labels, GpuReading(ecc_uncorrected_volatile=7), FAST_COUNTERS
        )
        assert kinds(events) == ["counter_reset", "ecc_uncorrected_volatile_increase"]
        assert events[1].attributes["delta"] == 7
        again = CounterTracker(state, boot_id="boot-2")  # a restart within the same boot
        events = counter_events(
            again, labels, GpuReading(ecc_uncorrected_volatile=9), FAST_COUNTERS
        )
        assert kinds(events) == ["ecc_uncorrected_volatile_increase"]
        assert events[0].attributes["delta"] == 2

    def test_value_stored_without_a_boot_id_is_still_read(self) -> None:
        state = MemoryKeyValueStore()
        state.put("gpu.counters", "GPU-1/ecc_uncorrected_volatile", 2)  # an older agent's
        labels = {"gpu": "0", "uuid": "GPU-1", "pci_bus_id": "", "model": ""}
        tracker = CounterTracker(state, boot_id="boot-1")
        events = counter_events(
            tracker, labels, GpuReading(ecc_uncorrected_volatile=3), FAST_COUNTERS
        )
        assert [e.attributes["delta"] for e in events] == [1]
        assert state.get("gpu.counters", "GPU-1/ecc_uncorrected_volatile") == [3, "boot-1"]

    async def test_lower_inforom_count_is_no_increase(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].remapped_rows = (0, 3, 0, 0)
        await rig.collect()
        rig.fake.gpus[0].remapped_rows = (0, 1, 0, 0)  # not volatile: nothing new in that
        assert kinds(await rig.collect()) == ["counter_reset"]

    async def test_slow_counter(self) -> None:
        rig = GpuRig(
            FakeNvml(fake_gpus(1)), settings=GpuSettings(event_thread=False, slow_interval=10.0)
        )
        try:
            await rig.collect()
            rig.fake.gpus[0].pcie_replays = 5
            result = await rig.collect()
            assert kinds(result) == ["pcie_replays_increase"]
            assert value(result, "gpuwarden_gpu_pcie_replays_total") == 5
        finally:
            await rig.close()


class TestStoreFailure:
    """A state store that cannot write costs no GPU round. With 8 GPUs on a full disk every
    round keeps every GPU's series; a counter increase meanwhile is reported once, and its
    new baseline is stored once there is room."""

    async def test_eight_gpus_on_a_full_disk(self, tmp_path: Path) -> None:
        fake = FakeNvml(fake_gpus(8))
        with SmallDisk(tmp_path / "disk") as disk:
            store = StateStore.open(disk.path / "state")
            cfg = dataclasses.replace(
                config_file.parse({"prometheus": {"enabled": False}}),
                collectors={"gpu": GpuSettings(interval=0.1, event_thread=False)},
            )
            runtime = Runtime(cfg, store, collectors={"gpu": gpu_collector.SPEC}, sinks={})
            backend = NvmlBackend(fake)
            runtime.shared.put(NvmlBackend, backend)
            await runtime.start()
            try:
                status = runtime.collectors["gpu"]
                await until(lambda: status.rounds_done >= 1, what="the baseline round")
                disk.fill(store)
                fake.gpus[3].ecc[UNCORRECTED_VOLATILE] = 2
                done = status.rounds_done
                await until(lambda: status.rounds_done >= done + 4, what="four rounds")
                assert status.failures == 0, status.last_error
                up = [s for s in status.samples if s.family.name == "gpuwarden_gpu_up"]
                assert len(up) == 8
                increases = [
                    e
                    for e in runtime.recent_events
                    if e.kind == "ecc_uncorrected_volatile_increase"
                ]
                assert [e.attributes["delta"] for e in increases] == [2]
                assert store.write_failures > 0
                key = f"{fake.gpus[3].uuid}/ecc_uncorrected_volatile"
                disk.free()

                def stored() -> object:
                    value = store.items(COUNTERS_NAMESPACE).get(key)
                    return value[0] if isinstance(value, list) else value

                await until(lambda: stored() == 2, what="the new baseline stored")
            finally:
                await runtime.stop()
                backend.stop()
                store.close()


class TestConditions:
    """Conditions raise one event when they start and one when they end, across restarts."""

    async def test_row_remap_pending_and_failure(self, rig: GpuRig) -> None:
        await rig.collect()
        rig.fake.gpus[0].remapped_rows = (0, 0, 1, 0)
        pending = await rig.collect()
        assert kinds(pending) == ["row_remap_pending"]
        assert pending.events[0].action
        assert kinds(await rig.collect()) == []
        rig.fake.gpus[0].remapped_rows = (0, 0, 0, 1)
        failed = await rig.collect()
        assert sorted(kinds(failed)) == ["row_remap_failure", "row_remap_pending_cleared"]
        failure = next(e for e in failed.events if e.kind == "row_remap_failure")
        assert failure.severity is Severity.CRITICAL
        assert value(failed, "gpuwarden_gpu_row_remap_failure", gpu="0") == 1

    async def test_condition_survives_restart(self) -> None:
        rig = GpuRig(FakeNvml(fake_gpus(1)))
        try:
            rig.fake.gpus[0].remapped_rows = (0, 0, 1, 0)
            assert kinds(await rig.collect()) == ["row_remap_pending"]
            await rig.restart()
            assert kinds(await rig.collect()) == []
        finally:
            await rig.close()

    async def test_pcie_narrow_link(self, rig: GpuRig) -> None:
        rig.fake.gpus[1].pcie_width = (8, 16)
        result = await rig.collect()
        assert kinds(result) == ["pcie_link_degraded"]
        assert "x8 of x16" in result.events[0].message

    async def test_pcie_low_generation_only_counts_when_busy(self, rig: GpuRig) -> None:
        gpu = rig.fake.gpus[0]
        gpu.pcie_generation = (1, 5)  # idle GPUs lower the link speed to save power
        assert kinds(await rig.collect()) == []
        gpu.clock_event_reasons = 0
        gpu.utilization = FakeUtilization(95, 60)
        busy = await rig.collect()
        assert kinds(busy) == ["pcie_link_degraded"]
        gpu.pcie_generation = (5, 5)
        assert kinds(await rig.collect()) == ["pcie_link_degraded_cleared"]


class TestGpuCount:
    """Fewer GPUs than expected, or than at the last start, is critical."""

    async def test_expected_gpus(self) -> None:
        rig = GpuRig(
            FakeNvml(fake_gpus(2)), settings=GpuSettings(event_thread=False, expected_gpus=4)
        )
        try:
            first = await rig.collect()
            assert kinds(first) == ["gpus_missing"]
            assert first.events[0].severity is Severity.CRITICAL
            assert value(first, "gpuwarden_gpus_expected") == 4
            assert kinds(await rig.collect()) == []
        finally:
            await rig.close()

    async def test_failed_count_fails_the_round_not_zero_gpus(self) -> None:
        rig = GpuRig(CountFails(fake_gpus(8)))
        try:
            # The count is read on the slow interval: let one pass before the failing read.
            slow = rig.collector.settings.slow_interval
            assert value(await rig.collect(advance=slow), "gpuwarden_gpus_visible") == 8
            assert isinstance(rig.fake, CountFails)
            rig.fake.count_error = pynvml.NVML_ERROR_UNKNOWN
            with pytest.raises(NvmlError, match="nvmlDeviceGetCount"):
                await rig.collect()
            rig.fake.count_error = None
            assert kinds(await rig.collect()) == []  # no gpu_count_dropped, no state lost
        finally:
            await rig.close()

    async def test_fewer_than_at_last_start(self) -> None:
        state = MemoryKeyValueStore()
        rig = GpuRig(FakeNvml(fake_gpus(4)), state=state)
        try:
            assert kinds(await rig.collect()) == []
            del rig.fake.gpus[3]
            await rig.restart()
            dropped = await rig.collect()
            assert kinds(dropped) == ["gpu_count_dropped"]
            assert dropped.events[0].attributes == {"visible": 3, "before": 4}
            await rig.restart()
            again = await rig.collect()  # still missing: not forgotten at the next start
            assert kinds(again) == ["gpu_count_dropped"]
            assert again.events[0].attributes == {"visible": 3, "before": 4}
            rig.fake.gpus.append(FakeGpu.h200(3))
            await rig.restart()
            assert kinds(await rig.collect()) == []
        finally:
            await rig.close()

    async def test_expected_gpus_sets_the_count_explicitly(self) -> None:
        state = MemoryKeyValueStore()
        rig = GpuRig(FakeNvml(fake_gpus(4)), state=state)
        try:
            await rig.collect()
            del rig.fake.gpus[3]  # removed on purpose: the operator says so
            rig.settings = GpuSettings(event_thread=False, expected_gpus=3)
            await rig.restart()
            assert kinds(await rig.collect()) == []
            rig.settings = GpuSettings(event_thread=False)
            await rig.restart()
            assert kinds(await rig.collect()) == []  # 3 is now the count to keep
        finally:
            await rig.close()
