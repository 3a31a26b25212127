"""The benchmark on a real NVIDIA GPU (device machine: `pytest -m gpu tests/test_bench_gpu.py`).

Skipped where NVML finds no GPU or torch has no CUDA. Uses the real NVML activity source, the
real child pinned by UUID, and checks that nothing is left on the GPU afterwards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from collectors._nvml import NvmlBackend
from collectors.benchmark.child import PLANT_WRONG_RESULT_ENV
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings, Profile
from collectors.benchmark.gpus import GpuBackendUnavailable, GpuIdentity, NvmlActivity
from collectors.benchmark.runner import ChildRunner
from tests.support.bench import context, deps, series

pytestmark = pytest.mark.gpu


@pytest.fixture
def activity() -> NvmlActivity:
    real = NvmlActivity(NvmlBackend())
    try:
        if not real.gpus():
            pytest.skip("NVML finds no GPU")
    except GpuBackendUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")
    return real


def _wait_until_no_process(activity: NvmlActivity, gpu: GpuIdentity) -> int | None:
    deadline = time.monotonic() + 10
    count = activity.compute_process_count(gpu.index)
    while count and time.monotonic() < deadline:
        time.sleep(0.2)
        count = activity.compute_process_count(gpu.index)
    return count


class TestOnGpu:
    """A real run per profile on GPU 0: right UUID, right answer, nothing left behind."""

    @pytest.mark.parametrize(
        ("profile", "size"), [("fp32", 2048), ("tf32", 4096), ("bf16", 8192), ("fp16", 8192)]
    )
    async def test_run_is_correct_and_pinned(
        self, tmp_path: Path, activity: NvmlActivity, profile: Profile, size: int
    ) -> None:
        settings = BenchmarkSettings(when="always", profile=profile, size=size)
        collector = BenchmarkCollector(settings, deps(tmp_path / "state"), activity=activity)
        gpus = activity.gpus()
        result = await collector.benchmark(context(), gpus[0], gpus)
        assert result.record is not None, (result.outcome.message, result.outcome.stderr_tail)
        record = result.record
        assert record.gpu_uuid == gpus[0].uuid
        assert record.correct is True
        assert record.max_error is not None
        assert record.median_seconds >= settings.min_window_seconds
        print(
            json.dumps(
                {
                    "profile": profile,
                    "tflops": record.estimated_tflops,
                    "max_error": record.max_error,
                    "iterations": record.iterations,
                    "wall": result.outcome.wall_seconds,
                }
            )
        )
        assert _wait_until_no_process(activity, gpus[0]) == 0

    async def test_planted_wrong_result_is_critical(
        self, tmp_path: Path, activity: NvmlActivity
    ) -> None:
        settings = BenchmarkSettings(when="always", size=2048, min_window_seconds=0.0)
        runner = ChildRunner(timeout=120, env={PLANT_WRONG_RESULT_ENV: "1"})
        collector = BenchmarkCollector(
            settings, deps(tmp_path / "state"), activity=activity, runner=runner
        )
        result = await collector.collect(context())
        assert [e.kind for e in result.events] == ["benchmark_wrong_result"]
        assert series(result.samples, "gpuwarden_benchmark_correct") == [0]

    async def test_idle_gate_reads_the_real_gpu(
        self, tmp_path: Path, activity: NvmlActivity
    ) -> None:
        settings = BenchmarkSettings(idle_rounds=2, size=1024, min_window_seconds=0.1)
        collector = BenchmarkCollector(settings, deps(tmp_path / "state"), activity=activity)
        first = await collector.collect(context(round_number=0))
        assert series(first.samples, "gpuwarden_benchmark_runs_total") == [0]
        second = await collector.collect(context(round_number=1))
        # an idle lent GPU: the second quiet round opens the gate and the test runs
        assert series(second.samples, "gpuwarden_benchmark_runs_total") == [1]
        assert series(second.samples, "gpuwarden_benchmark_correct") == [1]
