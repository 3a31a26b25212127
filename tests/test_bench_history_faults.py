"""The benchmark history when its state dir fails: a full disk (a real tmpfs), a short write
at the last free byte, a file that cannot be read, and a write that never returns (a FIFO in
the history's place: open() blocks in the kernel as on a dead file server).

What must hold: no result is lost, none is written twice, a line cut short by a full disk
spoils no other line, the collector's round ends on time with its metrics and events, the
records that wait are a metric, and they are written once the file takes them again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing

from agent.contracts.collector import CollectContext
from agent.runtime.blocking import PooledCaller
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings
from collectors.benchmark.history import HISTORY_FILE, BenchmarkRecord, HistoryFile
from collectors.benchmark.runner import ChildRunner
from tests.support.bench import (
    RECORD_CHILD,
    FakeGpuActivity,
    deps,
    fake_child,
    record,
    series,
)
from tests.support.disk import SmallDisk

T0 = 1_780_000_000.0
PAGE = os.sysconf("SC_PAGE_SIZE")
UNSAVED = "gpuwarden_benchmark_history_unsaved_records"


def records_on_disk(path: Path) -> HistoryFile:
    """What a new reader (a restarted agent, `gpuwarden bench --history`) finds there."""
    fresh = HistoryFile(path)
    fresh.refresh()
    return fresh


def times(history: HistoryFile) -> list[float]:
    return [r.time for r in history.records]


def line_of(r: BenchmarkRecord) -> int:
    return len(r.to_json()) + 1


def padded(at: float, length: int) -> BenchmarkRecord:
    """A record whose history line is `length` bytes long (its driver string padded)."""
    base = record(50.0, at)
    short = line_of(base)
    assert length >= short, (length, short)
    return record(50.0, at, driver="5" * (len(base.driver_version) + length - short))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with SmallDisk(tmp_path / "state", size=1 << 20) as small:
        yield small


class TestFullDisk:
    def test_a_record_the_disk_refuses_waits_then_is_saved_once(self, disk: SmallDisk) -> None:
        history = HistoryFile(disk.path / HISTORY_FILE)
        history.append(padded(T0, PAGE))  # a whole page: no slack left in it
        disk.fill()
        with pytest.raises(OSError, match="space") as refused:
            history.append(record(51.0, T0 + 60))
        assert refused.value.errno == errno.ENOSPC
        assert times(history) == [T0, T0 + 60], "the refused record is gone from memory"
        assert [r.time for r in history.unsaved] == [T0 + 60]
        assert times(records_on_disk(history.path)) == [T0]
        history.refresh()  # another writer's line, or none: what waits stays
        assert times(history) == [T0, T0 + 60]
        with pytest.raises(OSError, match="space"):
            history.save()  # still full: still waiting, nothing half-saved twice
        disk.free()
        assert history.save() == 1
        assert history.unsaved == []
        assert history.save() == 0
        on_disk = records_on_disk(history.path)
        assert times(on_disk) == [T0, T0 + 60]
        assert on_disk.bad_lines == []

    @pytest.mark.parametrize("slack", [1, 2, 57, 300])
    def test_a_line_cut_short_by_the_full_disk_spoils_no_other(
        self, disk: SmallDisk, slack: int
    ) -> None:
        """tmpfs gives out whole pages: with `slack` bytes left in the history's last page
        and no page free, the next line is written in part (a short write, no error from
        the kernel). That part must stay a line of its own: counted as bad, and the record
        written whole once there is room."""
        history = HistoryFile(disk.path / HISTORY_FILE)
        first = padded(T0, PAGE - slack)
        history.append(first)
        assert history.path.stat().st_size == PAGE - slack
        disk.fill()
        second = record(51.0, T0 + 60)
        assert line_of(second) > slack
        with pytest.raises(OSError, match="space") as refused:
            history.append(second)
        assert refused.value.errno == errno.ENOSPC
        assert history.path.stat().st_size == PAGE, "the kernel wrote the slack's bytes"
        disk.free()
        history.append(record(52.0, T0 + 120))
        assert history.unsaved == []
        on_disk = records_on_disk(history.path)
        assert times(on_disk) == [T0, T0 + 60, T0 + 120]
        assert len(on_disk.bad_lines) == 1, on_disk.bad_lines  # the cut part, alone

    def test_a_line_cut_short_before_the_agent_started(self, tmp_path: Path) -> None:
        """A history that already ends in a partial line (the disk filled under an older
        agent, or a crash mid-write): the next record starts a line of its own."""
        path = tmp_path / HISTORY_FILE
        path.write_text(record(50.0, T0).to_json() + "\n" + record(51.0, T0 + 60).to_json()[:40])
        history = HistoryFile(path)
        history.append(record(52.0, T0 + 120))
        on_disk = records_on_disk(path)
        assert times(on_disk) == [T0, T0 + 120]
        assert len(on_disk.bad_lines) == 1


# -- the collector: its round, its metrics, its records --------------------------------------


def collector_on(state_dir: Path, tmp_path: Path) -> BenchmarkCollector:
    runner = ChildRunner(fake_child(tmp_path, "child", RECORD_CHILD), timeout=30)
    return BenchmarkCollector(
        BenchmarkSettings(when="always", period=60.0),
        deps(state_dir),
        activity=FakeGpuActivity(),
        runner=runner,
    )


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    executor = concurrent.futures.ThreadPoolExecutor(4)
    yield executor
    executor.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def caller(pool: concurrent.futures.Executor) -> PooledCaller:
    """The runtime's own caller, one per collector: each call in a pool thread, given up
    after 1 s, and a call still hung is not started again."""
    return PooledCaller(pool, timeout=1.0)


def ctx(caller: PooledCaller, at: float, n: int) -> CollectContext:
    return CollectContext(caller=caller, now=at, round=n)


class TestCollector:
    async def test_a_history_that_cannot_be_read_loses_no_run(
        self, tmp_path: Path, caller: PooledCaller
    ) -> None:
        state = tmp_path / "state"
        (state / HISTORY_FILE).mkdir(parents=True)  # reading it fails: EISDIR
        collector = collector_on(state, tmp_path)
        with structlog.testing.capture_logs() as logs:
            result = await collector.collect(ctx(caller, time.time(), 0))
            again = await collector.collect(ctx(caller, time.time() + 120, 1))
        assert series(result.samples, "gpuwarden_benchmark_runs_total") == [1]
        assert series(result.samples, "gpuwarden_benchmark_flops_per_second")
        assert series(result.samples, UNSAVED) == [1]
        assert series(again.samples, UNSAVED) == [2]
        assert len(collector.history.records) == 2
        warnings = [e for e in logs if e["log_level"] == "warning" and "history" in e["event"]]
        assert len(warnings) == 1, warnings  # once per outage, not once per round

    @pytest.mark.parametrize("fresh_caller", [False, True], ids=["one-caller", "caller-per-round"])
    async def test_a_hung_history_write_ends_the_round_and_loses_nothing(
        self, tmp_path: Path, pool: concurrent.futures.Executor, fresh_caller: bool
    ) -> None:
        """open() of a FIFO for writing blocks until a reader comes: the write hangs in the
        kernel as on a dead mount. Each round ends within the call timeout with its record
        (the hung call is not asked again while it hangs; with a new caller each round, a
        second save does not start while the first hangs); when the hung write completes,
        what it wrote is the waiting record, and it is not written a second time."""
        shared = PooledCaller(pool, timeout=1.0)

        def caller() -> PooledCaller:
            return PooledCaller(pool, timeout=1.0) if fresh_caller else shared

        state = tmp_path / "state"
        state.mkdir()
        collector = collector_on(state, tmp_path)
        first = await collector.collect(ctx(caller(), time.time(), 0))
        assert series(first.samples, UNSAVED) == [0]
        path = state / HISTORY_FILE
        saved = path.read_text()
        path.unlink()
        os.mkfifo(path)
        os.link(path, tmp_path / "fifo")  # to release the hung open() once the path is back
        rounds = []
        for n in (1, 2):
            started = time.monotonic()
            rounds.append(
                await asyncio.wait_for(
                    collector.collect(ctx(caller(), time.time() + 120 * n, n)), 20
                )
            )
            assert time.monotonic() - started < 10, f"round {n} waited on the hung write"
        assert [series(r.samples, "gpuwarden_benchmark_runs_total") for r in rounds] == [[2], [3]]
        assert [series(r.samples, UNSAVED) for r in rounds] == [[1], [2]]
        # (The FIFO reads as an empty history: only the two that wait are in memory now.)
        waiting = list(collector.history.unsaved)
        assert len(waiting) == 2
        path.unlink()
        path.write_text(saved)
        reader = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)
        try:
            through = b""
            for _ in range(100):  # the hung open() returns, and writes what waited then
                await asyncio.sleep(0.05)
                with contextlib.suppress(BlockingIOError):
                    through += os.read(reader, 1 << 16)
                if through.endswith(b"\n"):
                    break
        finally:
            os.close(reader)
        written = [BenchmarkRecord.from_dict(json.loads(x)) for x in through.splitlines()]
        assert written == waiting[:1], "the hung write delivers the record it was given"
        later = await collector.collect(ctx(caller(), time.time() + 400, 3))
        assert series(later.samples, UNSAVED) == [0]
        # On disk: the first run's record, then the one that still waited and this round's;
        # the one the hung write delivered is not written a second time.
        on_disk = records_on_disk(path)
        assert len(on_disk.records) == 3
        assert on_disk.bad_lines == []
