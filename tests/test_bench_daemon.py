"""The daemon side never loads torch: the collector runs in a fresh process, then we look."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import asyncio, json, sys
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings
from tests.support.bench import FakeGpuActivity, context, cpu_plan, deps, gpu

async def main():
    settings = BenchmarkSettings(when="always", size=128, iterations=2, warmup=1, samples=2,
                                 min_window_seconds=0.0, period=60.0)
    collector = BenchmarkCollector(settings, deps(__import__("pathlib").Path(sys.argv[1])),
                                   activity=FakeGpuActivity(devices=[gpu(0), gpu(1)]),
                                   device_plan=cpu_plan)
    names = []
    for i in range(2):
        result = await collector.collect(context(round_number=i))
        names += [s.family.name for s in result.samples]
    print(json.dumps({"torch": "torch" in sys.modules,
                      "cuda_modules": sorted(m for m in sys.modules if "cuda" in m.lower()),
                      "flops_samples": names.count("gpuwarden_benchmark_flops_per_second")}))

asyncio.run(main())
"""


class TestNoTorchInTheDaemon:
    """After real benchmark runs (real child, on the CPU) the daemon process has no torch."""

    def test_collector_runs_leave_no_torch_in_sys_modules(self, tmp_path: Path) -> None:
        completed = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path / "state")],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert completed.returncode == 0, completed.stderr
        report = json.loads(completed.stdout.strip().splitlines()[-1])
        # two GPUs, one run per round: the second round shows both GPUs' throughput
        assert report["flops_samples"] == 3
        assert report["torch"] is False
        assert report["cuda_modules"] == []
        history = (tmp_path / "state" / "benchmark-history.jsonl").read_text().splitlines()
        assert len(history) == 2
