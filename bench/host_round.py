"""CPU per host collection round (disk + processes + system) next to node_exporter's scrape.

Spawns N sleeping processes (default 2000, always cleaned up), then, in one run and interleaved
block by block so that the machine's noise hits both alike:

- gpuwarden: one round of the disk, processes and system collectors through the real
  PooledCaller, plus rendering the samples in the Prometheus text format (what a scrape of the
  agent costs on top: nothing, it renders the last snapshot, but it is counted here to be fair);
  CPU from time.process_time() (all threads of this process).
- node_exporter (Debian's /usr/bin/prometheus-node-exporter) with only its processes and
  filesystem collectors, on a free loopback port; CPU per scrape from the utime + stime of its
  /proc/<pid>/stat (clock ticks, so many scrapes per block).

The facts are comparable but not identical: node_exporter's processes collector also counts
threads (it reads /proc/<pid>/task/*/stat), gpuwarden also tracks D-state durations and zombies
per parent. The table says how many series each produced.

    python bench/host_round.py [--processes 2000] [--blocks 5] [--per-block 20]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Event, Sample
from agent.runtime.blocking import PooledCaller
from collectors.disk.collector import SPEC as DISK_SPEC
from collectors.processes import SPEC as PROCESSES_SPEC
from collectors.system import SPEC as SYSTEM_SPEC
from exporters.exposition import render
from tests.support.ports import free_port, wait_for_port

NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
MAX_PROCESSES = 5000
TICK = os.sysconf("SC_CLK_TCK")


@contextmanager
def sleepers(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` sleeping children; killed by pid and waited for on the way out, whatever happens."""
    children: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            children.append(
                subprocess.Popen(
                    ["sleep", "3600"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield children
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()


@contextmanager
def node_exporter() -> Iterator[tuple[int, int]]:
    port = free_port()
    proc = subprocess.Popen(
        [
            NODE_EXPORTER,
            f"--web.listen-address=127.0.0.1:{port}",
            "--collector.disable-defaults",
            "--collector.processes",
            "--collector.filesystem",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield proc.pid, port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_ticks(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime (14) and stime (15), numbered from state (3)


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        body: bytes = response.read()
    return body


class HostRound:
    """The three host collectors, run the way the runtime runs them."""

    def __init__(self, scan_threads: bool) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(4)
        events: list[Event] = []
        deps = CollectorDeps(
            "bench", Path("/tmp"), MemoryKeyValueStore(), SharedServices(), events.append
        )
        self.collectors = [
            DISK_SPEC.make(DISK_SPEC.defaults(), deps),
            PROCESSES_SPEC.make(PROCESSES_SPEC.defaults().replace(scan_threads=scan_threads), deps),
            SYSTEM_SPEC.make(SYSTEM_SPEC.defaults(), deps),
        ]
        self.callers = [PooledCaller(self.executor, 5.0) for _ in self.collectors]
        self.families = [f for c in self.collectors for f in c.families()]
        self.round = 0

    async def once(self) -> list[Sample]:
        samples: list[Sample] = []
        for collector, caller in zip(self.collectors, self.callers, strict=True):
            ctx = CollectContext(caller=caller, now=time.time(), round=self.round)
            samples += (await collector.collect(ctx)).samples
        self.round += 1
        return samples

    async def measure(self, rounds: int) -> tuple[float, float, int, int]:
        """(CPU seconds per round, wall seconds per round, samples, exposition bytes)."""
        cpu0, wall0 = time.process_time(), time.perf_counter()
        body = b""
        samples: list[Sample] = []
        for _ in range(rounds):
            samples = await self.once()
            body = render(self.families, samples)
        return (
            (time.process_time() - cpu0) / rounds,
            (time.perf_counter() - wall0) / rounds,
            len(samples),
            len(body),
        )


def measure_exporter(pid: int, port: int, scrapes: int) -> tuple[float, float, int, int]:
    ticks0, wall0 = cpu_ticks(pid), time.perf_counter()
    body = b""
    for _ in range(scrapes):
        body = scrape(port)
    cpu = (cpu_ticks(pid) - ticks0) / TICK / scrapes
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return cpu, (time.perf_counter() - wall0) / scrapes, series, len(body)


def count_processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


async def run(args: argparse.Namespace) -> None:
    with_threads, without_threads = HostRound(scan_threads=True), HostRound(scan_threads=False)
    with sleepers(args.processes), node_exporter() as (pid, port):
        scrape(port)
        await with_threads.measure(2)  # warm caches and imports on both sides
        await without_threads.measure(2)
        ours: list[tuple[float, float, int, int]] = []
        ours_lean: list[tuple[float, float, int, int]] = []
        theirs: list[tuple[float, float, int, int]] = []
        for _ in range(args.blocks):
            ours.append(await with_threads.measure(args.per_block))
            theirs.append(measure_exporter(pid, port, args.per_block))
            ours_lean.append(await without_threads.measure(args.per_block))
        total = count_processes()
    with_threads.executor.shutdown()
    without_threads.executor.shutdown()
    rusage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        f"processes on the host during the run: {total} ({args.processes} sleepers spawned); "
        f"{args.blocks} blocks x {args.per_block} rounds/scrapes; CPU {os.cpu_count()} cores"
    )
    print()
    print(
        f"{'':36} {'CPU ms/round':>13} {'(min..max)':>16} {'wall ms':>9} {'series':>7} {'bytes':>8}"
    )
    for name, rows in (
        ("gpuwarden disk+processes+system", ours),
        ("  same, scan_threads = false", ours_lean),
        ("node_exporter processes+filesystem", theirs),
    ):
        cpu = [r[0] * 1000 for r in rows]
        wall = statistics.median(r[1] * 1000 for r in rows)
        print(
            f"{name:36} {statistics.median(cpu):13.1f} "
            f"{f'({min(cpu):.1f}..{max(cpu):.1f})':>16} {wall:9.1f} {rows[-1][2]:7d} {rows[-1][3]:8d}"
        )
    print()
    print(f"this process's max RSS: {rusage.ru_maxrss / 1024:.0f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--per-block", type=int, default=20)
    args = parser.parse_args()
    if not 0 <= args.processes <= MAX_PROCESSES:
        parser.error(f"--processes must be 0..{MAX_PROCESSES}")
    if not os.access(NODE_EXPORTER, os.X_OK):
        print(
            f"{NODE_EXPORTER} is missing: apt-get install prometheus-node-exporter", file=sys.stderr
        )
        return 1

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the context managers: cleanup runs

    signal.signal(signal.SIGTERM, stop)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
