"""What MIG costs a gpu round, on the fake NVML, side by side: GPUs not in MIG mode, the same
GPUs in MIG mode with 7 instances each (an H200 split into seven 1g.18gb), and that with GPM
due. NVML calls per round are counted too: a GPU not in MIG mode must make none for MIG.

The fake answers in about a microsecond, a real call in 2-8 µs (docs/MEASUREMENTS.md): the
times are the collector's own cost, the call counts what a real GPU would be asked. Never run
against a real GPU (MIG mode is not something a benchmark may change).

    python bench/gpu_mig_round.py [--runs 50] [--gpus 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_round import BUSY_GPM, Timing, print_table, time_rounds
from collectors._nvml import NvmlBackend
from collectors.gpu.collector import GpuSettings
from tests.support.nvml_fake import FakeGpu, FakeNvml

MIG_NAMES = ("Mig", "InstanceId", "mig.")


def fleet(gpus: int, mig: bool) -> FakeNvml:
    out = []
    for index in range(gpus):
        gpu = FakeGpu.h200(index, gpm=dict(BUSY_GPM), mig_mode=(1, 1) if mig else (0, 0))
        if mig:
            for gi in range(7):
                gpu.add_mig(gi + 7, "1g.18gb", memory_used=2**30, gpm=dict(BUSY_GPM))
        out.append(gpu)
    return FakeNvml(out)


def calls(fake: FakeNvml) -> tuple[int, int]:
    """(all NVML calls, MIG calls) made on the fake's GPUs so far."""
    total: Counter[str] = Counter()
    for gpu in fake.gpus:
        total.update(gpu.calls)
    mig = sum(
        n
        for name, n in total.items()
        if any(m in name for m in MIG_NAMES) and not name.endswith("GetMigMode")
    )
    return sum(total.values()), mig


def measure(
    gpus: int, runs: int, mig: bool, label: str, settings: GpuSettings | None = None
) -> tuple[Timing, float, float]:
    fake = fleet(gpus, mig)
    backend = NvmlBackend(fake)
    backend.start()
    timing = asyncio.run(time_rounds(backend, runs, 1.0, label, settings))
    backend.stop()
    total, mig_calls = calls(fake)
    return timing, total / (runs + 1), mig_calls / (runs + 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    gpm_due = GpuSettings(event_thread=False, gpm_interval=1.0)
    rows = [
        measure(args.gpus, args.runs, False, "MIG off, steady"),
        measure(args.gpus, args.runs, True, "MIG on (7 instances a GPU), steady"),
        measure(args.gpus, args.runs, False, "MIG off, GPM due", gpm_due),
        measure(args.gpus, args.runs, True, "MIG on (7 instances a GPU), GPM due", gpm_due),
    ]
    print(f"gpu round on the fake NVML, {args.gpus} GPUs, median of {args.runs} runs")
    print_table([timing for timing, _, _ in rows], None)
    print(f"\n{'what':<44} {'NVML calls':>11} {'MIG calls':>10}  (per round, all GPUs)")
    for timing, total, mig in rows:
        print(f"{timing.label:<44} {total:>11.1f} {mig:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
