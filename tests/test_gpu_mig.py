"""MIG: per GPU instance series (memory, GPM), bounded to GPUs in MIG mode, and Xid and ECC
events that name the instance NVML attributed them to.

On the fake only: a lent GPU's MIG mode is never changed (tests/test_gpu_mig_real.py checks
on the H200, MIG off, that there are no instance series and the round stands).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import pynvml
import pytest

from agent.contracts.model import Collection, Event, Sample
from collectors._nvml import INSTANCE_ID_NONE, NvmlBackend, mig_profile
from collectors._xid import XidCorrelator, XidObservation
from collectors.gpu.collector import GpuSettings
from collectors.gpu.events import GpuEventThread
from tests.support.nvml import GpuRig, find, value
from tests.support.nvml_fake import FakeGpu, FakeNvml

GiB = 2**30
MIG_SERIES = (
    "gpuwarden_gpu_mig_device_info",
    "gpuwarden_gpu_mig_memory_total_bytes",
    "gpuwarden_gpu_mig_memory_used_bytes",
    "gpuwarden_gpu_mig_memory_free_bytes",
    "gpuwarden_gpu_mig_activity_ratio",
    "gpuwarden_gpu_mig_throughput_bytes_per_second",
)
MIG_CALLS = (
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlGpmMigSampleGet",
)
BUSY = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: 70.0,
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 50.0,
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 20.0,
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 10.0,
}


def mig_gpu(index: int = 0) -> FakeGpu:
    """An H200 in MIG mode: GPU instance 1 (1g.18gb, 3 GiB used) and GPU instance 2
    (2g.35gb) split into two compute instances (1c.2g.35gb each)."""
    gpu = FakeGpu.h200(index, mig_mode=(1, 1))
    gpu.add_mig(1, "1g.18gb", memory_used=3 * GiB)
    gpu.add_mig(2, "1c.2g.35gb", compute_instance=0)
    gpu.add_mig(2, "1c.2g.35gb", compute_instance=1)
    return gpu


def mig_series(result: Collection | list[Sample], **labels: str) -> list[Sample]:
    return [s for name in MIG_SERIES for s in find(result, name, **labels)]


def instances(result: Collection) -> set[tuple[str, str, str]]:
    """(gpu, gpu_instance, profile) of every instance with a memory series."""
    return {
        (s.labels["gpu"], s.labels["gpu_instance"], s.labels["profile"])
        for s in find(result, "gpuwarden_gpu_mig_memory_total_bytes")
    }


class TestInstanceSeries:
    async def test_each_gpu_instance_has_its_memory_and_profile(self) -> None:
        plain = FakeGpu.h200(1)
        rig = GpuRig(FakeNvml([mig_gpu(0), plain]))
        try:
            result = await rig.collect()  # MIG is read in the round its mode is first read
        finally:
            await rig.close()
        gpu = rig.fake.gpus[0]
        base = {"gpu": "0", "uuid": gpu.uuid, "pci_bus_id": "0000:18:00.0", "model": gpu.name}
        one = {**base, "gpu_instance": "1", "profile": "1g.18gb"}
        assert value(result, "gpuwarden_gpu_mig_memory_total_bytes", **one) == 18 * GiB
        assert value(result, "gpuwarden_gpu_mig_memory_used_bytes", **one) == 3 * GiB
        assert value(result, "gpuwarden_gpu_mig_memory_free_bytes", **one) == 15 * GiB
        # The GPU instance's memory once, however many compute instances share it: a sum
        # over a GPU's instances must not count it twice.
        two = find(result, "gpuwarden_gpu_mig_memory_total_bytes", gpu_instance="2")
        assert [(s.labels["profile"], s.value) for s in two] == [("2g.35gb", 35 * GiB)]
        devices = {
            (s.labels["gpu_instance"], s.labels["compute_instance"], s.labels["profile"])
            for s in find(result, "gpuwarden_gpu_mig_device_info", gpu="0")
        }
        assert devices == {
            ("1", "0", "1g.18gb"),
            ("2", "0", "1c.2g.35gb"),
            ("2", "1", "1c.2g.35gb"),
        }
        uuids = {s.labels["mig_uuid"] for s in find(result, "gpuwarden_gpu_mig_device_info")}
        assert uuids == {d.uuid for d in gpu.mig_devices if d is not None}
        assert mig_series(result, gpu="1") == []  # the GPU without MIG mode has none
        assert find(result, "gpuwarden_gpu_field_error") == []

    async def test_instances_that_go_lose_their_series(self) -> None:
        gpu = mig_gpu()
        rig = GpuRig(FakeNvml([gpu]))
        try:
            first = instances(await rig.collect())
            gpu.remove_mig(2)
            gpu.add_mig(3, "3g.71gb")
            second = instances(await rig.collect())
            gpu.remove_mig(1)
            gpu.add_mig(1, "2g.35gb")  # the same id again, another profile
            third = await rig.collect()
            for gi in (1, 3):
                gpu.remove_mig(gi)
            empty = await rig.collect()
        finally:
            await rig.close()
        assert first == {("0", "1", "1g.18gb"), ("0", "2", "2g.35gb")}
        assert second == {("0", "1", "1g.18gb"), ("0", "3", "3g.71gb")}
        assert instances(third) == {("0", "1", "2g.35gb"), ("0", "3", "3g.71gb")}
        assert mig_series(third, gpu_instance="2") == []
        assert mig_series(third, profile="1g.18gb") == []
        assert mig_series(empty) == []
        assert value(empty, "gpuwarden_gpu_up", gpu="0") == 1

    async def test_memory_follows_the_instance_use(self) -> None:
        gpu = mig_gpu()
        rig = GpuRig(FakeNvml([gpu]))
        try:
            await rig.collect()
            device = gpu.mig_devices[0]
            assert device is not None and device.memory is not None
            device.memory.used = 10 * GiB
            later = await rig.collect()
        finally:
            await rig.close()
        assert value(later, "gpuwarden_gpu_mig_memory_used_bytes", gpu_instance="1") == 10 * GiB
        assert value(later, "gpuwarden_gpu_mig_memory_free_bytes", gpu_instance="1") == 8 * GiB

    async def test_a_devices_ids_and_profile_are_read_once(self) -> None:
        gpu = mig_gpu()
        rig = GpuRig(FakeNvml([gpu]))
        try:
            for _ in range(5):
                await rig.collect()
        finally:
            await rig.close()
        # three devices, five rounds: a device's ids and name are read once (its UUID is
        # made with the instance)
        assert gpu.calls["mig.nvmlDeviceGetName"] == 3
        assert gpu.calls["mig.nvmlDeviceGetGpuInstanceId"] == 3
        assert gpu.calls["mig.nvmlDeviceGetUUID"] == 5 * 3
        assert gpu.calls["mig.nvmlDeviceGetMemoryInfo"] == 5 * 2  # one per GPU instance


class TestBounded:
    """Only a GPU in MIG mode has instance series, and only it pays for MIG calls."""

    @pytest.mark.parametrize(
        "mode",
        [(0, 0), (0, 1), None],
        ids=["mig-off", "mig-pending-reset", "no-mig-before-ampere"],
    )
    async def test_a_gpu_not_in_mig_mode_makes_no_mig_call(
        self, mode: tuple[int, int] | None
    ) -> None:
        gpu = FakeGpu.h200(0, mig_mode=mode, gpm=dict(BUSY))
        rig = GpuRig(FakeNvml([gpu]), settings=GpuSettings(event_thread=False, gpm_interval=10))
        try:
            results = [await rig.collect() for _ in range(4)]
        finally:
            await rig.close()
        assert {name: gpu.calls[name] for name in MIG_CALLS} == dict.fromkeys(MIG_CALLS, 0)
        assert not [name for name in gpu.calls if name.startswith("mig.")]
        for result in results:
            assert mig_series(result) == []
            assert value(result, "gpuwarden_gpu_up", gpu="0") == 1
            assert find(result, "gpuwarden_gpu_field_error") == []

    async def test_mig_mode_turned_on_and_off_is_seen_with_the_static_facts(self) -> None:
        """The mode is a static fact (a change needs a GPU reset): its instances come and go
        with the next static read, which a reset (the GPU lost, then back) also brings."""
        gpu = FakeGpu.h200(0)
        rig = GpuRig(
            FakeNvml([gpu]),
            settings=GpuSettings(event_thread=False, static_refresh_interval=60.0),
        )
        try:
            off = await rig.collect(advance=30)
            gpu.mig_mode = (1, 1)
            gpu.add_mig(1, "7g.141gb")
            still_off = await rig.collect(advance=30)  # 30 s: not yet re-read
            on = await rig.collect(advance=30)
            gpu.lost = True  # a reset to leave MIG mode
            await rig.collect(advance=1)
            gpu.lost, gpu.mig_mode = False, (0, 0)
            back = await rig.collect(advance=1)
        finally:
            await rig.close()
        assert mig_series(off) == [] and mig_series(still_off) == []
        assert instances(on) == {("0", "1", "7g.141gb")}
        assert mig_series(back) == []

    async def test_a_failing_mig_call_is_a_field_error_and_the_round_stands(self) -> None:
        gpu = mig_gpu()
        gpu.failures["mig.nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_UNKNOWN
        rig = GpuRig(FakeNvml([gpu]))
        try:
            result = await rig.collect()
        finally:
            await rig.close()
        assert value(result, "gpuwarden_gpu_field_error", gpu="0", field="mig_memory") == 1
        assert find(result, "gpuwarden_gpu_mig_memory_total_bytes") == []
        assert len(find(result, "gpuwarden_gpu_mig_device_info")) == 3  # the inventory stands
        assert value(result, "gpuwarden_gpu_up", gpu="0") == 1
        assert value(result, "gpuwarden_gpu_temperature_celsius", gpu="0", sensor="gpu") == 33

    async def test_a_lost_gpu_has_no_instance_series(self) -> None:
        gpu = mig_gpu()
        rig = GpuRig(FakeNvml([gpu]))
        try:
            await rig.collect()
            gpu.lost = True
            lost = await rig.collect()
            gpu.lost = False
            back = await rig.collect()
        finally:
            await rig.close()
        assert mig_series(lost) == []
        assert value(lost, "gpuwarden_gpu_up", gpu="0") == 0
        assert instances(back) == {("0", "1", "1g.18gb"), ("0", "2", "2g.35gb")}

    @pytest.mark.parametrize(
        ("name", "profile"),
        [
            ("NVIDIA H200 MIG 1g.18gb", "1g.18gb"),
            ("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb", "1c.3g.40gb"),
            (b"NVIDIA H200 MIG 1g.18gb+me", "1g.18gb+me"),
            ("NVIDIA H200", ""),
            (None, ""),
        ],
    )
    def test_profile_from_the_device_name(self, name: object, profile: str) -> None:
        assert mig_profile(name) == profile


def gpm_rig(gpu: FakeGpu) -> GpuRig:
    return GpuRig(FakeNvml([gpu]), settings=GpuSettings(event_thread=False, gpm_interval=30))


def mig_activity(result: Collection, gi: str, metric: str = "sm_active") -> float | None:
    return value(result, "gpuwarden_gpu_mig_activity_ratio", gpu_instance=gi, metric=metric)


class TestInstanceGpm:
    async def test_each_instance_between_two_of_its_samples(self) -> None:
        gpu = FakeGpu.h200(0, mig_mode=(1, 1), gpm=dict(BUSY))
        gpu.add_mig(1, "1g.18gb", gpm={pynvml.NVML_GPM_METRIC_SM_UTIL: 90.0})
        gpu.add_mig(2, "2g.35gb", gpm=dict(BUSY))
        rig = gpm_rig(gpu)
        try:
            first = await rig.collect(advance=10)
            between = await rig.collect(advance=20)  # before gpm_interval: not read
            second = await rig.collect(advance=10)
            cached = await rig.collect(advance=10)  # at 40 s: served from the read at 30 s
        finally:
            await rig.close()
            rig.backend.stop()
        assert find(first, "gpuwarden_gpu_mig_activity_ratio") == []
        assert find(between, "gpuwarden_gpu_mig_activity_ratio") == []
        assert mig_activity(second, "1") == pytest.approx(0.9)
        assert mig_activity(second, "1", "tensor_active") is None  # left out: not supported
        assert mig_activity(second, "2", "tensor_active") == pytest.approx(0.5)
        assert mig_activity(cached, "2", "dram_active") == pytest.approx(0.2)
        [tx] = find(second, "gpuwarden_gpu_mig_throughput_bytes_per_second", gpu_instance="2")
        assert (tx.labels["bus"], tx.labels["direction"], tx.value) == ("pcie", "tx", 10 * 2**20)
        assert tx.labels["profile"] == "2g.35gb"
        assert gpu.calls["nvmlGpmMigSampleGet"] == 4  # two GPM rounds, two instances
        assert rig.fake.gpm_samples_live == 0  # freed at stop

    async def test_an_instance_without_gpm_is_absent_and_not_asked_again(self) -> None:
        gpu = FakeGpu.h200(0, mig_mode=(1, 1), gpm=dict(BUSY))
        gpu.add_mig(1, "1g.18gb", gpm=None)
        gpu.add_mig(2, "2g.35gb", gpm=dict(BUSY))
        rig = gpm_rig(gpu)
        try:
            results = [await rig.collect(advance=30) for _ in range(4)]
        finally:
            await rig.close()
        assert mig_activity(results[-1], "1") is None
        assert mig_activity(results[-1], "2") == pytest.approx(0.7)
        assert gpu.calls["nvmlGpmMigSampleGet"] == 1 + 4  # instance 1 once, instance 2 each
        assert find(results[-1], "gpuwarden_gpu_field_error") == []
        assert rig.fake.gpm_samples_live <= 2 + 2  # the GPU's two, instance 2's two

    async def test_an_nvidia_ml_py_without_mig_gpm_reads_the_rest(self) -> None:
        """nvidia-ml-py releases before nvmlGpmMigSampleGet: instance GPM absent, no error."""

        class OlderNvml(FakeNvml):
            nvmlGpmMigSampleGet = None  # type: ignore[assignment]  # the name missing

        gpu = FakeGpu.h200(0, mig_mode=(1, 1), gpm=dict(BUSY))
        gpu.add_mig(1, "1g.18gb", gpm=dict(BUSY))
        rig = GpuRig(OlderNvml([gpu]), settings=GpuSettings(event_thread=False, gpm_interval=30))
        try:
            results = [await rig.collect(advance=30) for _ in range(3)]
        finally:
            await rig.close()
        assert find(results[-1], "gpuwarden_gpu_mig_activity_ratio") == []
        assert find(results[-1], "gpuwarden_gpu_field_error") == []
        assert instances(results[-1]) == {("0", "1", "1g.18gb")}
        assert value(results[-1], "gpuwarden_gpu_activity_ratio", gpu="0", metric="sm_active")

    async def test_a_gpu_without_gpm_asks_no_instance(self) -> None:
        gpu = FakeGpu.h200(0, mig_mode=(1, 1), gpm=None)  # an A100: MIG, no GPM
        gpu.add_mig(1, "1g.10gb", gpm=dict(BUSY))
        rig = gpm_rig(gpu)
        try:
            results = [await rig.collect(advance=30) for _ in range(3)]
        finally:
            await rig.close()
        assert gpu.calls["nvmlGpmMigSampleGet"] == 0
        assert find(results[-1], "gpuwarden_gpu_mig_activity_ratio") == []
        assert instances(results[-1]) == {("0", "1", "1g.10gb")}

    async def test_a_gone_instance_frees_its_samples_and_a_new_one_starts_afresh(self) -> None:
        gpu = FakeGpu.h200(0, mig_mode=(1, 1), gpm=dict(BUSY))
        gpu.add_mig(1, "1g.18gb", gpm=dict(BUSY))
        gpu.add_mig(2, "1g.18gb", gpm=dict(BUSY))
        rig = gpm_rig(gpu)
        try:
            await rig.collect(advance=30)
            both = await rig.collect(advance=10)
            live = rig.fake.gpm_samples_live
            gpu.remove_mig(2)
            one = await rig.collect(advance=20)  # at 40 s, not a GPM round: gone all the same
            freed = rig.fake.gpm_samples_live
            gpu.add_mig(2, "1g.18gb", gpm=dict(BUSY))  # the same id, a new instance
            fresh = await rig.collect(advance=30)  # a GPM round: its first sample
            again = await rig.collect(advance=30)
        finally:
            await rig.close()
        assert mig_activity(both, "2") == pytest.approx(0.7)
        assert mig_activity(one, "2") is None and mig_activity(one, "1") is not None
        assert freed == live - 2
        # Its first sample has nothing of its own to be compared with: no value, never one
        # computed against the destroyed instance's sample.
        assert mig_activity(fresh, "2") is None
        assert mig_activity(again, "2") == pytest.approx(0.7)


def wait_for(condition: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.01)
    return False


LABELS: Mapping[str, str] = {
    "gpu": "0",
    "uuid": "GPU-x",
    "pci_bus_id": "0000:18:00.0",
    "model": "NVIDIA H200",
}


def events_from(fake: FakeNvml, push: list[tuple[int, int, int | None, int | None]]) -> list[Event]:
    """Events the NVML event thread emits for `push` (event type, data, GI, CI)."""
    backend = NvmlBackend(fake)
    backend.start()
    emitted: list[Event] = []
    correlator = XidCorrelator(window=0.0, holdoff=0.0)
    correlator.set_identity("0000:18:00.0", LABELS)
    thread = GpuEventThread(
        backend,
        correlator,
        emitted.append,
        [(0, 0xFF9F)],
        lambda: {"0000:18:00.0": LABELS},
        wait_ms=50,
    )
    thread.start()
    try:
        assert thread.ready.wait(5)
        for event_type, data, gi, ci in push:
            fake.push_event(fake.gpus[0], event_type, data, gpu_instance=gi, compute_instance=ci)
        assert wait_for(lambda: len(emitted) >= len(push))
    finally:
        thread.stop()
        backend.stop()
    return emitted


class TestEventsNameTheInstance:
    """NVML's event data names the MIG instance (gpuInstanceId, computeInstanceId; 0xFFFFFFFF
    for none): the event, its JSON (the MQTT payload and the outbox row) and its message say
    it, under the attribute names of the kernel log's GPU-I/GPU-CI."""

    @pytest.mark.parametrize(
        ("gi", "ci", "said"),
        [
            (2, 1, " (MIG GPU instance 2, compute instance 1)"),
            (0, 0, " (MIG GPU instance 0, compute instance 0)"),  # 0 is an id, not "none"
            (5, None, " (MIG GPU instance 5)"),
            (None, None, ""),
        ],
    )
    def test_xid(self, gi: int | None, ci: int | None, said: str) -> None:
        [event] = events_from(
            FakeNvml([FakeGpu.h200(0)]), [(pynvml.nvmlEventTypeXidCriticalError, 43, gi, ci)]
        )
        assert event.kind == "xid"
        payload = json.loads(event.to_json())["attributes"]
        assert (payload.get("gpu_instance"), payload.get("compute_instance")) == (gi, ci)
        assert f"on GPU 0 (NVIDIA H200, 0000:18:00.0){said}:" in event.message
        if gi is None:
            assert "MIG" not in event.message

    def test_ecc(self) -> None:
        double = pynvml.nvmlEventTypeDoubleBitEccError
        [event] = events_from(FakeNvml([FakeGpu.h200(0)]), [(double, 0, 3, 0)])
        assert event.kind == "ecc_double_bit_event"
        assert (event.attributes["gpu_instance"], event.attributes["compute_instance"]) == (3, 0)
        assert "MIG GPU instance 3, compute instance 0" in event.message

    def test_none_is_nvmls_any_id(self) -> None:
        assert pynvml.NVML_GPU_INSTANCE_ID_ANY == INSTANCE_ID_NONE
        assert pynvml.NVML_COMPUTE_INSTANCE_ID_ANY == INSTANCE_ID_NONE


class TestRecreatedInstanceGpm:
    async def test_an_instance_made_again_between_two_gpm_reads_is_not_compared(self) -> None:
        """Destroyed and made again (same id, new devices) between two GPM reads: the kept
        sample is the old instance's, which NVML refuses to compare; never an error, never a
        value across the two."""
        gpu = FakeGpu.h200(0, mig_mode=(1, 1), gpm=dict(BUSY))
        gpu.add_mig(1, "1g.18gb", gpm=dict(BUSY))
        rig = gpm_rig(gpu)
        try:
            await rig.collect(advance=30)
            gpu.remove_mig(1)
            gpu.add_mig(1, "1g.18gb", gpm={pynvml.NVML_GPM_METRIC_SM_UTIL: 10.0})
            remade = await rig.collect(advance=30)
            later = await rig.collect(advance=30)
        finally:
            await rig.close()
        assert find(remade, "gpuwarden_gpu_field_error") == []
        assert mig_activity(remade, "1") is None
        assert mig_activity(later, "1") == pytest.approx(0.1)


class TestXidNamesTheInstanceProfile:
    """The gpu collector tells the Xid correlator each GPU instance's profile: an Xid naming
    an instance, from NVML or from the kernel log's GPU-I, names its profile too."""

    async def test_from_nvml_and_from_the_kernel_log(self) -> None:
        gpu = mig_gpu()
        rig = GpuRig(FakeNvml([gpu]), settings=GpuSettings(event_wait_ms=50))
        rig.correlator.holdoff = 0.0
        try:
            await rig.collect()
            thread = rig.collector.events_thread
            assert thread is not None and thread.ready.wait(5)
            rig.fake.push_event(gpu, pynvml.nvmlEventTypeXidCriticalError, 43, 2, 1)
            assert wait_for(lambda: bool(rig.emitted))
            kmsg = rig.correlator.observe(
                XidObservation(
                    source="kmsg",
                    pci_bus_id="0000:18:00.0",
                    code=13,
                    time=time.time(),
                    details={"gpu_instance": 1},
                )
            )
            gpu.remove_mig(1)
            await rig.collect()
            gone = rig.correlator.observe(
                XidObservation(
                    source="kmsg",
                    pci_bus_id="0000:18:00.0",
                    code=31,
                    time=time.time(),
                    details={"gpu_instance": 1},
                )
            )
        finally:
            await rig.close()
        [nvml] = rig.emitted
        assert nvml.attributes["gpu_instance_profile"] == "2g.35gb"
        assert "(MIG GPU instance 2 (2g.35gb), compute instance 1)" in nvml.message
        assert kmsg is not None and kmsg.attributes["gpu_instance_profile"] == "1g.18gb"
        assert "(MIG GPU instance 1 (1g.18gb))" in kmsg.message
        # An instance that is gone has no profile to give: the id alone, never a stale one.
        assert gone is not None and "gpu_instance_profile" not in gone.attributes
        assert "(MIG GPU instance 1)" in gone.message
