"""What writing /metrics ourselves saves (exporters/exposition.py), against prometheus_client.

    python bench/exposition.py [--interpreters 7] [--renders 300] [--gpus 8]

Two tables, one run:

1. Resident memory of a fresh interpreter after importing what the daemon imports at start
   (`agent.program.cli`, `agent.program.registry`), with and without the prometheus_client
   modules exporters/prometheus.py imported before (`prometheus_client`,
   `prometheus_client.core`, `prometheus_client.process_collector`): VmRSS, the median of
   `--interpreters` interpreters of each kind, started in turn.
2. CPU time of one /metrics body of a full fake round of `--gpus` H200s (the GPU collector
   on the fake NVML, tests/support/nvml.py), process_* series included: the registry the sink
   held before (prometheus_client's `generate_latest`) against `PrometheusSink.metrics_body`'s
   way now; the median of `--renders` renders. The two bodies are checked equal first (the
   process_* values aside, which move between two reads).

The machine is shared: read the ratio, not the absolute figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client import generate_latest  # noqa: E402

from agent.contracts.model import Sample  # noqa: E402
from collectors.gpu.collector import GpuSettings  # noqa: E402
from collectors.gpu.metrics import FAMILIES  # noqa: E402
from exporters.exposition import ProcessMetrics, snapshot_text  # noqa: E402
from tests.support import prom_reference  # noqa: E402
from tests.support.nvml import GpuRig  # noqa: E402
from tests.support.nvml_fake import FakeGpu, FakeNvml  # noqa: E402

DAEMON = "import agent.program.cli, agent.program.registry"
OLD_RENDERER = (
    "import prometheus_client, prometheus_client.core, prometheus_client.process_collector"
)
PROBE = (
    "import sys\n{imports}\n"
    "rss = next(l for l in open('/proc/self/status') if l.startswith('VmRSS:')).split()[1]\n"
    "print(int(rss) * 1024, len(sys.modules))\n"
)


def fresh_interpreter(imports: str) -> tuple[int, int]:
    """(VmRSS bytes, modules loaded) of a new interpreter after `imports`."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(imports=imports)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=120,
    )
    rss, modules = out.stdout.split()
    return int(rss), int(modules)


def memory(interpreters: int) -> None:
    kinds = {
        "now (exporters/exposition.py)": DAEMON,
        "before (+ prometheus_client)": f"{DAEMON}\n{OLD_RENDERER}",
    }
    readings: dict[str, list[tuple[int, int]]] = {name: [] for name in kinds}
    for _ in range(interpreters):  # in turn, so that a busy moment hits both
        for name, imports in kinds.items():
            readings[name].append(fresh_interpreter(imports))
    print(f"Fresh interpreter after the daemon's imports (median of {interpreters})")
    print(f"  {'renderer':<32} {'VmRSS MB':>9} {'modules':>8}")
    medians = {}
    for name, values in readings.items():
        rss = statistics.median(v[0] for v in values)
        modules = statistics.median(v[1] for v in values)
        medians[name] = rss
        print(f"  {name:<32} {rss / 1e6:>9.2f} {modules:>8.0f}")
    now, before = medians.values()
    print(f"  {'saved':<32} {(before - now) / 1e6:>9.2f}")


async def gpu_round(gpus: int) -> list[Sample]:
    rig = GpuRig(FakeNvml([FakeGpu.h200(i) for i in range(gpus)]), GpuSettings(event_thread=False))
    try:
        await rig.collect()
        return list((await rig.collect()).samples)
    finally:
        await rig.close()


def cpu_per_call(render: Callable[[], bytes], count: int) -> float:
    """Median CPU seconds of one call (process time: this thread's work, not the others')."""
    times = []
    for _ in range(count):
        start = time.process_time_ns()
        render()
        times.append((time.process_time_ns() - start) / 1e9)
    return statistics.median(times)


def rendering(renders: int, gpus: int) -> None:
    samples = asyncio.run(gpu_round(gpus))
    registry = prom_reference.agent_registry(FAMILIES, samples)
    process = ProcessMetrics()

    def before() -> bytes:
        return generate_latest(registry)

    def now() -> bytes:
        return (snapshot_text(FAMILIES, samples) + process.text()).encode("utf-8")

    old_body, new_body = before(), now()
    marker = b"# HELP process_virtual_memory_bytes"
    if old_body.partition(marker)[0] != new_body.partition(marker)[0]:
        raise SystemExit("the two renderers disagree: tests/test_exposition.py should say why")
    print(
        f"\nOne /metrics body of {gpus} fake H200s: {len(samples)} samples, "
        f"{len(new_body) / 1e3:.0f} kB (median of {renders} renders)"
    )
    print(f"  {'renderer':<32} {'CPU ms':>9}")
    figures = {"before (prometheus_client)": before, "now (exporters/exposition.py)": now}
    results = {name: cpu_per_call(render, renders) for name, render in figures.items()}
    for name, seconds in results.items():
        print(f"  {name:<32} {seconds * 1e3:>9.2f}")
    old, new = results.values()
    print(f"  {'ratio before / now':<32} {old / new:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpreters", type=int, default=7)
    parser.add_argument("--renders", type=int, default=300)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    memory(args.interpreters)
    rendering(args.renders, args.gpus)


if __name__ == "__main__":
    main()
