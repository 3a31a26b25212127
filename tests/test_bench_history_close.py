"""Benchmark records that wait for a full or read-only state dir, at a reload and at a stop.

The history keeps a record the disk refuses in memory and writes it at a later round
(tests/test_bench_history_faults.py). A reload of [collectors.benchmark] makes the
collector again, and the runtime closes the old one at a stop. Before, the records that
waited lived in the old instance only: a reload dropped them while the agent ran on, and a
stop dropped them without a word. What must hold: across a reload they still wait and are
written once when the disk takes them; at a close, one more write is tried, and what still
waits is said in a warning that names the file and the count. The disk is a real tmpfs,
filled or remounted read-only.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing

from agent.contracts.collector import CollectContext, CollectorDeps
from agent.runtime.blocking import PooledCaller
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings
from collectors.benchmark.history import HISTORY_FILE, HistoryFile
from collectors.benchmark.runner import ChildRunner
from tests.support.bench import RECORD_CHILD, FakeGpuActivity, deps, fake_child, series
from tests.support.disk import SmallDisk

UNSAVED = "gpuwarden_benchmark_history_unsaved_records"


@pytest.fixture
def caller() -> Iterator[PooledCaller]:
    pool = concurrent.futures.ThreadPoolExecutor(4)
    yield PooledCaller(pool, timeout=5.0)
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with SmallDisk(tmp_path / "state", size=1 << 20) as small:
        yield small


def remount(disk: SmallDisk, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk.path)], check=True)


class Rounds:
    """Benchmark collectors of one process (one `deps`, as the runtime's reload keeps it),
    a round each time `next` is called, every one due (120 s apart, period 60 s)."""

    def __init__(self, disk: SmallDisk, tmp_path: Path, caller: PooledCaller) -> None:
        self.deps: CollectorDeps = deps(disk.path)
        self.tmp_path = tmp_path
        self.caller = caller
        self.at = time.time()
        self.n = 0
        self.collector = self.build()

    def build(self) -> BenchmarkCollector:
        return BenchmarkCollector(
            BenchmarkSettings(when="always", period=60.0),
            self.deps,
            activity=FakeGpuActivity(),
            runner=ChildRunner(fake_child(self.tmp_path, "child", RECORD_CHILD), timeout=30),
        )

    async def next(self) -> float:
        """One round; the records that wait after it."""
        result = await self.collector.collect(
            CollectContext(caller=self.caller, now=self.at + 120 * self.n, round=self.n)
        )
        self.n += 1
        [waiting] = series(result.samples, UNSAVED)
        return waiting

    async def reload(self) -> None:
        await self.collector.close()
        self.collector = self.build()


def on_disk(disk: SmallDisk) -> int:
    """Records in the file, as a new reader finds them (one written twice counts twice)."""
    fresh = HistoryFile(disk.path / HISTORY_FILE)
    fresh.refresh()
    assert fresh.bad_lines == [], fresh.bad_lines
    return len(fresh.records)


@pytest.mark.parametrize("fault", ["full", "read-only"])
async def test_records_that_wait_survive_a_reload_and_are_written_once(
    disk: SmallDisk, tmp_path: Path, caller: PooledCaller, fault: str
) -> None:
    # From the start: a record half written into the slack of a page the file already has
    # would be a line cut short (tests/test_bench_history_faults.py), not what this tests.
    if fault == "full":
        disk.fill()
    else:
        remount(disk, "ro")
    rounds = Rounds(disk, tmp_path, caller)
    assert await rounds.next() == 1
    await rounds.reload()
    assert await rounds.next() == 2, "the reload dropped the record that waited"
    if fault == "full":
        disk.free()
    else:
        remount(disk, "rw")
    assert await rounds.next() == 0
    assert on_disk(disk) == 3


@pytest.mark.parametrize("fault", ["full", "read-only", "freed-before-the-stop"])
async def test_a_close_writes_what_waits_or_says_what_is_lost(
    disk: SmallDisk, tmp_path: Path, caller: PooledCaller, fault: str
) -> None:
    if fault == "read-only":
        remount(disk, "ro")
    else:
        disk.fill()
    rounds = Rounds(disk, tmp_path, caller)
    assert await rounds.next() == 1
    assert await rounds.next() == 2
    if fault == "freed-before-the-stop":
        disk.free()
    with structlog.testing.capture_logs() as logs:
        await rounds.collector.close()
    said = [e for e in logs if e.get("path") == str(disk.path / HISTORY_FILE)]
    if fault == "freed-before-the-stop":
        assert on_disk(disk) == 2, "the close did not write what waited"
        assert [e for e in said if e["log_level"] == "warning"] == []
        return
    if fault == "read-only":
        remount(disk, "rw")
    assert on_disk(disk) == 0
    warnings = [e for e in said if e["log_level"] == "warning" and "close" in e["event"]]
    assert len(warnings) == 1, logs
    assert warnings[0]["unsaved"] == 2
