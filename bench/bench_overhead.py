"""What the benchmark costs and how well it measures, side by side with a plain torch.mm loop.

For `--runs` rounds, alternately: the agent's benchmark (the real child, started by the agent's
runner exactly as the collector starts it) and a plain `torch.mm` loop in its own process, at the
same device, dtype, size and iterations per window. Prints a table:

- throughput ratio benchmark / plain loop (goal >= 0.97: the harness adds no slowdown),
- coefficient of variation of the benchmark over the runs (goal <= 2 %),
- wall time of one benchmark run (python start, torch import, CUDA init, test, exit),
- on a GPU: compute processes left on the GPU afterwards (goal: none; NVML).

Usage: python bench/bench_overhead.py [--device cpu|N] [--profile fp32] [--size N] [--runs 5]
This process never imports torch: both sides run in children, so neither holds a CUDA context
while the other measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from collectors._nvml import NvmlBackend  # noqa: E402
from collectors.benchmark.collector import cuda_device_plan  # noqa: E402
from collectors.benchmark.gpus import GpuBackendUnavailable, NvmlActivity  # noqa: E402
from collectors.benchmark.request import PROFILES, Request, child_arguments  # noqa: E402
from collectors.benchmark.runner import ChildRunner  # noqa: E402

PLAIN_LOOP = r"""
import json, statistics, sys, time
import torch
device, dtype, precision, size, iterations, samples = sys.argv[1:7]
size, iterations, samples = int(size), int(iterations), int(samples)
device = torch.device(device)
torch.set_float32_matmul_precision(precision)
sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
with torch.inference_mode():
    x = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    y = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    out = torch.empty_like(x)
    for _ in range(5):
        torch.mm(x, y, out=out)
    sync()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(iterations):
            torch.mm(x, y, out=out)
        sync()
        times.append(time.perf_counter() - start)
median = statistics.median(times)
print(json.dumps({"tflops": 2 * size**3 * iterations / median / 1e12, "median_seconds": median}))
"""


def plain_loop(device: str, env: dict[str, str], request: Request, iterations: int) -> float:
    profile = request.profile
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            PLAIN_LOOP,
            device,
            profile.dtype,
            profile.matmul_precision,
            str(request.size),
            str(iterations),
            str(request.samples),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
        timeout=600,
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1])["tflops"])


def gpu_processes() -> int | None:
    """Compute processes on every GPU now; None without NVML."""
    activity = NvmlActivity(NvmlBackend())
    try:
        gpus = activity.gpus()
    except GpuBackendUnavailable:
        return None
    counts = [activity.compute_process_count(g.index) for g in gpus]
    return sum(c or 0 for c in counts)


async def measure(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    profile = PROFILES[args.profile]
    size = args.size or (256 if args.device == "cpu" else profile.default_size)
    env: dict[str, str] = {}
    device = "cpu"
    if args.device != "cpu":
        gpus = {g.index: g for g in NvmlActivity(NvmlBackend()).gpus()}
        device, env = cuda_device_plan(gpus[int(args.device)])
    request = Request(device, profile, size, args.iterations, 5, args.samples, args.min_window)
    runner = ChildRunner(timeout=600)
    bench_tflops: list[float] = []
    plain_tflops: list[float] = []
    walls: list[float] = []
    for run in range(args.runs):
        outcome = await runner.run(child_arguments(request), env)
        if outcome.record is None:
            raise SystemExit(
                f"benchmark failed: {outcome.failure} {outcome.message}\n{outcome.stderr_tail}"
            )
        record = outcome.record
        bench_tflops.append(float(record["estimated_tflops"]))
        walls.append(outcome.wall_seconds)
        plain_tflops.append(plain_loop(device, env, request, int(record["iterations"])))
        print(
            f"run {run + 1}: benchmark {bench_tflops[-1]:.3f} TFLOP/s "
            f"(x{record['iterations']}, window {record['median_seconds']:.3f} s, "
            f"correct={record['correct']}, max error {record['max_error']:.2g}), "
            f"plain loop {plain_tflops[-1]:.3f}, wall {walls[-1]:.2f} s",
            flush=True,
        )
    bench_median, plain_median = statistics.median(bench_tflops), statistics.median(plain_tflops)
    ratio = bench_median / plain_median
    cv = statistics.stdev(bench_tflops) / statistics.mean(bench_tflops) if args.runs > 1 else 0.0
    left = gpu_processes() if args.device != "cpu" else None
    return [
        ("device / profile / size", f"{args.device} / {profile.name} / {size}", ""),
        ("benchmark TFLOP/s (median of runs)", f"{bench_median:.3f}", ""),
        ("plain torch.mm TFLOP/s (median)", f"{plain_median:.3f}", ""),
        ("throughput ratio benchmark/plain", f"{ratio:.3f}", ">= 0.97"),
        (f"CV of the benchmark over {args.runs} runs", f"{cv * 100:.2f} %", "<= 2 %"),
        ("wall time of one run (median)", f"{statistics.median(walls):.2f} s", ""),
        ("compute processes left on GPUs", "n/a (cpu)" if left is None else str(left), "0"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or an NVML GPU index")
    parser.add_argument("--profile", default="fp32", choices=sorted(PROFILES))
    parser.add_argument("--size", type=int, default=0, help="0: 256 on cpu, else the profile's")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--min-window", type=float, default=0.5)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = asyncio.run(measure(args))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'value':>22}  goal")
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:>22}  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
