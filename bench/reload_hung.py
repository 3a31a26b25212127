"""Threads and stall events over repeated reloads with every GPU hung, side by side: the
runtime as it is (each collector keeps its pool across a reload) against the same runtime made
to drop the pool at each reload (what every reload did before; then the repeated events also
had the GPU index as subject, which the stored identity now replaces with the UUID).

The fake NVML stands in for the driver: after two good rounds every GPU's calls block.

    python bench/reload_hung.py [--gpus 4] [--reloads 6]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog

from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors.gpu.collector import GpuSettings
from tests.support.nvml_fake import FakeGpu, FakeNvml

Row = tuple[int, int, int, int, int]
"""threads, hung calls, gpu_unresponsive events, of them with a UUID subject, call_hung."""


def count(runtime: Runtime) -> Row:
    events = list(runtime.recent_events)
    unresponsive = [e for e in events if e.kind == "gpu_unresponsive"]
    return (
        threading.active_count(),
        runtime.hung_calls(),
        len(unresponsive),
        sum(e.subject.startswith("GPU-") for e in unresponsive),
        sum(e.kind == "call_hung" for e in events),
    )


async def run(gpus: int, reloads: int, keep_pool: bool) -> list[Row]:
    fake = FakeNvml([FakeGpu.h200(i) for i in range(gpus)])
    release = threading.Event()
    settings = GpuSettings(interval=0.1, timeout=0.2, event_thread=False)
    base = config.parse({"prometheus": {"enabled": False}})
    runtime = Runtime(
        dataclasses.replace(base, collectors={"gpu": settings}),
        StateStore.in_memory(),
        collectors=registry.COLLECTORS,
        sinks=registry.SINKS,
    )
    runtime.shared.put(NvmlBackend, NvmlBackend(fake))
    await runtime.start()
    rows: list[Row] = []
    try:
        await asyncio.sleep(0.3)
        for gpu in fake.gpus:
            gpu.hang = release
        await asyncio.sleep(0.8)
        rows.append(count(runtime))
        for i in range(reloads):
            if not keep_pool:
                runtime.pools.clear()  # the old behaviour: a new pool and caller per reload
            settings = settings.replace(interval=0.1 + (i + 1) / 1000)
            await runtime.reload(dataclasses.replace(runtime.config, collectors={"gpu": settings}))
            await asyncio.sleep(0.8)
            rows.append(count(runtime))
    finally:
        release.set()
        await runtime.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--reloads", type=int, default=6)
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL)
    )  # quiet
    kept = asyncio.run(run(args.gpus, args.reloads, keep_pool=True))
    dropped = asyncio.run(run(args.gpus, args.reloads, keep_pool=False))
    print(
        f"{args.gpus} GPUs hung; threads / hung calls / gpu_unresponsive (UUID subject) / call_hung"
    )
    print(f"{'':<10} {'pool kept (now)':>26} {'pool dropped each reload':>26}")
    for i, (a, b) in enumerate(zip(kept, dropped, strict=True)):
        label = "hung" if i == 0 else f"reload {i}"
        print(
            f"{label:<10} {a[0]:>5} {a[1]:>4} {a[2]:>4} ({a[3]:>2}) {a[4]:>5}   "
            f"{b[0]:>5} {b[1]:>4} {b[2]:>4} ({b[3]:>2}) {b[4]:>5}"
        )


if __name__ == "__main__":
    main()
