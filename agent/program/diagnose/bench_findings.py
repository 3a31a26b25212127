"""`check --bench`: one benchmark run per GPU through the benchmark collector's own `benchmark`
(the child process, its correctness check, baseline and peer ratios), as `gpuwarden bench`.

The history is copied into check's scratch state dir first: the ratios compare with the host's
past runs, and the host's history file is left as it was (check appends nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time

from agent.contracts.collector import CollectContext
from agent.contracts.config import Config
from agent.contracts.model import Severity
from agent.program import output
from agent.program.diagnose.collect_once import OneShotCollectors
from agent.program.diagnose.findings import Finding, Status
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings, RunResult
from collectors.benchmark.events import FAILURE_ACTIONS
from collectors.benchmark.gpus import GpuBackendUnavailable
from collectors.benchmark.history import HistoryFile

AREA = "bench"


async def check_bench(runner: OneShotCollectors, config: Config) -> list[Finding]:
    configured = config.collectors.get("benchmark")
    settings = configured if isinstance(configured, BenchmarkSettings) else BenchmarkSettings()
    source = HistoryFile.in_state_dir(config.state_dir).path
    if source.is_file():
        await asyncio.to_thread(
            shutil.copyfile, source, HistoryFile.in_state_dir(runner.scratch_dir).path
        )
    built, _ = runner.build("benchmark", settings)
    assert isinstance(built, BenchmarkCollector)
    collector = built
    caller = runner.caller("benchmark", settings.timeout)
    try:
        gpus = await caller.call("benchmark:gpus", collector.activity.gpus)
    except GpuBackendUnavailable as exc:
        return [
            Finding(AREA, "matmul benchmark", Status.SKIP, f"no GPU to test ({exc})", check=AREA)
        ]
    if not gpus:
        return [
            Finding(AREA, "matmul benchmark", Status.SKIP, "NVML found no GPU to test", check=AREA)
        ]
    await asyncio.to_thread(collector.history.refresh)
    findings = []
    try:
        for gpu in gpus:  # one after the other: side by side they would measure each other
            ctx = CollectContext(caller=caller, now=time.time(), round=0)
            findings.append(judge(await collector.benchmark(ctx, gpu, gpus)))
    finally:
        await collector.close()
    return findings


def judge(result: RunResult) -> Finding:
    line = _judge(result)
    return dataclasses.replace(
        line,
        check=AREA,
        subject=f"GPU {result.gpu.index}",
        data={"gpus": [result.gpu.index]},
    )


def _judge(result: RunResult) -> Finding:
    gpu, record, outcome = result.gpu, result.record, result.outcome
    name = f"GPU {gpu.index} benchmark"
    if record is None:
        tail = outcome.stderr_tail.strip().splitlines()[-1:] or [""]
        return Finding(
            AREA,
            name,
            Status.FAIL,
            f"the test gave no result ({outcome.failure}): {outcome.message} {tail[0]}".strip(),
            FAILURE_ACTIONS.get(
                outcome.failure,
                f"run gpuwarden bench --device {gpu.index} for the full output; check the "
                "kernel log for Xids",
            ),
        )
    cuda = f"CUDA {record.torch_cuda}" if record.torch_cuda else "CPU-only build"
    detail = (
        f"{record.estimated_tflops:.1f} TFLOP/s, {record.profile} size {record.size} "
        f"(torch {record.torch or 'version unknown'}, {cuda})"
    )
    ratios = [
        f"{label} ratio {value:.2f}"
        for label, value in (("baseline", record.baseline_ratio), ("peer", record.peer_ratio))
        if value is not None
    ]
    if ratios:
        detail += "; " + ", ".join(ratios)
    if record.correct is False:
        return Finding(
            AREA,
            name,
            Status.FAIL,
            f"WRONG RESULT: max error {output.shown(record.max_error)} over tolerance "
            f"{output.shown(record.tolerance)}; {detail}",
            "take the GPU out of service: a wrong product is silent data corruption",
        )
    worst = max(
        (e for e in result.events if e.severity >= Severity.WARNING),
        key=lambda e: e.severity,
        default=None,
    )
    if worst is not None:
        return Finding(
            AREA,
            name,
            Status.from_severity(worst.severity),
            f"{worst.message}; {detail}",
            worst.action,
            worst.repair_action,
        )
    return Finding(AREA, name, Status.OK, detail)
