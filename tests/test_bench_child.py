"""The benchmark child: the real `python -m collectors.benchmark.child`, on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from collectors.benchmark.child import (
    EXIT_NO_DEVICE,
    EXIT_OUT_OF_MEMORY,
    EXIT_USAGE,
    PLANT_WRONG_RESULT_ENV,
    classify_failure,
)
from collectors.benchmark.history import BenchmarkRecord
from collectors.benchmark.request import PROFILES

pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")

REPO = Path(__file__).resolve().parents[1]
GUIDE_FIELDS = (
    "time_utc",
    "gpu_index",
    "gpu_name",
    "torch",
    "torch_cuda",
    "dtype",
    "matmul_precision",
    "size",
    "iterations",
    "median_seconds",
    "estimated_tflops",
)


def run_child(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    completed = subprocess.run(
        [sys.executable, "-m", "collectors.benchmark.child", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=120,
        check=False,
    )
    lines = [line for line in completed.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, completed.stdout
    return completed.returncode, json.loads(lines[0]), completed.stderr


class TestRecord:
    """A healthy run prints one record with the field guide's fields and more."""

    def test_cpu_run_prints_a_complete_correct_record(self) -> None:
        code, record, _ = run_child(
            "--device",
            "cpu",
            "--size",
            "128",
            "--iterations",
            "3",
            "--warmup",
            "1",
            "--samples",
            "3",
            "--min-window",
            "0.02",
        )
        assert code == 0
        for name in GUIDE_FIELDS:
            assert name in record, name
        assert record["dtype"] == "float32"
        assert record["matmul_precision"] == "highest"
        assert record["size"] == 128
        assert record["correct"] is True
        assert record["max_error"] < PROFILES["fp32"].tolerance
        assert len(record["sample_seconds"]) == 3
        # the window grew to the minimum: the iterations were scaled up from 3 as needed
        assert record["median_seconds"] >= 0.02
        assert record["estimated_tflops"] == pytest.approx(
            2 * 128**3 * record["iterations"] / record["median_seconds"] / 1e12
        )
        parsed = BenchmarkRecord.from_dict(record)
        assert parsed.profile == "fp32"
        assert parsed.duration_class == "min20ms"


class TestCorrectness:
    """The check against float64 catches a planted wrong block, in every profile."""

    @pytest.mark.parametrize("profile", ["fp32", "bf16"])
    def test_planted_wrong_result_is_reported_wrong(self, profile: str) -> None:
        code, record, _ = run_child(
            "--device",
            "cpu",
            "--profile",
            profile,
            "--size",
            "128",
            "--iterations",
            "1",
            "--warmup",
            "0",
            "--samples",
            "1",
            env={PLANT_WRONG_RESULT_ENV: "1"},
        )
        assert code == 0  # a wrong answer is still a record: the parent judges it
        assert record["correct"] is False
        assert record["max_error"] > PROFILES[profile].tolerance


class TestHealthyProducts:
    """Healthy products stay inside each profile's tolerance; a corrupted tile never does."""

    @pytest.mark.parametrize("profile", sorted(PROFILES))
    @pytest.mark.parametrize("size", [128, 384])
    def test_tolerance_holds_and_catches_a_tile(self, profile: str, size: int) -> None:
        import random

        import torch

        from collectors.benchmark.child import _plant_wrong_block, check_product

        spec = PROFILES[profile]
        torch.set_float32_matmul_precision(spec.matmul_precision)
        dtype = getattr(torch, spec.dtype)
        x = torch.randn(size, size, dtype=dtype)
        y = torch.randn(size, size, dtype=dtype)
        out = torch.mm(x, y)
        error, rows = check_product(torch, x, y, out, random.Random(1))
        assert rows == 16
        assert error is not None
        assert error <= spec.tolerance
        for seed in range(5):
            bad = out.clone()
            _plant_wrong_block(bad, random.Random(seed))
            bad_error, _ = check_product(torch, x, y, bad, random.Random(seed + 100))
            assert bad_error is not None
            assert bad_error > spec.tolerance

    def test_non_finite_output_is_wrong(self) -> None:
        import random

        import torch

        from collectors.benchmark.child import check_product

        x, y = torch.randn(128, 128), torch.randn(128, 128)
        out = torch.mm(x, y)
        out[:, 5] = float("nan")
        error, _ = check_product(torch, x, y, out, random.Random(0))
        assert error is None


class TestFailures:
    """Bad arguments and missing CUDA become JSON error objects with their exit codes."""

    def test_size_outside_the_profile_is_a_usage_error(self) -> None:
        code, output, _ = run_child("--device", "cpu", "--size", "8192")
        assert code == EXIT_USAGE
        assert output["error"] == "invalid_argument"
        assert "128-4096" in output["message"]

    def test_unknown_device_is_a_usage_error(self) -> None:
        code, output, _ = run_child("--device", "tpu")
        assert code == EXIT_USAGE
        assert output["error"] == "invalid_argument"

    def test_cuda_on_a_cpu_build_of_torch_is_cuda_unavailable(self) -> None:
        code, output, _ = run_child("--device", "0", "--size", "128")
        assert code == EXIT_NO_DEVICE
        assert output["error"] == "cuda_unavailable"
        assert "CUDA" in output["message"]


class TestClassification:
    """torch's error texts map to failure kinds a person can act on."""

    @pytest.mark.parametrize(
        ("text", "kind", "code"),
        [
            ("CUDA out of memory. Tried to allocate 2.00 GiB", "out_of_memory", EXIT_OUT_OF_MEMORY),
            (
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
                "out_of_memory",
                EXIT_OUT_OF_MEMORY,
            ),
            (
                "The NVIDIA driver on your system is too old (found version 11040)",
                "driver_too_old",
                EXIT_NO_DEVICE,
            ),
            (
                "CUDA driver version is insufficient for CUDA runtime version",
                "driver_too_old",
                EXIT_NO_DEVICE,
            ),
            ("Found no NVIDIA driver on your system.", "cuda_unavailable", EXIT_NO_DEVICE),
            ("CUDA error: invalid device ordinal", "device_not_found", EXIT_NO_DEVICE),
            ("CUDA error: an illegal memory access was encountered", "error", 5),
        ],
    )
    def test_messages(self, text: str, kind: str, code: int) -> None:
        failure = classify_failure(RuntimeError(text))
        assert failure.kind == kind
        assert failure.exit_code == code
        assert text in failure.message
