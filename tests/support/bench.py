"""Test doubles for the benchmark: a scriptable GPU activity source and fake child programs.

`FakeGpuActivity` stands in for NVML (no GPU here). The real child runs on the CPU
(`cpu_plan`); the fake children (a sleeper, a crasher, a garbage printer) are real processes
started by the real runner.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.contracts.collector import (
    Call,
    CollectContext,
    CollectorDeps,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Event
from collectors.benchmark.gpus import GpuBackendUnavailable, GpuIdentity
from collectors.benchmark.history import BenchmarkRecord, format_time_utc


def gpu(index: int, name: str = "NVIDIA H200") -> GpuIdentity:
    return GpuIdentity(
        index=index,
        uuid=f"GPU-0000000{index}-aaaa-bbbb-cccc-ddddeeeeffff",
        name=name,
        pci_bus_id=f"0000:{0x10 + index:02x}:00.0",
    )


@dataclass
class FakeGpuActivity:
    """GpuActivity with settable readings; `available=False` acts as a host with no driver."""

    devices: list[GpuIdentity] = field(default_factory=lambda: [gpu(0)])
    processes: dict[int, int | None] = field(default_factory=dict)
    utilization: dict[int, float | None] = field(default_factory=dict)
    driver: str | None = "580.159.04"
    available: bool = True
    calls: int = 0
    held: bool = False

    def gpus(self) -> list[GpuIdentity]:
        self.calls += 1
        if not self.available:
            raise GpuBackendUnavailable("NVML: driver not loaded (fake)")
        return list(self.devices)

    def compute_process_count(self, index: int) -> int | None:
        return self.processes.get(index, 0)

    def utilization_percent(self, index: int) -> float | None:
        return self.utilization.get(index, 0.0)

    def driver_version(self) -> str | None:
        return self.driver

    def hold(self, timeout: float) -> bool:
        self.held = True
        return True

    def release(self) -> None:
        self.held = False


def cpu_plan(gpu: GpuIdentity) -> tuple[str, dict[str, str]]:
    """Run the real child on the CPU for any (fake) GPU."""
    return "cpu", {}


class DirectCaller:
    """A BlockingCaller that calls in the event loop's thread: enough for fakes."""

    async def call(self, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    async def call_each(self, calls: Sequence[Call[Any]]) -> list[Any]:
        outcomes: list[Any] = []
        for _key, fn, args in calls:
            try:
                outcomes.append(fn(*args))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes


def context(now: float | None = None, round_number: int = 0) -> CollectContext:
    return CollectContext(
        caller=DirectCaller(), now=time.time() if now is None else now, round=round_number
    )


def deps(state_dir: Path, emitted: list[Event] | None = None) -> CollectorDeps:
    sink = emitted if emitted is not None else []
    return CollectorDeps(
        node_id="test-node",
        state_dir=state_dir,
        state=MemoryKeyValueStore(),
        shared=SharedServices(),
        emit=sink.append,
    )


def fake_child(tmp_path: Path, name: str, body: str) -> list[str]:
    """A command running a small Python program in place of the real child."""
    script = tmp_path / f"{name}.py"
    script.write_text(body)
    return [sys.executable, str(script)]


def record(
    tflops: float,
    at: float,
    *,
    uuid: str = "GPU-A",
    name: str = "NVIDIA H200",
    correct: bool | None = True,
    driver: str = "580.159.04",
    torch: str = "2.11.0",
    size: int = 2048,
    window: float = 0.5,
    ratio: float | None = None,
) -> BenchmarkRecord:
    """A record as the agent writes it, with the throughput given."""
    iterations = 20
    return BenchmarkRecord(
        time_utc=format_time_utc(at),
        gpu_index=0,
        gpu_name=name,
        torch=torch,
        torch_cuda="13.0",
        dtype="float32",
        matmul_precision="highest",
        size=size,
        iterations=iterations,
        median_seconds=2 * size**3 * iterations / (tflops * 1e12),
        estimated_tflops=tflops,
        gpu_uuid=uuid,
        driver_version=driver,
        profile="fp32",
        min_window_seconds=window,
        correct=correct,
        baseline_ratio=ratio,
    )


def series(samples: Sequence[Any], name: str, **labels: str) -> list[float]:
    """Values of the samples of metric `name` whose labels include `labels`."""
    return [
        s.value
        for s in samples
        if s.family.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


RECORD_CHILD = r"""
import json, os, sys, time
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
tflops = float(os.environ.get("FAKE_TFLOPS", "50"))
size, iterations = int(args["--size"]), int(args["--iterations"])
seconds = 2 * size**3 * iterations / (tflops * 1e12)
print(json.dumps({
    "time_utc": os.environ.get("FAKE_TIME_UTC") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu_index": 0,
    "gpu_name": "torch-name", "torch": "2.11.0", "torch_cuda": "13.0", "dtype": "float32",
    "matmul_precision": "highest", "size": size, "iterations": iterations,
    "median_seconds": seconds, "estimated_tflops": tflops, "profile": args["--profile"],
    "device": args["--device"], "gpu_uuid": os.environ.get("FAKE_SEEN_UUID"),
    "min_window_seconds": float(args["--min-window"]),
    "correct": os.environ.get("FAKE_CORRECT", "1") == "1", "max_error": 1e-7,
    "tolerance": 1e-5, "sample_seconds": [seconds] * 5,
}))
"""
"""A child that prints a record at once, without torch: FAKE_TFLOPS, FAKE_CORRECT, FAKE_TIME_UTC
and FAKE_SEEN_UUID in its environment shape the record."""
