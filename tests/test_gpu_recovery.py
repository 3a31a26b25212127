"""What the driver says to do: NVML's GPU recovery action field and the fabric state.

`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` (field 230) answers none, GPU reset, node reboot, drain
P2P or drain and reset; `nvmlDeviceGetGpuFabricInfo` the state of the GPU's NVLink fabric
registration. Both are series where supported and absent where not; an action other than none
is an event (once, persisted), and its end another.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pynvml
import pytest

from agent.contracts.collector import JSONValue, MemoryKeyValueStore
from agent.contracts.errors import StateStoreError
from agent.contracts.model import Severity
from agent.program.diagnose.collect_once import CollectorResult
from agent.program.diagnose.findings import Status
from agent.program.diagnose.gpu_findings import classify_gpus
from collectors import _nvml
from tests.support.nvml import GpuRig, fake_gpus, find, kinds
from tests.support.nvml_fake import FakeFabric, FakeNvml

ACTIONS = dict(_nvml.RECOVERY_ACTIONS)  # nvml.h numbers (tests/test_nvml_constants.py)


@pytest.fixture
async def rig() -> AsyncIterator[GpuRig]:
    instance = GpuRig(FakeNvml(fake_gpus(2)))
    yield instance
    await instance.close()


def action_of(result: object, gpu: str) -> str | None:
    on = [
        s.labels["action"]
        for s in find(result, "gpuwarden_gpu_recovery_action", gpu=gpu)  # type: ignore[arg-type]
        if s.value == 1
    ]
    assert len(on) <= 1
    return on[0] if on else None


class TestRecoveryAction:
    async def test_none_is_a_series(self, rig: GpuRig) -> None:
        result = await rig.collect()
        assert action_of(result, "0") == "none"
        states = find(result, "gpuwarden_gpu_recovery_action", gpu="0")
        assert {s.labels["action"] for s in states} == set(ACTIONS.values())

    @pytest.mark.parametrize("code", sorted(set(ACTIONS) - {0}))
    async def test_every_action_is_an_event_once_and_its_end(self, rig: GpuRig, code: int) -> None:
        await rig.collect()
        rig.fake.gpus[1].recovery_action = code
        started = await rig.collect()
        name = ACTIONS[code]
        assert action_of(started, "1") == name
        assert action_of(started, "0") == "none"
        events = [e for e in started.events if e.kind == f"recovery_action_{name}"]
        assert len(events) == 1
        event = events[0]
        assert event.subject == rig.fake.gpus[1].uuid
        assert event.severity is (Severity.WARNING if name == "drain_p2p" else Severity.CRITICAL)
        assert event.action
        assert f"recovery_action_{name}" not in kinds(await rig.collect())
        rig.fake.gpus[1].recovery_action = 0
        ended = await rig.collect()
        assert f"recovery_action_{name}_cleared" in kinds(ended)

    async def test_unknown_code_is_named_by_number(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].recovery_action = 42  # a value newer than this agent
        result = await rig.collect()
        assert action_of(result, "0") is None
        unknown = find(result, "gpuwarden_gpu_recovery_action_code", gpu="0")
        assert [s.value for s in unknown] == [42]

    async def test_unsupported_stays_absent(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].recovery_action = None  # an older driver answers NOT_SUPPORTED
        result = await rig.collect()
        assert find(result, "gpuwarden_gpu_recovery_action", gpu="0") == []
        assert find(result, "gpuwarden_gpu_field_error", gpu="0") == []
        # the memory temperature, read in the same field-values call, is still there
        assert find(result, "gpuwarden_gpu_temperature_celsius", gpu="0", sensor="memory")

    async def test_a_driver_older_than_the_field_is_absent(self, rig: GpuRig) -> None:
        # A driver whose NVML_FI_MAX is below 230 answers INVALID_ARGUMENT for that entry
        # (the call itself succeeds): not a field error, just absent.
        rig.fake.gpus[0].field_codes[pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] = (
            pynvml.NVML_ERROR_INVALID_ARGUMENT
        )
        result = await rig.collect()
        assert find(result, "gpuwarden_gpu_recovery_action", gpu="0") == []
        assert find(result, "gpuwarden_gpu_field_error", gpu="0") == []
        assert find(result, "gpuwarden_gpu_temperature_celsius", gpu="0", sensor="memory")

    async def test_a_real_field_error_is_reported(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].field_codes[pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] = (
            pynvml.NVML_ERROR_UNKNOWN
        )
        result = await rig.collect()
        errors = [s.labels["field"] for s in find(result, "gpuwarden_gpu_field_error", gpu="0")]
        assert errors == ["recovery_action"]

    async def test_one_field_values_call_per_round(self, rig: GpuRig) -> None:
        await rig.collect()
        before = rig.fake.gpus[0].calls["nvmlDeviceGetFieldValues"]
        await rig.collect()
        assert rig.fake.gpus[0].calls["nvmlDeviceGetFieldValues"] - before == 1

    async def test_check_fails_on_an_action(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
        result = await rig.collect()
        findings = classify_gpus(CollectorResult("gpu", result.samples, result.events), 2)
        line = next(f for f in findings if "GPU 0" in f.name and "recovery" in f.name)
        assert line.status is Status.FAIL
        assert "reboot" in line.detail
        ok = next(f for f in findings if "recovery" in f.name and f.status is Status.OK)
        assert "none" in ok.detail


class FailingStore(MemoryKeyValueStore):
    """A store whose writes fail while `failing` (a full disk)."""

    failing = False

    def put(self, namespace: str, key: str, value: JSONValue) -> None:
        if self.failing:
            raise StateStoreError("disk full")
        super().put(namespace, key, value)


class TestRecoveryActionStore:
    async def test_a_change_the_store_refused_is_news_next_round(self) -> None:
        store = FailingStore()
        rig = GpuRig(FakeNvml(fake_gpus(1)), state=store)
        try:
            await rig.collect()
            store.failing = True
            rig.fake.gpus[0].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
            with pytest.raises(StateStoreError):
                await rig.collect()
            store.failing = False
            again = await rig.collect()
        finally:
            await rig.close()
        assert "recovery_action_gpu_reset" in kinds(again)


class TestFabric:
    async def test_absent_where_unsupported(self, rig: GpuRig) -> None:
        result = await rig.collect()  # the fake's default: no fabric (a PCIe H200)
        assert find(result, "gpuwarden_gpu_fabric_state") == []
        assert find(result, "gpuwarden_gpu_fabric_status_code") == []
        assert find(result, "gpuwarden_gpu_field_error") == []

    async def test_state_not_supported_is_absent(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].fabric = FakeFabric(state=pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED)
        result = await rig.collect()
        assert find(result, "gpuwarden_gpu_fabric_state", gpu="0") == []

    async def test_state_and_status(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].fabric = FakeFabric(state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)
        rig.fake.gpus[1].fabric = FakeFabric(
            state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, status=pynvml.NVML_ERROR_UNKNOWN
        )
        result = await rig.collect()
        on = {
            s.labels["gpu"]: s.labels["state"]
            for s in find(result, "gpuwarden_gpu_fabric_state")
            if s.value == 1
        }
        assert on == {"0": "completed", "1": "in_progress"}
        codes = {s.labels["gpu"]: s.value for s in find(result, "gpuwarden_gpu_fabric_status_code")}
        assert codes == {"0": 0, "1": pynvml.NVML_ERROR_UNKNOWN}

    async def test_read_on_the_slow_interval(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].fabric = FakeFabric(state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)
        for _ in range(3):
            await rig.collect(advance=10)  # slow_interval 60 s
        assert rig.fake.gpus[0].calls["nvmlDeviceGetGpuFabricInfo"] == 1
