"""A benchmark history an earlier life left torn or spoilt: each bad line is counted and said,
and no other record is lost.

The shapes are what a crash, a full disk or a stray writer leave: a line cut short (the last
one or one in the middle), a run of NUL bytes (ext4's blocks after a crash before the inode's
size was written), bytes that are not UTF-8, JSON that is not a record, a line nested past
the parser's depth. tests/test_bench_history_faults.py covers a cut line's effect on the
next append; here the daemon's view: before, the collector skipped such lines without a
word or a series, so a history that lost half its runs to damage looked like one with fewer
runs. What must hold: every good record is in the collector's history, the bad lines are
`gpuwarden_benchmark_history_bad_lines` and one warning that names the file.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing

from agent.contracts.collector import CollectContext
from agent.runtime.blocking import PooledCaller
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings
from collectors.benchmark.history import HISTORY_FILE
from collectors.benchmark.runner import ChildRunner
from tests.support.bench import RECORD_CHILD, FakeGpuActivity, deps, fake_child, record, series

T0 = 1_780_000_000.0
BAD = "gpuwarden_benchmark_history_bad_lines"


def good(n: int) -> bytes:
    return (record(50.0 + n, T0 + 60 * n).to_json() + "\n").encode()


SHAPES: dict[str, tuple[bytes, int]] = {
    # shape: (the bytes put between good lines 0-1 and 2-3, how many bad lines they are)
    "cut-in-the-middle": (good(9)[:57] + b"\n", 1),
    "nul-run": (b"\0" * 4096 + b"\n", 1),
    "not-utf8": (b"\xff\xfe\x80garbage\xc3\n", 1),
    "json-not-a-record": (b'[1, 2, 3]\n{"time_utc": 5}\n"text"\n', 3),
    "nested-too-deep": (b"[" * 100_000 + b"\n", 1),
    "two-cut-lines": (good(9)[:30] + b"\n" + good(10)[:90] + b"\n", 2),
}


@pytest.fixture
def caller() -> Iterator[PooledCaller]:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    yield PooledCaller(pool, timeout=10.0)
    pool.shutdown(wait=False, cancel_futures=True)


def collector_on(state: Path, tmp_path: Path) -> BenchmarkCollector:
    return BenchmarkCollector(
        BenchmarkSettings(when="always", period=3600.0),
        deps(state),
        activity=FakeGpuActivity(),
        runner=ChildRunner(fake_child(tmp_path, "child", RECORD_CHILD), timeout=30),
    )


@pytest.mark.parametrize("at_end", [False, True], ids=["between-lines", "at-the-end"])
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_bad_lines_are_counted_and_said_and_the_rest_are_kept(
    tmp_path: Path, caller: PooledCaller, shape: str, at_end: bool
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    spoilt, bad = SHAPES[shape]
    if at_end:  # the last write of the earlier life: no newline after it
        body = good(0) + good(1) + good(2) + good(3) + spoilt.rstrip(b"\n")
    else:
        body = good(0) + good(1) + spoilt + good(2) + good(3)
    path = state / HISTORY_FILE
    path.write_bytes(body)
    collector = collector_on(state, tmp_path)
    with structlog.testing.capture_logs() as logs:
        first = await collector.collect(CollectContext(caller=caller, now=time.time(), round=0))
        again = await collector.collect(CollectContext(caller=caller, now=time.time() + 1, round=1))
    assert series(first.samples, BAD) == [bad]
    assert series(again.samples, BAD) == [bad]
    times = sorted(r.time for r in collector.history.records)
    assert times[:4] == [T0 + 60 * n for n in range(4)], "a good record was lost"
    said = [e for e in logs if e.get("path") == str(path) and "unreadable" in e["event"]]
    assert len(said) == 1, logs  # once, not once per round
    assert said[0]["bad_lines"] == bad
