"""Kernel-log throughput: parse + match per saved shape, and one read of the live /dev/kmsg.

Prints a table: lines per second for each shape (the H200 capture mixed with the fixture's
findings, repeated to about 100k lines), beside a bare regex pass over the same lines as the
reference floor. Run: `python bench/kernel_log.py [SAVED_LOG ...]`; each saved log named is
also scanned and summarised (shapes seen, malformed lines, findings by kind), which is how
captures from a real GPU host are checked.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.contracts.collector import MemoryKeyValueStore
from collectors.kernel_log.kmsg import KmsgReader
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import LogRecord, ParseStats, parse_lines

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "kernel_log"
CAPTURE = FIXTURES / "h200-kmsg-records.txt"
TARGET_LINES = 100_000


def lines_for(shape: str) -> list[str]:
    base = (FIXTURES / shape).read_text(errors="replace").splitlines()
    if shape == "kmsg.txt" and CAPTURE.exists():
        base = CAPTURE.read_text().splitlines() + base
    return base * max(1, TARGET_LINES // len(base))


def best_of(runs: int, fn: object) -> float:
    assert callable(fn)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def summarise(path: Path) -> None:
    stats = ParseStats()
    matchers = MatcherSet()
    shapes: Counter[str] = Counter()

    def counted(records: Iterable[LogRecord]) -> Iterator[LogRecord]:
        for record in records:
            shapes[record.format] += 1
            yield record

    lines = path.read_text(errors="replace").splitlines()
    findings = Counter(f.kind for f in matchers.scan(counted(parse_lines(lines, stats))))
    nvrm = sum(1 for line in lines if "NVRM" in line)
    print(
        f"{path.name}: {stats.lines} lines, {stats.records} records, {stats.malformed} "
        f"malformed {stats.malformed_examples[:2]}, shapes {dict(shapes)}, NVRM lines {nvrm}, "
        f"findings {dict(findings)}, ignored {dict(matchers.ignored)}"
    )


def main() -> None:
    for name in sys.argv[1:]:
        summarise(Path(name))
    xid = re.compile(r"NVRM: Xid")
    print(
        f"{'shape':<24}{'lines':>9}{'findings':>10}{'parse+match lines/s':>22}"
        f"{'bare regex lines/s':>20}"
    )
    for shape in (
        "kmsg.txt",
        "dmesg.txt",
        "dmesg-T.txt",
        "dmesg-decode-iso.txt",
        "journalctl-k.txt",
    ):
        lines = lines_for(shape)
        found: list[int] = []

        def full(lines: list[str] = lines, found: list[int] = found) -> None:
            found.append(len(list(MatcherSet().scan(parse_lines(lines, ParseStats())))))

        def bare(lines: list[str] = lines) -> None:
            sum(1 for line in lines if xid.search(line))

        t_full, t_bare = best_of(3, full), best_of(3, bare)
        print(
            f"{shape:<24}{len(lines):>9}{found[-1]:>10}{len(lines) / t_full:>22,.0f}"
            f"{len(lines) / t_bare:>20,.0f}"
        )
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        print(f"/dev/kmsg: not readable here ({exc.strerror})")
        return
    reader = KmsgReader(
        Path("/dev/kmsg"), Path("/proc/sys/kernel/random/boot_id"), MemoryKeyValueStore()
    )
    started = time.perf_counter()
    batch = reader.read()
    took = time.perf_counter() - started
    reader.close()
    print(
        f"/dev/kmsg: {len(batch.records)} records read and parsed in {took * 1e3:.1f} ms "
        f"({took / max(1, len(batch.records)) * 1e6:.1f} µs per record), "
        f"malformed {batch.malformed}, lost {batch.lost}"
    )
    nvrm = [r for r in batch.records if "NVRM" in r.message]
    facilities = Counter(r.facility for r in nvrm)
    findings = Counter(f.kind for f in MatcherSet().scan(batch.records))
    print(
        f"/dev/kmsg NVRM records: {len(nvrm)}, by facility {dict(facilities)}; "
        f"findings {dict(findings)}"
    )
    for record in nvrm[:5]:
        print(f"  {record.seq} {record.facility},{record.level} {record.message[:110]}")


if __name__ == "__main__":
    main()
