"""Kernel-log throughput: parse alone and parse + match per saved shape, `gpuwarden scan`
against a bare loop, the followed-file reader on a big log, and one read of the live /dev/kmsg.

Prints two tables. The first: lines per second for each shape (the H200 capture mixed with the
fixture's findings, repeated to about 100k lines), parsing alone and with the matchers, beside
a bare regex pass over the same lines. The second: `scan`'s path (scan_lines over the opened file, as the command runs it)
against two bare Python loops over the same file in the same run, which only test each line
for the matchers' trigger words (`MatcherSet().triggers`): `any(p in line for p in PREFIXES)`
and one compiled alternation; and the path without the prefilter (every line parsed and
matched). Files: a 200k-line log of the capture's noise alone, and one with the fixture's
findings mixed in (1 line in 18). Run: `python bench/kernel_log.py [SAVED_LOG ...]`; each
saved log named is also scanned and summarised (shapes seen, malformed lines, findings by
kind), which is how captures from a real GPU host are checked. Last, the followed-file
reader's lines per second and RSS growth reading a 64 MiB log to its end in its bounded
batches.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.contracts.collector import MemoryKeyValueStore
from agent.program.commands.scan import scan_stream
from collectors.kernel_log.kmsg import FileLogReader, KmsgReader
from collectors.kernel_log.lines import iter_lines
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import LogRecord, ParseStats, parse_lines

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "kernel_log"
CAPTURE = FIXTURES / "h200-kmsg-records.txt"
TARGET_LINES = 100_000


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").split("\n")[:-1]  # only \n ends a line


def lines_for(shape: str) -> list[str]:
    base = _lines(FIXTURES / shape)
    if shape == "kmsg.txt" and CAPTURE.exists():
        base = _lines(CAPTURE) + base
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

    with path.open("rb") as handle:
        records = counted(parse_lines(iter_lines(handle), stats))
        findings = Counter(f.kind for f in matchers.scan(records))
    with path.open("rb") as handle:
        nvrm = sum(1 for line in iter_lines(handle) if line is not None and "NVRM" in line)
    print(
        f"{path.name}: {stats.lines} lines, {stats.records} records, {stats.malformed} "
        f"malformed {stats.malformed_examples[:2]}, shapes {dict(shapes)}, NVRM lines {nvrm}, "
        f"findings {dict(findings)}, ignored {dict(matchers.ignored)}"
    )


SCAN_LINES = 200_000
_KMSG_RECORD = re.compile(r"^\d+,\d+,(\d+),[^;]*;(.*)$")


def dmesg_log(path: Path, with_findings: bool) -> int:
    """The H200 capture as `dmesg` lines (real noise), with the fixture's findings or not,
    repeated to SCAN_LINES lines."""
    noise = []
    for line in _lines(CAPTURE):
        if (match := _KMSG_RECORD.match(line)) is not None:
            noise.append(f"[{int(match[1]) / 1e6:12.6f}] {match[2]}")
    base = noise + (_lines(FIXTURES / "dmesg.txt") if with_findings else [])
    lines = (base * (SCAN_LINES // len(base) + 1))[:SCAN_LINES]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def timed_scan(path: Path) -> int:
    with path.open("rb") as handle:  # as `scan` opens it
        return len(scan_stream(handle, ParseStats()))


def timed_full(path: Path) -> int:
    with path.open("rb") as handle:
        records = parse_lines(iter_lines(handle), ParseStats())
        return len(list(MatcherSet(prefilter=False).scan(records)))


def bare_any(path: Path, prefixes: tuple[str, ...]) -> int:
    with path.open(encoding="utf-8", errors="replace") as handle:
        return sum(1 for line in handle if any(p in line for p in prefixes))


def bare_regex(path: Path, pattern: re.Pattern[str]) -> int:
    search = pattern.search
    with path.open(encoding="utf-8", errors="replace") as handle:
        return sum(1 for line in handle if search(line))


def scan_against_bare() -> None:
    prefixes = MatcherSet().triggers
    pattern = re.compile("|".join(re.escape(p) for p in prefixes))
    print(
        f"\nscan against a bare loop over the same file ({len(prefixes)} trigger words), "
        "best of 3, lines/s:"
    )
    print(
        f"{'file':<22}{'lines':>8}{'found':>7}{'bare any()':>12}{'bare regex':>12}"
        f"{'scan':>10}{'scan/any':>10}{'scan/regex':>11}{'no prefilter':>14}"
    )
    with tempfile.TemporaryDirectory() as folder:
        for label, with_findings in (("capture noise", False), ("noise + findings", True)):
            path = Path(folder) / "kern.log"
            count = dmesg_log(path, with_findings)
            print(f"{label:<22}{count:>8}" + scan_row(path, count, prefixes, pattern))


def scan_row(path: Path, count: int, prefixes: tuple[str, ...], pattern: re.Pattern[str]) -> str:
    found: list[int] = []
    t_any = best_of(3, lambda: bare_any(path, prefixes))
    t_regex = best_of(3, lambda: bare_regex(path, pattern))
    t_scan = best_of(3, lambda: found.append(timed_scan(path)))
    t_full = best_of(3, lambda: timed_full(path))
    return (
        f"{found[-1]:>7}{count / t_any:>12,.0f}{count / t_regex:>12,.0f}{count / t_scan:>10,.0f}"
        f"{t_scan / t_any:>10.2f}x{t_scan / t_regex:>10.2f}x{count / t_full:>14,.0f}"
    )


def follow_big_file(mib: int = 64) -> None:
    """The collector's reader on a saved log larger than any one read: every line read, in
    how many batches, how fast, and how much memory it took while holding a batch."""
    line = b"[   12.345678] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.log"
        with path.open("wb") as handle:
            block = line * (1024 * 1024 // len(line))
            for _ in range(mib):
                handle.write(block)
        process = psutil.Process()
        base = peak = process.memory_info().rss
        reader = FileLogReader(path, MemoryKeyValueStore())
        records = batches = 0
        started = time.perf_counter()
        while True:
            batch = reader.read()
            reader.commit(batch)
            records += len(batch.records)
            batches += 1
            peak = max(peak, process.memory_info().rss)  # while the batch is still held
            if not batch.more:
                break
        took = time.perf_counter() - started
    print(
        f"\nfollowed file: {mib} MiB, {records} lines in {batches} batches, "
        f"{records / took:,.0f} lines/s, RSS growth {(peak - base) / 1024 / 1024:.0f} MiB"
    )


def main() -> None:
    for name in sys.argv[1:]:
        summarise(Path(name))
    xid = re.compile(r"NVRM: Xid")
    print(
        f"{'shape':<24}{'lines':>9}{'findings':>10}{'parse lines/s':>16}"
        f"{'parse+match lines/s':>22}{'bare regex lines/s':>20}"
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

        def parse(lines: list[str] = lines) -> None:
            for _ in parse_lines(lines, ParseStats()):
                pass

        def bare(lines: list[str] = lines) -> None:
            sum(1 for line in lines if xid.search(line))

        t_parse, t_full, t_bare = best_of(3, parse), best_of(3, full), best_of(3, bare)
        print(
            f"{shape:<24}{len(lines):>9}{found[-1]:>10}{len(lines) / t_parse:>16,.0f}"
            f"{len(lines) / t_full:>22,.0f}{len(lines) / t_bare:>20,.0f}"
        )
    scan_against_bare()
    follow_big_file()
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
