"""Where a steady GPU round's time goes beyond the NVML calls: the hand-off to a pool thread.

Four ways of making the same steady round, taken in turns (so that all see the machine in the
same state), back to back and then one per second as the agent runs them:

- the agent's: the GPU collector's caller, which waits for the answer in place for up to 2 ms
  (agent/runtime/rounds.py WAIT_IN_PLACE);
- answers awaited: the same pool, every answer awaited through the event loop (what every other
  collector does, and what the GPU collector did before);
- inline: NVML called on the event loop's own thread. No hand-off, so no way to time out a hung
  call without freezing the agent: not an option, only the floor the hand-off is measured from;
- bare: the round's NVML calls replayed straight on pynvml, no collector at all.

Then the phases of the agent's round: before the calls, the pool thread starting, the read in
that thread, the answer reaching the loop, and the rest of the round. With a driver present the
real GPUs are measured; without one the fake NVML (which answers in about a microsecond).

    python bench/gpu_handoff.py [--runs 400] [--paced 15] [--fake]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.contracts.collector import (
    BlockingCaller,
    Call,
    CollectContext,
    CollectorDeps,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.runtime.blocking import PooledCaller
from agent.runtime.rounds import collector_pool
from bench.gpu_round import make_backend, replay, steady_calls
from collectors._nvml import NvmlBackend
from collectors.gpu.collector import GpuCollector, GpuSettings
from tests.support.bench import DirectCaller  # every call on the loop's own thread


class Stamps:
    """perf_counter stamps of one round's phases (the agent's variant)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.rows: list[tuple[float, ...]] = []


class StampedCaller:
    """The agent's caller, stamping when the round's calls start and when they answer."""

    def __init__(self, inner: PooledCaller, stamps: Stamps) -> None:
        self.inner = inner
        self.stamps = stamps

    async def call(self, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self.inner.call(key, fn, *args, **kwargs)

    async def call_each(self, calls: Sequence[Call[Any]]) -> list[Any]:
        self.stamps.marks["calls"] = time.perf_counter()
        outcomes = await self.inner.call_each(calls)
        self.stamps.marks["answered"] = time.perf_counter()
        return outcomes


def stamp_reads(backend: NvmlBackend, stamps: Stamps) -> None:
    """Stamp the start and end of every read_gpu, in the thread that makes it."""
    read = backend.read_gpu

    def stamped(*args: Any, **kwargs: Any) -> Any:
        stamps.marks["read"] = time.perf_counter()
        try:
            return read(*args, **kwargs)
        finally:
            stamps.marks["read_end"] = time.perf_counter()

    backend.read_gpu = stamped  # type: ignore[method-assign]


PHASES = (
    "round start -> calls start",
    "calls start -> read starts in the pool thread",
    "the read (NVML calls and their mapping)",
    "read ends -> the answer on the loop",
    "answer -> round end (samples, checks)",
)


async def measure(
    backend: NvmlBackend,
    calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]],
    stamps: Stamps,
    runs: int,
    gap: float,
) -> None:
    shared = SharedServices()
    shared.put(NvmlBackend, backend)
    deps = CollectorDeps(
        "bench", Path("/nonexistent"), MemoryKeyValueStore(), shared, lambda event: None
    )
    pool = collector_pool("gpu", 5.0, lambda event: None)
    stamps.rows.clear()
    callers: dict[str, BlockingCaller] = {
        "the agent's (waits in place <= 2 ms)": StampedCaller(pool.caller, stamps),
        "answers awaited through the loop": PooledCaller(pool.executor, 5.0),
        "inline (no hand-off: the floor)": DirectCaller(),
    }
    collectors = {name: GpuCollector(GpuSettings(event_thread=False), deps) for name in callers}
    now = time.time()
    for name, collector in collectors.items():  # first round: static and slow reads
        await collector.collect(CollectContext(callers[name], now, 0))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in [*callers, "bare"]}
    for number in range(1, runs + 1):
        now += 1.0
        for name, collector in collectors.items():
            if gap:
                await asyncio.sleep(gap)
            stamps.marks.clear()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await collector.collect(CollectContext(callers[name], now, number))
            end = time.perf_counter()
            times[name].append((end - wall0, time.process_time() - cpu0))
            marks = stamps.marks
            if isinstance(callers[name], StampedCaller) and "read" in marks:
                stamps.rows.append(
                    (
                        marks["calls"] - wall0,
                        marks["read"] - marks["calls"],
                        marks["read_end"] - marks["read"],
                        marks["answered"] - marks["read_end"],
                        end - marks["answered"],
                    )
                )
        if gap:
            await asyncio.sleep(gap)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        replay(calls)
        times["bare"].append((time.perf_counter() - wall0, time.process_time() - cpu0))
    for collector in collectors.values():
        await collector.close()
    pool.shutdown()
    regime = f"one per {gap:g} s" if gap else "back to back"
    print(f"\n{regime}, {runs} rounds of each, in turns")
    print(f"{'steady round':<40} {'wall us':>8} {'p25':>7} {'p75':>7} {'CPU us':>7} {'x bare':>7}")
    floor = statistics.median(t[0] for t in times["bare"])
    for name, rows in times.items():
        walls = sorted(t[0] for t in rows)
        p25, _, p75 = statistics.quantiles(walls, n=4)
        wall = statistics.median(walls)
        cpu = statistics.median(t[1] for t in rows)
        label = f"bare pynvml, the same {len(calls)} calls" if name == "bare" else name
        print(
            f"{label:<40} {wall * 1e6:>8.1f} {p25 * 1e6:>7.1f} {p75 * 1e6:>7.1f} "
            f"{cpu * 1e6:>7.1f} {wall / floor:>7.2f}"
        )
    if stamps.rows:
        print("the agent's round, its phases (medians):")
        for index, phase in enumerate(PHASES):
            median = statistics.median(row[index] for row in stamps.rows)
            print(f"  {phase:<46} {median * 1e6:>8.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--runs", type=int, default=400, help="back-to-back rounds of each")
    parser.add_argument("--paced", type=int, default=15, help="rounds of each, one per second")
    parser.add_argument("--fake", action="store_true", help="measure the fake even with a GPU")
    args = parser.parse_args()
    backend, what = make_backend(args.fake, 1)
    print(f"gpu round hand-off, {what}")
    calls = steady_calls(backend)
    stamps = Stamps()
    stamp_reads(backend, stamps)
    asyncio.run(measure(backend, calls, stamps, args.runs, 0.0))
    if args.paced:
        asyncio.run(measure(backend, calls, stamps, args.paced, 1.0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
