"""Processes, the PCI count, the recovery action and GPM against a real NVIDIA GPU.

Run on the GPU machine: `python -m pytest -q -m gpu tests/test_gpu_depth_real.py`. Without
NVML every test skips; the torch tests skip where this interpreter has no torch. Synchronous
on purpose (the GPU machine may lack pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors._nvml import NvmlBackend, NvmlUnavailable
from collectors._procfs import parse_cgroup
from collectors.gpu.pci import scan_pci
from tests.support.nvml import find
from tests.test_gpu_real import one_round

pytestmark = [pytest.mark.gpu]

HOLD_MEMORY = """
import sys, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(60)
"""
MATMUL_LOOP = """
import time, torch
a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
print("ready", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


@pytest.fixture(scope="module")
def backend() -> Iterator[NvmlBackend]:
    instance = NvmlBackend()
    try:
        instance.start()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")
    yield instance
    instance.stop()


def torch_child(code: str) -> subprocess.Popen[bytes]:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("no torch in this interpreter")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None
    line = child.stdout.readline()
    if line != b"ready\n":
        child.kill()
        child.wait()
        pytest.fail(f"the torch child did not start (said {line!r})")
    return child


def stop(child: subprocess.Popen[bytes]) -> None:
    child.kill()
    child.wait(30)


def gpm_between(backend: NvmlBackend, index: int, seconds: float) -> dict[str, float]:
    first = backend.read_gpu(index, gpm=True)
    if first.gpm is None:
        pytest.skip("GPM not supported on this GPU")
    time.sleep(seconds)
    second = backend.read_gpu(index, gpm=True)
    assert second.gpm is not None
    assert dict(second.gpm.errors) == {}
    return dict(second.gpm.ratios)


class TestProcesses:
    def test_torch_child_shows_with_pid_and_cgroup(self, backend: NvmlBackend) -> None:
        child = torch_child(HOLD_MEMORY)
        try:
            collection = asyncio.run(one_round(backend))
            pids = backend.read_gpu(0).reading.processes or ()
        finally:
            stop(child)
        if pids and not any(Path(f"/proc/{p.pid}").exists() for p in pids):
            pytest.skip(f"NVML reports pids of another pid namespace: {[p.pid for p in pids]}")
        series = find(collection, "gpuwarden_gpu_process_memory_used_bytes", pid=str(child.pid))
        assert len(series) == 1, [
            s.labels for s in find(collection, "gpuwarden_gpu_compute_processes")
        ]
        sample = series[0]
        assert sample.labels["gpu"] == "0"
        assert sample.value >= 2**30  # the 1 GiB tensor and the CUDA context
        assert sample.labels["process"].startswith("python")
        owner = parse_cgroup(Path(f"/proc/{os.getpid()}/cgroup").read_text())  # same cgroup
        assert sample.labels["unit"] == owner.unit
        assert sample.labels["container_id"] == owner.container_id
        assert sample.labels["pod_uid"] == owner.pod_uid
        assert sample.labels["user"]

    def test_gone_child_leaves_no_series(self, backend: NvmlBackend) -> None:
        child = torch_child(HOLD_MEMORY)
        stop(child)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the driver tears the context down after exit
            if not any(p.pid == child.pid for p in backend.read_gpu(0).reading.processes or ()):
                break
            time.sleep(0.2)
        collection = asyncio.run(one_round(backend))
        assert find(collection, "gpuwarden_gpu_process_memory_used_bytes", pid=str(child.pid)) == []


class TestPci:
    def test_pci_count_equals_nvml_count(self, backend: NvmlBackend) -> None:
        scan = scan_pci(Path("/sys"))
        on_bus = [f for f in scan.gpus if not f.passed_through]
        assert len(on_bus) == backend.device_count()
        assert {f.address for f in on_bus} == {g.pci_bus_id for g in backend.gpus()}
        assert {f.driver for f in on_bus} == {"nvidia"}

    def test_round_reports_none_missing(self, backend: NvmlBackend) -> None:
        collection = asyncio.run(one_round(backend))
        visible = find(collection, "gpuwarden_gpus_visible")[0].value
        assert find(collection, "gpuwarden_gpus_pci")[0].value == visible
        assert find(collection, "gpuwarden_gpu_pci_not_visible") == []
        assert [e.kind for e in collection.events if e.kind == "gpu_not_enumerated"] == []


class TestRecoveryAction:
    def test_reads_none(self, backend: NvmlBackend) -> None:
        for index in range(backend.device_count()):
            result = backend.read_gpu(index, slow=True)
            assert result.reading.recovery_action == 0, result.reading.errors
            assert "recovery_action" not in result.reading.errors
            assert "fabric" not in (result.slow.errors if result.slow else {})

    def test_series(self, backend: NvmlBackend) -> None:
        collection = asyncio.run(one_round(backend))
        on = [
            s.labels["action"]
            for s in find(collection, "gpuwarden_gpu_recovery_action", gpu="0")
            if s.value == 1
        ]
        assert on == ["none"]


class TestGpm:
    def test_supported_on_hopper(self, backend: NvmlBackend) -> None:
        static = backend.read_gpu(0, static=True).static
        assert static is not None
        if static.compute_capability is None or float(static.compute_capability) < 9.0:
            pytest.skip("GPM needs Hopper or later")
        assert backend.read_gpu(0, gpm=True).gpm is not None

    def test_idle_reads_near_zero(self, backend: NvmlBackend) -> None:
        ratios = gpm_between(backend, 0, 1.0)
        assert set(ratios) >= {"sm_active", "sm_occupancy", "tensor_active", "dram_active"}
        assert ratios["sm_active"] < 0.05, ratios
        assert ratios["tensor_active"] < 0.05, ratios

    def test_matmul_reads_high(self, backend: NvmlBackend) -> None:
        child = torch_child(MATMUL_LOOP)
        try:
            time.sleep(1.0)
            ratios = gpm_between(backend, 0, 2.0)
        finally:
            stop(child)
        assert ratios["sm_active"] > 0.5, ratios
        assert ratios["tensor_active"] > 0.2, ratios
