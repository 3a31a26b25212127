"""The gpu collector against a real NVIDIA GPU, compared with what nvidia-smi prints.

Run on the GPU machine: `python -m pytest -q -m gpu tests/test_gpu_real.py`. Without NVML every
test here skips. Known facts of the lent H200 (driver 580.159.04): retired pages, fan speed,
NVLink state and error counters are not supported there (fixtures/h200/nvidia-smi-q.txt).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Collection, Event, RepairAction, Severity
from agent.runtime.blocking import PooledCaller
from agent.runtime.repairs import RepairLedger
from collectors._nvml import EVENT_XID, NvmlBackend, NvmlUnavailable
from collectors._xid import XidCorrelator, normalize_pci_bus_id
from collectors.gpu.collector import GpuCollector, GpuSettings
from collectors.gpu.events import GpuEventThread
from tests.support.nvml import find, value

pytestmark = [pytest.mark.gpu]

SMI_FIELDS = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "temperature.gpu",
    "memory.total",
    "power.limit",
    "driver_version",
    "clocks.sm",
    "clocks.mem",
)


@pytest.fixture(scope="module")
def backend() -> Iterator[NvmlBackend]:
    instance = NvmlBackend()
    try:
        instance.start()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")
    yield instance
    instance.stop()


async def one_round(backend: NvmlBackend, ledger: RepairLedger | None = None) -> Collection:
    shared = SharedServices()
    shared.put(NvmlBackend, backend)
    emitted: list[Event] = []
    deps = CollectorDeps(
        "gpu-test",
        Path("/nonexistent"),
        MemoryKeyValueStore(),
        shared,
        emitted.append,
        held=ledger.active if ledger is not None else lambda: (),
    )
    collector = GpuCollector(GpuSettings(event_thread=False), deps)
    executor = concurrent.futures.ThreadPoolExecutor(4)
    try:
        return await collector.collect(CollectContext(PooledCaller(executor, 5.0), time.time(), 0))
    finally:
        await collector.close()
        executor.shutdown()


@pytest.fixture
def collection(backend: NvmlBackend) -> Collection:
    # Synchronous on purpose: the GPU machine may lack pytest-asyncio.
    return asyncio.run(one_round(backend))


def nvidia_smi() -> list[dict[str, str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not installed")
    out = subprocess.run(
        [smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [
        dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=True))
        for line in out.strip().splitlines()
    ]


class TestRealBackend:
    """Every field the GPU supports is read; the rest is absent, not an error."""

    def test_reads_without_field_errors(self, backend: NvmlBackend) -> None:
        for index in range(backend.device_count()):
            result = backend.read_gpu(index, static=True, slow=True, energy=True)
            assert result.static is not None
            assert result.slow is not None
            assert dict(result.reading.errors) == {}
            assert dict(result.static.errors) == {}
            assert dict(result.slow.errors) == {}
            r = result.reading
            for name in (
                "temperature_gpu_celsius",
                "power_draw_watts",
                "power_limit_watts",
                "sm_clock_hertz",
                "memory_clock_hertz",
                "clock_event_reasons",
                "utilization_gpu_ratio",
                "memory_total_bytes",
                "memory_used_bytes",
                "pcie_generation",
                "pcie_width",
                "compute_processes",
            ):
                assert getattr(r, name) is not None, name
            assert result.static.identity.uuid.startswith("GPU-")
            assert result.static.driver_version
            assert result.reading.energy_joules is not None

    def test_h200_facts(self, backend: NvmlBackend) -> None:
        result = backend.read_gpu(0, static=True, slow=True)
        assert result.static is not None
        if "H200" not in result.static.identity.name:
            pytest.skip("not an H200")
        assert result.slow is not None
        assert result.slow.retired_pages_single_bit is None  # Hopper remaps rows instead
        assert result.slow.nvlinks == ()
        assert result.reading.remapped_rows_correctable is not None
        assert result.static.compute_capability == "9.0"

    def test_identity_helpers(self, backend: NvmlBackend) -> None:
        gpus = backend.gpus()
        assert len(gpus) == backend.device_count()
        assert backend.compute_process_count(0) is not None
        assert backend.utilization(0) is not None


class TestRealEventThread:
    """The event thread registers Xid events and stops within its wait timeout."""

    def test_start_stop(self, backend: NvmlBackend) -> None:
        gpus = [(g.index, backend.read_gpu(g.index, static=True).static) for g in backend.gpus()]
        masks = [(i, s.supported_event_types if s else None) for i, s in gpus]
        thread = GpuEventThread(
            backend, XidCorrelator(), lambda e: None, masks, lambda: {}, wait_ms=200
        )
        thread.start()
        assert thread.ready.wait(10)
        assert thread.running, thread.error
        assert all(mask & EVENT_XID for mask in thread.registered.values())
        assert thread.stop(5)


class TestAgainstNvidiaSmi:
    """A full collection round agrees with nvidia-smi on the same fields."""

    def test_round_matches(self, collection: Collection) -> None:
        assert value(collection, "gpuwarden_nvml_up") == 1
        assert find(collection, "gpuwarden_gpu_field_error") == []
        for row in nvidia_smi():
            gpu = row["index"]
            labels = find(collection, "gpuwarden_gpu_up", gpu=gpu)[0].labels
            assert labels["uuid"] == row["uuid"]
            assert labels["model"] == row["name"]
            assert labels["pci_bus_id"] == normalize_pci_bus_id(row["pci.bus_id"])
            info = find(collection, "gpuwarden_gpu_info", gpu=gpu)[0].labels
            assert info["driver_version"] == row["driver_version"]
            temperature = value(
                collection, "gpuwarden_gpu_temperature_celsius", gpu=gpu, sensor="gpu"
            )
            assert temperature is not None
            assert abs(temperature - float(row["temperature.gpu"])) <= 3
            total = value(collection, "gpuwarden_gpu_memory_total_bytes", gpu=gpu)
            assert total is not None
            assert abs(total / 2**20 - float(row["memory.total"])) <= 1
            limit = value(collection, "gpuwarden_gpu_power_limit_watts", gpu=gpu)
            assert limit is not None
            assert abs(limit - float(row["power.limit"])) <= 1
            memory_hertz = value(collection, "gpuwarden_gpu_clock_hertz", gpu=gpu, clock="memory")
            assert memory_hertz is not None
            assert abs(memory_hertz / 1e6 - float(row["clocks.mem"])) <= 0.02 * memory_hertz / 1e6
            # The SM clock of an idle GPU jumps between 345 and 1980 MHz on the lent H200,
            # and running nvidia-smi itself wakes it: compare against the range, not the value.
            sm_hertz = value(collection, "gpuwarden_gpu_clock_hertz", gpu=gpu, clock="sm")
            sm_max = value(collection, "gpuwarden_gpu_clock_max_hertz", gpu=gpu, clock="sm")
            assert sm_hertz is not None
            assert sm_max is not None
            assert 0 < sm_hertz <= sm_max
            assert 0 < float(row["clocks.sm"]) <= sm_max / 1e6


class TestHeldByAnEarlierAgent:
    """A hang that an earlier agent (before a restart) reported for the real GPUs, by UUID and
    by index (a GPU it never read), ends at this agent's first answer: every requirement
    clears (tests/test_held_across_instances.py has the faults themselves, on the fake)."""

    def test_the_first_answer_clears_them(
        self, backend: NvmlBackend, collection: Collection
    ) -> None:
        uuids = [s.labels["uuid"] for s in find(collection, "gpuwarden_gpu_up")]
        assert uuids
        ledger = RepairLedger(MemoryKeyValueStore(), "boot")
        subjects = [*uuids[1:], "0"]  # the first GPU was never read, the others were
        for subject in subjects:
            ledger.apply(
                Event(
                    "gpu",
                    "gpu_unresponsive",
                    Severity.CRITICAL,
                    "hung",
                    subject=subject,
                    repair_action=RepairAction.RESET_GPU,
                )
            )
        result = asyncio.run(one_round(backend, ledger))
        recovered = [e for e in result.events if e.kind == "gpu_recovered"]
        assert sorted(e.subject for e in recovered) == sorted(subjects)
        first = next(e for e in recovered if e.subject == "0")
        assert first.attributes["uuid"] == uuids[0]
        for event in result.events:
            ledger.apply(event)
        assert ledger.active() == []
